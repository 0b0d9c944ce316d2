"""Which writing system a text uses (stdlib only, no torch): CJK detection for model hints and fonts.

>>> has_cjk("他咬了一口苹果"), has_cjk("apple"), has_cjk("，")
(True, False, True)
>>> cjk_chars("a苹果b苹")
'苹果'
"""

from __future__ import annotations

import re

__all__ = ["cjk_chars", "has_cjk"]

# CJK ideographs, radicals, kana, hangul, CJK punctuation and full-width forms
_CJK = re.compile(
    "[\u2e80-\u2fdf\u3000-\u303f\u3040-\u30ff\u3100-\u312f\u3190-\u31ff\u3400-\u4dbf\u4e00-\u9fff"
    "\uac00-\ud7af\uf900-\ufaff\ufe30-\ufe4f\uff00-\uffef\U00020000-\U0002ffff]"
)


def has_cjk(text: str) -> bool:
    """Whether ``text`` holds a CJK character (ideograph, kana, hangul, CJK or full-width punctuation)."""
    return _CJK.search(text) is not None


def cjk_chars(text: str) -> str:
    """The distinct CJK characters of ``text``, in order of first appearance."""
    return "".join(dict.fromkeys(_CJK.findall(text)))
