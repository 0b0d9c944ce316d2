"""The two lectures this library implements, by number and title — what people see instead of file names.

>>> label("000")
'lecture 000 · 简化自注意力'
>>> LECTURES["003"].title_en
'self-attention with learnable Q/K/V'
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Lecture", "LECTURES", "get", "label"]


@dataclass(frozen=True)
class Lecture:
    """One lecture: its number, its title (Chinese, as the lecture names itself) and an English gloss,
    the formula it teaches, and the file it came as (provenance only; never shown as its name)."""

    number: str
    title: str
    title_en: str
    formula: str
    file: str


LECTURES: dict[str, Lecture] = {
    "000": Lecture(
        "000",
        "简化自注意力",
        "simplified (parameter-free) self-attention",
        "Z = softmax(X Xᵀ) X",
        "000_d8a7f694faaa8a59.txt",
    ),
    "003": Lecture(
        "003",
        "自注意力 Q/K/V",
        "self-attention with learnable Q/K/V",
        "softmax(Q Kᵀ / √d_k) V",
        "003_1980bb6a296476b4.txt",
    ),
}


def get(number: str) -> Lecture:
    """The lecture numbered ``number`` ("000" or "003"); ``KeyError`` naming the numbers otherwise."""
    if number not in LECTURES:
        raise KeyError(f"no lecture {number!r}; the lectures are {', '.join(LECTURES)}")
    return LECTURES[number]


def label(number: str) -> str:
    """``lecture NNN · title`` — how commands name a lecture."""
    return f"lecture {number} · {get(number).title}"
