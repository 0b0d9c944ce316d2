"""The two lectures this library implements, by number and title — what people see instead of file names.

>>> label("000")
'lecture 000 · 简化自注意力'
>>> LECTURES["003"].title_en
'self-attention with learnable Q/K/V'
>>> name_lectures("lecture 003 (003_1980bb6a296476b4.txt), section 三")
'lecture 003 (自注意力 Q/K/V), section 三'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .i18n import _

__all__ = ["Lecture", "LECTURES", "get", "label", "lecture_title", "name_lectures"]


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
        raise KeyError(
            _("no lecture {number!r}; the lectures are {numbers}").format(
                number=number, numbers=", ".join(LECTURES)
            )
        )
    return LECTURES[number]


def label(number: str) -> str:
    """``lecture NNN · title`` — how commands name a lecture."""
    return _("lecture {number} · {title}").format(number=number, title=get(number).title)


def lecture_title(number: str) -> str:
    """The title of lecture ``number`` ("000", "003"); ``KeyError`` naming the known ones otherwise."""
    return get(number).title


_FILE = re.compile(r"\b(\d{3})_[0-9a-f]{16}\.txt\b")


def name_lectures(text: str) -> str:
    """``text`` with every lecture file name (``NNN_<16 hex>.txt``) replaced by that lecture's title."""
    return _FILE.sub(lambda m: LECTURES[m.group(1)].title if m.group(1) in LECTURES else m.group(0), text)
