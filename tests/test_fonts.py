"""Chinese glyphs in our matplotlib figures (:mod:`selfattention.fonts`).

Tofu check: without a CJK font every Chinese character is drawn as the same missing-glyph box, so two
different characters give identical pixels; with a real font they differ. The control (matplotlib's
own Figure, DejaVu Sans only) shows the tofu, so the check can fail.
"""

from __future__ import annotations

import importlib.util
import io
import warnings

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from selfattention import fonts
from selfattention.viz import attention_head_grid, attention_heatmap

needs_cjk_font = pytest.mark.skipif(
    fonts.find_cjk_font() is None,
    reason="no CJK font: run `make zh` (paperang-p2-fonts-cjk) or apt-get install fonts-wqy-microhei",
)


def _pixels(fig) -> np.ndarray:
    buf = io.BytesIO()
    fig.savefig(buf, format="rgba", dpi=50)
    w, h = fig.canvas.get_width_height()
    return np.frombuffer(buf.getvalue(), np.uint8).reshape(int(h * 50 / fig.dpi), -1, 4)


def _char(ch: str, make=fonts.new_figure) -> np.ndarray:
    fig = make(figsize=(1, 1))
    fig.text(0.5, 0.5, ch, fontsize=40, ha="center", va="center")
    return _pixels(fig)


def _glyph_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "Glyph" in str(w.message) and "missing" in str(w.message)]


@needs_cjk_font
def test_chinese_characters_are_real_glyphs_not_tofu():
    blank = _pixels(fonts.new_figure(figsize=(1, 1)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ping, guo = _char("苹"), _char("果")
    assert not _glyph_warnings(caught)
    assert not (ping == blank).all() and not (guo == blank).all()  # ink was drawn
    assert not (ping == guo).all()  # two different glyphs, not the same box
    # control: matplotlib's own figure (DejaVu Sans only) draws one box for both, with a glyph warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tofu_ping, tofu_guo = _char("苹", Figure), _char("果", Figure)
    assert _glyph_warnings(caught)
    assert (tofu_ping == tofu_guo).all()
    assert not (ping == tofu_ping).all()


@needs_cjk_font
def test_heatmap_with_chinese_tick_labels_raises_no_glyph_warning(tmp_path):
    tokens = ["[CLS]", "他", "咬", "了", "一", "口", "苹", "果", "[SEP]"]
    w = torch.softmax(torch.randn(9, 9, generator=torch.Generator().manual_seed(0)), dim=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attention_heatmap(w, tokens, tokens, title="第 3 讲 · 他咬了一口苹果").savefig(tmp_path / "h.png")
        attention_head_grid(w[None, None].expand(2, 2, 9, 9), title="苹果").savefig(tmp_path / "g.svg")
    assert not [str(c.message) for c in caught if "Glyph" in str(c.message)]


@needs_cjk_font
def test_latin_text_keeps_dejavu_and_global_rc_is_untouched(tmp_path):
    before = dict(matplotlib.rcParams)
    fig = fonts.new_figure(figsize=(2, 1))
    text = fig.text(0.1, 0.5, "apple 苹果")
    fig.savefig(tmp_path / "a.png")
    assert text.get_fontfamily() == [fonts.FALLBACK_LATIN, fonts.cjk_family()]
    assert dict(matplotlib.rcParams) == before
    assert fonts.figure_rc()["font.family"][0] == "DejaVu Sans"
    # a text that names its own font keeps it
    own = fig.text(0.1, 0.1, "x", family="serif")
    fig.savefig(tmp_path / "b.png")
    assert own.get_fontfamily() == ["serif"]


def test_without_a_cjk_font_one_clear_warning_not_one_per_glyph(monkeypatch, tmp_path):
    monkeypatch.setattr(fonts, "find_cjk_font", lambda: None)
    fig = fonts.new_figure(figsize=(2, 1))
    fig.text(0.1, 0.5, "他咬了一口苹果")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig.savefig(tmp_path / "x.png")
    ours = [c for c in caught if issubclass(c.category, fonts.MissingCJKFontWarning)]
    assert len(ours) == 1 and "make zh" in str(ours[0].message)
    assert not _glyph_warnings(caught)
    # Latin-only figures say nothing
    fig = fonts.new_figure(figsize=(2, 1))
    fig.text(0.1, 0.5, "apple")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig.savefig(tmp_path / "y.png")
    assert not caught
    assert fonts.font_face_css("苹果") == ""  # and the report embeds nothing


@pytest.mark.skipif(
    importlib.util.find_spec("paperang_p2_fonts_cjk") is None, reason="needs paperang-p2-fonts-cjk (make zh)"
)
def test_the_pypi_font_package_is_found_and_registers_wenquanyi():
    path = fonts._package_font()
    assert path is not None and path.name == "wqy-microhei.ttc" and path.is_file()
    assert fonts._register(path) == "WenQuanYi Micro Hei"
    from matplotlib import font_manager

    assert any(e.name == "WenQuanYi Micro Hei" for e in font_manager.fontManager.ttflist)


@needs_cjk_font
def test_font_face_css_holds_exactly_the_needed_glyphs():
    import base64
    import re

    from fontTools.ttLib import TTFont

    css = fonts.font_face_css("apple 苹果 苹")
    data = base64.b64decode(re.search(r"base64,([A-Za-z0-9+/=]+)", css).group(1))
    font = TTFont(io.BytesIO(data))
    cmap = font.getBestCmap()
    assert ord("苹") in cmap and ord("果") in cmap
    assert ord("咬") not in cmap  # a subset, not the 5 MB font
    assert len(data) < 20_000
    assert fonts.font_face_css("apple") == ""


@pytest.mark.skipif(
    importlib.util.find_spec("paperang_p2_fonts_cjk") is None, reason="needs paperang-p2-fonts-cjk (make zh)"
)
def test_without_system_fonts_the_pypi_package_is_the_font(monkeypatch, tmp_path):
    """A fresh machine: matplotlib knows no CJK family and Debian's file is absent."""
    from pathlib import Path

    monkeypatch.setattr(fonts, "KNOWN_FAMILIES", ())
    monkeypatch.setattr(fonts, "DEBIAN_FONT", Path(tmp_path / "absent.ttc"))
    fonts.find_cjk_font.cache_clear()
    try:
        family, path = fonts.find_cjk_font()
        assert family == "WenQuanYi Micro Hei" and path == fonts._package_font()
        assert "@font-face" in fonts.font_face_css("苹果")
        assert not (_char("苹") == _char("果")).all()
    finally:
        fonts.find_cjk_font.cache_clear()
