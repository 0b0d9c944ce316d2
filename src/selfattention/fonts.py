"""Chinese (CJK) glyphs in our pictures: find a CJK font, use it for our figures, embed it in reports.

matplotlib's default font, DejaVu Sans, has no Chinese characters: without help every 苹 is drawn as an
empty box and matplotlib warns once per missing glyph. This module finds a real CJK font, in this order:

1. a CJK family matplotlib already knows (its font list: WenQuanYi Micro Hei, Noto Sans CJK, ...);
2. Debian's ``fonts-wqy-microhei`` file, ``/usr/share/fonts/truetype/wqy/wqy-microhei.ttc``;
3. the PyPI package ``paperang-p2-fonts-cjk`` (``make zh`` installs it), which ships
   ``fonts/wqy-microhei.ttc``.

WenQuanYi Micro Hei (文泉驿微米黑) is dual-licensed: Apache 2.0 (what the font file's own licence field
says) or GPL v3+ with the font embedding exception (Debian's copyright file) — embedding its glyphs in a
document does not put the document under the GPL.

Our figures only (global ``rcParams`` are never changed): :func:`new_figure` makes a ``Figure`` whose
canvas draws inside ``matplotlib.rc_context`` with the fallback list ``DejaVu Sans`` then the CJK family,
so Latin text keeps DejaVu Sans and Chinese falls through to the CJK font. With no CJK font and Chinese in
the figure, drawing gives **one** :class:`MissingCJKFontWarning` saying how to get one, instead of
matplotlib's warning per glyph.

The HTML report embeds the glyphs it needs: :func:`font_face_css` subsets the font with
``fontTools.subset`` (fontTools is a matplotlib dependency) to the characters of the page and returns an
``@font-face`` rule with the subset as a base64 ``data:`` URL (no network; the report's CSP allows
``font-src data:``).

>>> has_cjk("他咬了一口苹果"), has_cjk("apple")
(True, False)
"""

from __future__ import annotations

import base64
import contextlib
import functools
import importlib.util
import io
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._scripts import cjk_chars, has_cjk
from .i18n import N_, _

__all__ = [
    "DEBIAN_FONT",
    "FALLBACK_LATIN",
    "INSTALL_HINT",
    "REPORT_FAMILY",
    "MissingCJKFontWarning",
    "cjk_chars",
    "cjk_family",
    "figure_rc",
    "find_cjk_font",
    "font_face_css",
    "has_cjk",
    "new_figure",
]

DEBIAN_FONT = Path("/usr/share/fonts/truetype/wqy/wqy-microhei.ttc")
"""Debian's ``fonts-wqy-microhei`` file."""
FALLBACK_LATIN = "DejaVu Sans"
"""The first family of our figures (matplotlib's own default); CJK glyphs fall through to the next."""
REPORT_FAMILY = "selfattention CJK"
"""The ``font-family`` name of the glyph subset embedded in HTML reports."""
INSTALL_HINT = N_(
    "no CJK font found, so Chinese characters are drawn as empty boxes: run `make zh` "
    "(or pip install --no-deps paperang-p2-fonts-cjk==0.1.0), or install Debian's fonts-wqy-microhei"
)
# CJK families matplotlib may already know (system fonts it indexed), best first
KNOWN_FAMILIES = (
    "WenQuanYi Micro Hei",
    "WenQuanYi Zen Hei",
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Source Han Sans SC",
    "SimHei",
    "Microsoft YaHei",
    "PingFang SC",
    "Heiti SC",
)
_GLYPH_WARNING = r"Glyph \d+ .*missing from font"


class MissingCJKFontWarning(UserWarning):
    """A figure holds Chinese (CJK) text but no CJK font was found (the message says how to get one)."""


def _package_font() -> Path | None:
    """``fonts/wqy-microhei.ttc`` of the PyPI package paperang-p2-fonts-cjk, found without importing it."""
    for name in ("paperang_p2_fonts_cjk",):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        roots = [Path(p) for p in (spec.submodule_search_locations or [])]
        if spec.origin and spec.origin not in ("namespace", "built-in"):
            roots.append(Path(spec.origin).parent)
        for root in roots:
            for candidate in (
                root / "fonts" / "wqy-microhei.ttc",
                root.parent / "fonts" / "wqy-microhei.ttc",
            ):
                if candidate.is_file():
                    return candidate
    return None


@functools.cache
def find_cjk_font() -> tuple[str, Path] | None:
    """``(family, file)`` of a CJK font for our figures and reports, or None when there is none.

    A font file found outside matplotlib's list is registered with
    ``matplotlib.font_manager.fontManager.addfont`` (once per process). Cached.
    """
    from matplotlib import font_manager

    manager = font_manager.fontManager
    for family in KNOWN_FAMILIES:
        for entry in manager.ttflist:
            if entry.name == family:
                return family, Path(entry.fname)
    for path in (DEBIAN_FONT, _package_font()):
        if path is not None and path.is_file():
            family = _register(path)
            if family is not None:
                return family, path
    return None


def _register(path: Path) -> str | None:
    """Add a font file to matplotlib's font manager; the family name of its proportional face."""
    from matplotlib import font_manager

    manager = font_manager.fontManager
    try:
        manager.addfont(str(path))
    except (OSError, RuntimeError, ValueError):  # pragma: no cover - a broken font file
        return None
    names = [e.name for e in manager.ttflist if Path(e.fname) == path]
    return next((n for n in names if "Mono" not in n), names[0] if names else None)


def cjk_family() -> str | None:
    """The CJK family name matplotlib will use (e.g. ``"WenQuanYi Micro Hei"``), or None."""
    found = find_cjk_font()
    return found[0] if found else None


def figure_rc() -> dict[str, Any]:
    """rcParams for our figures: DejaVu Sans first, then the CJK family (empty when there is none).

    matplotlib falls back glyph by glyph only along an explicit ``font.family`` list (a generic
    ``sans-serif`` resolves to one font), so the list names both families.
    """
    family = cjk_family()
    if family is None:
        return {}
    return {"font.family": [FALLBACK_LATIN, family]}


_GENERIC = {"sans-serif": FALLBACK_LATIN, "sans serif": FALLBACK_LATIN, "sans": FALLBACK_LATIN}


@contextlib.contextmanager
def _figure_fonts(figure: Any) -> Iterator[None]:
    """Draw ``figure`` with :func:`figure_rc`; with no CJK font and CJK text, one clear warning.

    Texts made before drawing with the default generic family get the explicit fallback list; texts
    that name their own font keep it.
    """
    import matplotlib
    from matplotlib.text import Text

    rc = figure_rc()
    texts = figure.findobj(Text)
    with matplotlib.rc_context(rc), warnings.catch_warnings():
        if rc:
            for text in texts:
                families = [f.lower() for f in text.get_fontfamily()]
                if len(families) == 1 and families[0] in _GENERIC:
                    text.set_fontfamily(rc["font.family"])
        elif any(has_cjk(t.get_text()) for t in texts):
            warnings.warn(_(INSTALL_HINT), MissingCJKFontWarning, stacklevel=4)
            warnings.filterwarnings("ignore", message=_GLYPH_WARNING, category=UserWarning)
        yield


def _canvas_class() -> type:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    class CJKCanvas(FigureCanvasAgg):
        """The Agg canvas, drawing and saving inside :func:`_figure_fonts`."""

        def draw(self) -> None:
            with _figure_fonts(self.figure):
                super().draw()

        def print_figure(self, *args: Any, **kwargs: Any) -> Any:
            with _figure_fonts(self.figure):
                return super().print_figure(*args, **kwargs)

    return CJKCanvas


_CANVAS: list[type] = []


def new_figure(**kwargs: Any) -> Any:
    """A ``matplotlib.figure.Figure(**kwargs)`` that renders Chinese: its canvas draws and saves with
    :func:`figure_rc` (DejaVu Sans, then the CJK font). Global rcParams are untouched.

    >>> fig = new_figure(figsize=(2, 1))
    >>> type(fig.canvas).__name__
    'CJKCanvas'
    """
    from matplotlib.figure import Figure

    if not _CANVAS:
        _CANVAS.append(_canvas_class())
    fig = Figure(**kwargs)
    _CANVAS[0](fig)
    return fig


@functools.cache
def _subset_bytes(path: Path, family: str, chars: str) -> bytes:
    """The glyphs of ``chars`` from ``family`` in the font file ``path``, as WOFF bytes (cached)."""
    from fontTools import subset
    from fontTools.ttLib import TTFont

    font_number = 0
    if path.suffix.lower() == ".ttc":
        from fontTools.ttLib import TTCollection

        names = [f["name"].getDebugName(1) for f in TTCollection(str(path)).fonts]
        font_number = names.index(family) if family in names else 0
    options = subset.Options()
    options.flavor = "woff"  # zlib: no extra dependency (woff2 needs brotli)
    options.layout_features = ["*"]
    options.name_IDs = ["*"]
    options.notdef_outline = True
    options.drop_tables = [
        *options.drop_tables,
        "FFTM",
    ]  # FontForge's timestamps: else one stderr line a report
    font = TTFont(str(path), fontNumber=font_number, lazy=False)
    subsetter = subset.Subsetter(options)
    subsetter.populate(text=chars)
    subsetter.subset(font)
    buf = io.BytesIO()
    font.flavor = "woff"
    font.save(buf)
    return buf.getvalue()


def font_face_css(text: str, family: str = REPORT_FAMILY) -> str:
    """An ``@font-face`` rule embedding the CJK glyphs of ``text`` (a subset of the CJK font, WOFF, as a
    base64 ``data:`` URL), or ``""`` when ``text`` has no CJK character or no CJK font is installed.

    The rule names ``family``; list it in a ``font-family`` after the Latin fonts.
    """
    chars = cjk_chars(text)
    if not chars:
        return ""
    found = find_cjk_font()
    if found is None:
        return ""
    data = _subset_bytes(found[1], found[0], "".join(sorted(chars)))
    encoded = base64.b64encode(data).decode("ascii")
    return (
        f'@font-face {{ font-family: "{family}"; font-style: normal; font-weight: 400; '
        f'src: url(data:font/woff;base64,{encoded}) format("woff"); }}'
    )
