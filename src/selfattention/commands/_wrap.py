"""Line breaking for Chinese in the terminal: a line may break between any two CJK characters.

rich breaks lines only at white space, so a Chinese sentence (which has none) is one "word": in a
table cell that must not fold it is cut with "…", elsewhere it is pushed whole onto the next line and
then chopped at the border. :func:`install` teaches rich's word splitter (``rich._wrap.words``, the
one function its wrapping asks where words are) the break opportunities of Chinese text:

- between two CJK characters, and between a CJK character and a Latin word (``在 TEXT 上`` and
  ``的token`` alike);
- never before closing punctuation (``，。、；：！？）」』》】”’…``) nor after opening punctuation
  (``（「『《【“‘``), the basic rule of Chinese line breaking (GB/T 15834, JIS X 4051 "kinsoku");
- never inside a Latin word, a number or a code name (``all-MiniLM-L6-v2``, ``--model``);
- never next to a WORD JOINER (U+2060, zero cells wide): the catalog writes a term that must stay
  whole as ``最\u2060大\u2060值``.

English text has no CJK characters and is split exactly as before. rich's ``Text.rstrip_end`` (which
drops the white space a wrapped line ends with) compares characters with cells, so a Chinese line
ending in a space was then cut with "…": it is given the same rule counted in cells. And a word
longer than its cell (a long path in a help table) is folded onto the next line, not cut with "…":
wrapped text never loses characters (a column that asks for ``no_wrap`` is not wrapped at all, and
keeps its own overflow).

>>> [w for _s, _e, w in cjk_words("在 TEXT 上运行，每个token。")]
['在 ', 'TEXT ', '上', '运', '行，', '每', '个', 'token。']
>>> [w for _s, _e, w in cjk_words("行最\u2060大\u2060值")] == ["行", "最\u2060大\u2060值"]
True
>>> [w for _s, _e, w in cjk_words("an all-MiniLM-L6-v2 model")]
['an ', 'all-MiniLM-L6-v2 ', 'model']
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from rich.cells import cell_len, get_character_cell_size

__all__ = ["CLOSING", "OPENING", "WORD_JOINER", "cjk_words", "install", "is_cjk"]

#: may not begin a line: they stay with the character before them
CLOSING = frozenset("，。、；：！？）」』》〉】〕”’…·%％,.;:!?)]}")
#: may not end a line: they stay with the character after them
OPENING = frozenset("（「『《〈【〔“‘([{")

#: U+2060: no line break on either side of it (invisible, zero cells)
WORD_JOINER = "\u2060"

_WORD = re.compile(r"\s*\S+\s*")


def is_cjk(ch: str) -> bool:
    """Whether ``ch`` is a character a Chinese line may break around: a wide (2-cell) character —
    Han, kana, hangul, full-width punctuation and forms.

    >>> is_cjk("注"), is_cjk("，"), is_cjk("a"), is_cjk("→")
    (True, True, False, False)
    """
    return get_character_cell_size(ch) == 2


def _breaks(word: str) -> Iterator[int]:
    """Offsets inside ``word`` (no white space in it, except at its ends) where a line may break."""
    for i in range(1, len(word)):
        before, after = word[i - 1], word[i]
        if after.isspace() or before.isspace() or WORD_JOINER in (before, after):
            continue
        if not (is_cjk(before) or is_cjk(after)):
            continue  # inside a Latin word, a number, a code name
        if after in CLOSING or before in OPENING:
            continue
        yield i


def cjk_words(text: str) -> Iterator[tuple[int, int, str]]:
    """rich's ``words`` with the break opportunities of Chinese text: ``(start, end, word)`` where a
    word carries the white space after it, as rich's own splitter does."""
    for match in _WORD.finditer(text):
        start, end = match.span()
        word = match.group(0)
        cut = start
        for i in _breaks(word):
            yield cut, start + i, text[cut : start + i]
            cut = start + i
        yield cut, end, text[cut:end]


def _rstrip_end_cells(self, size: int) -> None:
    """``Text.rstrip_end`` measured in cells: drop trailing white space that goes beyond ``size`` cells."""
    excess = cell_len(self.plain) - size
    if excess > 0:
        trailing = len(self.plain) - len(self.plain.rstrip())
        if trailing:
            self.right_crop(min(trailing, excess))


_original: Callable[..., object] | None = None


def install() -> None:
    """Make rich wrap Chinese at character boundaries (idempotent). A rich without ``rich._wrap.words``
    is left alone (tests/test_cli_layout.py then fails on the first cut line)."""
    global _original
    try:
        import rich._wrap as rich_wrap
    except ImportError:  # pragma: no cover - every rich ≥ 12 has it
        return
    if _original is None and callable(getattr(rich_wrap, "words", None)):
        import rich.text
        from rich.text import Text

        _original = rich_wrap.words
        rich_wrap.words = cjk_words
        divide = rich_wrap.divide_line

        def divide_line(text: str, width: int, fold: bool = True) -> list[int]:
            return divide(text, width, fold=True)

        rich.text.divide_line = divide_line  # type: ignore[assignment]
        Text.rstrip_end = _rstrip_end_cells  # type: ignore[method-assign]
