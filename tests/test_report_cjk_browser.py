"""Chinese in the HTML report, in headless chromium, on a machine that has **no** CJK font.

Chromium finds fonts through fontconfig; these tests point it (``FONTCONFIG_FILE``) at a configuration
holding only DejaVu, which has no Chinese glyph. There, a character without a font is drawn as the
same missing-glyph box whatever the character, so two different characters give identical pixels.
The control (a report rendered without the embedded subset) must show that tofu, or the setup could
not tell; the real report must draw 苹 and 果 differently, with ink.

Skipped when playwright, chromium, Debian's DejaVu fonts or a CJK font for the subset is missing.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest

from selfattention import fonts
from selfattention.report import model_report, write_report

from .test_report import payload_of, synthetic_run
from .test_report_browser import ARGS, CHROMIUM

DEJAVU = Path("/usr/share/fonts/truetype/dejavu")
TOKENS = ["[CLS]", "他", "咬", "了", "一", "口", "苹", "果", "[SEP]"]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="needs playwright (dev extra)"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"needs chromium at {CHROMIUM}"),
    pytest.mark.skipif(not DEJAVU.is_dir(), reason=f"needs DejaVu fonts in {DEJAVU} (a font without CJK)"),
    pytest.mark.skipif(fonts.find_cjk_font() is None, reason="no CJK font to embed: run `make zh`"),
]

# Draws one character with the page's own font stack (what the heatmap labels use) on a fresh canvas
# and returns its pixels' alpha channel.
PROBE = """(ch) => {
  const c = document.createElement('canvas'); c.width = 64; c.height = 64;
  const ctx = c.getContext('2d');
  ctx.font = '48px ' + getComputedStyle(document.body).fontFamily;
  ctx.textBaseline = 'middle'; ctx.fillStyle = '#000'; ctx.fillText(ch, 4, 32);
  const d = ctx.getImageData(0, 0, 64, 64).data, a = [];
  for (let i = 3; i < d.length; i += 4) a.push(d[i]);
  return a;
}"""


@pytest.fixture(scope="module")
def latin_only_browser(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    d = tmp_path_factory.mktemp("fontconfig")
    conf = d / "fonts.conf"
    conf.write_text(
        f'<?xml version="1.0"?>\n<fontconfig><dir>{DEJAVU}</dir><cachedir>{d / "cache"}</cachedir></fontconfig>\n',
        encoding="utf-8",
    )
    env = {**os.environ, "FONTCONFIG_FILE": str(conf)}
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, env=env)
        yield b
        b.close()


def _chinese_report(path: Path) -> Path:
    run = dataclasses.replace(synthetic_run(len(TOKENS), n_layers=2, n_heads=2, seed=5), tokens=TOKENS)
    run.text = "他咬了一口苹果"
    write_report(model_report(run, head=(1, 1), token=6), path)
    return path


def _glyphs(browser, path: Path) -> dict[str, list[int]]:
    """The alpha pixels of 苹, 果 and 咬 drawn with the page's font stack, once the page is ready."""
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    errors: list[str] = []
    requests: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    try:
        page.goto(path.as_uri())
        page.wait_for_selector("#app[data-ready='1']", timeout=60_000)
        out = {ch: page.evaluate(PROBE, ch) for ch in ("苹", "果", "咬")}
    finally:
        page.close()
    assert not errors, errors
    assert all(u.startswith("file://") for u in requests), requests  # no network, the font included
    return out


def test_report_embeds_a_subset_of_the_page_glyphs(tmp_path):
    html = _chinese_report(tmp_path / "zh.html").read_text(encoding="utf-8")
    assert "@font-face" in html and "font-src data:" in html
    assert f'"{fonts.REPORT_FAMILY}"' in html.split("</style>")[0].split("@font-face")[1]
    # the CSS stacks name the embedded family (so the canvases draw with it too)
    assert html.count(f'"{fonts.REPORT_FAMILY}"') >= 3
    # a subset: far smaller than the 5 MB font file
    assert len(html) < 200_000
    assert "苹" in payload_of(html)["tokens"]


def test_an_english_report_embeds_only_the_caveat_glyphs(tmp_path):
    write_report(model_report(synthetic_run(6, seed=1)), tmp_path / "en.html")
    html = (tmp_path / "en.html").read_text(encoding="utf-8")
    # the caveat is always given in Chinese too, so its glyphs are embedded whatever the tokens
    assert "@font-face" in html and len(html) < 80_000
    assert fonts.font_face_css("only latin text") == ""


def test_chinese_tokens_render_as_real_glyphs_not_tofu(latin_only_browser, tmp_path, monkeypatch):
    real = _glyphs(latin_only_browser, _chinese_report(tmp_path / "zh.html"))
    # control: the same page without the embedded subset must show tofu on this Latin-only chromium
    monkeypatch.setattr(fonts, "font_face_css", lambda text, family=fonts.REPORT_FAMILY: "")
    tofu = _glyphs(latin_only_browser, _chinese_report(tmp_path / "tofu.html"))
    assert tofu["苹"] == tofu["果"] == tofu["咬"], "the control shows real glyphs: the setup cannot see tofu"
    for ch in ("苹", "果", "咬"):
        assert sum(v > 0 for v in real[ch]) > 30, f"{ch} drew no ink"
        assert real[ch] != tofu[ch], f"{ch} is drawn as the missing-glyph box"
    assert real["苹"] != real["果"] != real["咬"] != real["苹"]
