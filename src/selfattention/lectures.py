"""The two lectures this library follows, by number and title, for messages a reader sees.

The lectures are stored as ``000_d8a7f694faaa8a59.txt`` and ``003_1980bb6a296476b4.txt``; a reader should see
their titles, not those file names.

>>> lecture_title("000")
'简化自注意力'
>>> name_lectures("lecture 003 (003_1980bb6a296476b4.txt), section 三")
'lecture 003 (自注意力 Q/K/V), section 三'
"""

from __future__ import annotations

import re

__all__ = ["LECTURES", "lecture_title", "name_lectures"]

LECTURES = {
    "000": "简化自注意力",
    "003": "自注意力 Q/K/V",
}
"""Lecture number → title (000: the parameter-free form; 003: scaled dot-product attention with W_q, W_k, W_v)."""

_FILE = re.compile(r"\b(\d{3})_[0-9a-f]{16}\.txt\b")


def lecture_title(number: str) -> str:
    """The title of lecture ``number`` ("000", "003"); ``KeyError`` naming the known ones otherwise."""
    try:
        return LECTURES[number]
    except KeyError:
        raise KeyError(f"no lecture {number!r}; the lectures are {sorted(LECTURES)}") from None


def name_lectures(text: str) -> str:
    """``text`` with every lecture file name (``NNN_<16 hex>.txt``) replaced by that lecture's title."""
    return _FILE.sub(lambda m: LECTURES.get(m.group(1), m.group(0)), text)
