"""The HTML report in a real browser: Playwright driving Debian's chromium (never a downloaded browser).

Skipped cleanly when playwright or chromium is missing (``.ci/run`` installs chromium, so CI runs them).
The chromium binary is ``$SELFATTENTION_CHROMIUM`` or ``/usr/bin/chromium``. Screenshots are written to
``artifacts/`` (git-ignored) as test artefacts.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from selfattention.functional import attention_steps
from selfattention.report import decode_array, example_report, model_report, write_report
from selfattention.worked import load_example

from .oracle import attention_ref
from .test_report import payload_of, synthetic_run

CHROMIUM = os.environ.get("SELFATTENTION_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="needs playwright (dev extra)"),
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason=f"needs chromium at {CHROMIUM} (apt-get install chromium)"
    ),
]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """name -> (path, payload, run or example): a worked example, a small model-shaped report, 512 tokens."""
    d = tmp_path_factory.mktemp("reports")
    out = {}
    ex = load_example("two-token")
    p = example_report(ex)
    write_report(p, d / "two-token.html")
    out["two-token"] = (d / "two-token.html", p, ex)
    run = synthetic_run(20, n_layers=2, n_heads=3, head_dim=6, seed=3)
    p = model_report(run, head=(1, 1), token=1)
    write_report(p, d / "small.html")
    out["small"] = (d / "small.html", p, run)
    run = synthetic_run(512, n_layers=6, n_heads=12, head_dim=32, seed=4)
    p = model_report(run, head=(3, 5), token=100)
    write_report(p, d / "long.html")
    out["long"] = (d / "long.html", p, run)
    return out


class Page:
    """A page with every console message, page error and request recorded."""

    def __init__(self, browser, path: Path, width: int = 1400):
        self.page = browser.new_page(viewport={"width": width, "height": 1000})
        self.console: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.console.append((m.type, m.text)))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))
        start = time.perf_counter()
        self.page.goto(path.as_uri())
        self.page.wait_for_selector("#app[data-ready='1']", timeout=60_000)
        self.load_seconds = time.perf_counter() - start

    def state(self) -> dict:
        return self.page.evaluate("({...document.getElementById('app').dataset})")

    def cell_point(self, i: int, j: int) -> tuple[float, float]:
        """Client coordinates of the centre of heatmap cell (query i, key j)."""
        g = self.page.evaluate(
            """() => { const c = document.getElementById('overlay'), r = c.getBoundingClientRect();
                 return {x: r.left, y: r.top, w: r.width, ...c.dataset}; }"""
        )
        k = g["w"] / float(g["size"])
        cell = float(g["cell"])
        return g["x"] + (float(g["left"]) + (j + 0.5) * cell) * k, g["y"] + (
            float(g["top"]) + (i + 0.5) * cell
        ) * k

    def hover(self, i: int, j: int) -> dict:
        self.page.locator("#overlay").scroll_into_view_if_needed()
        x, y = self.cell_point(i, j)
        self.page.mouse.move(x, y)
        self.page.wait_for_selector("#tooltip:not([hidden])")
        return self.page.evaluate(
            "() => { const t = document.getElementById('tooltip');"
            " return {...t.dataset, text: t.textContent, shown: t.querySelector('.w').textContent}; }"
        )

    def overlay_alpha(self, i: int, j: int) -> int:
        """Alpha of the highlight overlay at the centre of cell (i, j): 0 = not veiled (highlighted)."""
        return self.page.evaluate(
            """([i, j]) => { const c = document.getElementById('overlay'), d = c.dataset;
                 const s = c.width / +d.size, cell = +d.cell;
                 const x = Math.round((+d.left + (j + 0.5) * cell) * s), y = Math.round((+d.top + (i + 0.5) * cell) * s);
                 return c.getContext('2d').getImageData(x, y, 1, 1).data[3]; }""",
            [i, j],
        )

    def close(self):
        self.page.close()

    def assert_clean(self):
        bad = [(t, m) for t, m in self.console if t in ("error", "warning")]
        assert not bad, bad
        assert not self.errors, self.errors
        assert self.page.locator("#error").is_hidden()
        assert self.requests and all(u.startswith("file://") for u in self.requests), self.requests


@pytest.fixture()
def open_page(browser):
    pages = []

    def _open(path: Path, width: int = 1400) -> Page:
        pg = Page(browser, path, width)
        pages.append(pg)
        return pg

    yield _open
    for pg in pages:
        pg.close()


@pytest.mark.parametrize("name", ["two-token", "small"])
def test_loads_with_no_console_errors_and_no_network(open_page, reports, name):
    path, payload, _ = reports[name]
    pg = open_page(path)
    pg.assert_clean()
    assert pg.page.locator(".tok").count() == payload["n_tokens"]
    assert "not by themselves an explanation" in pg.page.locator("#caveat").inner_text()
    assert pg.page.locator("#trace table").count() >= 1
    n_thumbs = pg.page.locator(".thumb").count()
    assert n_thumbs == (0 if name == "two-token" else payload["n_layers"] * payload["n_heads"])


def test_clicking_a_token_moves_the_highlight(open_page, reports):
    path, payload, run = reports["small"]
    pg = open_page(path)
    assert pg.state()["token"] == "1"
    # cell (10, 15) is outside the selected row/column: veiled; row 1 is highlighted
    assert pg.overlay_alpha(10, 15) > 0
    assert pg.overlay_alpha(1, 15) == 0
    pg.page.locator(".tok[data-i='10']").click()
    assert pg.state()["token"] == "10"
    assert pg.page.locator("#overlay").get_attribute("data-row") == "10"
    assert pg.overlay_alpha(10, 15) == 0  # now in the highlighted row (what token 10 attends to)
    assert pg.overlay_alpha(15, 10) == 0  # and column (what attends to token 10)
    assert pg.overlay_alpha(1, 15) > 0  # the old row is veiled again
    # the token shading follows the library's weights of row 10
    w = attention_steps(run.queries[1, 1], run.keys[1, 1], run.values[1, 1]).weights[10]
    shades = [float(s) for s in pg.page.eval_on_selector_all(".tok", "els => els.map(e => e.dataset.shade)")]
    np.testing.assert_allclose(shades, (w / w.max()).numpy(), atol=1e-4)
    assert pg.page.locator(".tok.sel").get_attribute("data-i") == "10"
    # "what attends to it": the shading becomes column 10
    pg.page.locator("#dir-toggle button[data-dir='in']").click()
    col = attention_steps(run.queries[1, 1], run.keys[1, 1], run.values[1, 1]).weights[:, 10]
    shades = [float(s) for s in pg.page.eval_on_selector_all(".tok", "els => els.map(e => e.dataset.shade)")]
    np.testing.assert_allclose(shades, (col / col.max()).numpy(), atol=1e-4)
    # the trace follows: its highlighted row is key 10 of query 10
    assert pg.page.locator("#trace tr.sel").first.get_attribute("data-key") == "10"
    # clicking a heatmap cell selects its query token; the arrow keys step through tokens
    pg.page.locator("#overlay").scroll_into_view_if_needed()
    pg.page.mouse.click(*pg.cell_point(14, 3))
    assert pg.state()["token"] == "14"
    pg.page.keyboard.press("ArrowRight")
    assert pg.state()["token"] == "15"
    assert pg.overlay_alpha(15, 2) == 0 and pg.overlay_alpha(14, 2) > 0
    pg.assert_clean()


def test_hover_shows_the_weight_the_library_computed(open_page, reports):
    path, payload, run = reports["small"]
    pg = open_page(path)
    steps = attention_steps(run.queries[1, 1], run.keys[1, 1], run.values[1, 1])
    _, oracle = attention_ref(run.queries[1, 1], run.keys[1, 1], run.values[1, 1])
    for i, j in [(0, 0), (3, 17), (19, 2), (11, 11)]:
        tip = pg.hover(i, j)
        assert (tip["query"], tip["key"], tip["exact"]) == (str(i), str(j), "1")
        shown = float(tip["weight"])
        assert shown == float(steps.weights[i, j])  # the library's float32, bit for bit
        assert shown == pytest.approx(float(oracle[i, j]), rel=1e-5, abs=1e-7)
        assert float(tip["shown"]) == pytest.approx(
            float(steps.weights[i, j]), rel=1e-5
        )  # 6 digits on screen
        assert run.tokens[i] in tip["text"] and run.tokens[j] in tip["text"]
    # another head, chosen in the grid
    pg.page.locator(".thumb[data-layer='0'][data-head='2']").click()
    assert (pg.state()["layer"], pg.state()["head"]) == ("0", "2")
    tip = pg.hover(5, 6)
    assert float(tip["weight"]) == float(
        attention_steps(run.queries[0, 2], run.keys[0, 2], run.values[0, 2]).weights[5, 6]
    )
    pg.assert_clean()


def test_worked_example_hover_is_the_lectures_number(open_page, reports):
    path, payload, ex = reports["two-token"]
    pg = open_page(path, width=1100)
    tip = pg.hover(0, 0)
    assert float(tip["weight"]) == float(ex.steps.weights[0, 0])  # float64, exact
    assert "0.669762" in tip["text"]  # lecture 003: weight(1,1) ≈ 0.670
    text = pg.page.locator("#trace").inner_text()
    assert "1.340" in text and "0.660" in text and "0.66976" in text  # context (1.340, 0.660), weight
    ARTIFACTS.mkdir(exist_ok=True)
    pg.page.screenshot(path=str(ARTIFACTS / "report-two-token.png"), full_page=True)
    pg.assert_clean()


def test_512_tokens_render_and_stay_exact(open_page, reports):
    path, payload, run = reports["long"]
    size = path.stat().st_size
    pg = open_page(path)
    timings = pg.page.evaluate("window.__report")
    print(
        f"\n512 tokens × 72 heads: file {size / 1e6:.1f} MB, page ready in {pg.load_seconds:.2f} s "
        f"(decode {timings['decodeMs']:.0f} ms, draw {timings['renderMs']:.0f} ms)"
    )
    assert pg.load_seconds < 15, "hang guard"
    assert size < 40e6
    assert pg.state() == {**pg.state(), "layer": "3", "head": "5", "token": "100"}
    w = attention_steps(run.queries[3, 5], run.keys[3, 5], run.values[3, 5]).weights
    tip = pg.hover(100, 400)
    # cells are ~1 CSS pixel here, and mouse positions are whole pixels: take the cell the page reports
    i, j = int(tip["query"]), int(tip["key"])
    assert abs(i - 100) <= 1 and abs(j - 400) <= 1
    assert float(tip["weight"]) == float(w[i, j]) and tip["exact"] == "1"
    # a head without an exact trace: the hover says so and shows the 8-bit value
    not_exact = next(f"{la}.{h}" for la in range(6) for h in range(12) if f"{la}.{h}" not in payload["exact"])
    la, h = map(int, not_exact.split("."))
    pg.page.locator(f".thumb[data-layer='{la}'][data-head='{h}']").click()
    tip = pg.hover(7, 9)
    i, j = int(tip["query"]), int(tip["key"])
    assert abs(i - 7) <= 1 and abs(j - 9) <= 1
    assert tip["exact"] == "0" and "exact not stored" in tip["text"]
    q = float(decode_array(payload["weights_u8"])[la, h, i, j])
    assert float(tip["weight"]) == pytest.approx((q / 255) ** 2, rel=1e-6)
    true = float(run.attentions[la, h, i, j])
    assert abs(float(tip["weight"]) ** 0.5 - true**0.5) <= 0.5 / 255 + 1e-6
    assert "not stored in this file" in pg.page.locator("#trace").inner_text()
    assert pg.page.locator(".thumb.exact").count() == len(payload["exact"]) < 72
    pg.page.locator("#trace button[data-goto='3.5']").click()  # back to a head with a trace
    assert (pg.state()["layer"], pg.state()["head"]) == ("3", "5")
    assert pg.page.locator("#trace table").count() == 1
    # clicking a token at 512 tokens still moves the highlight
    pg.page.locator(".tok[data-i='300']").scroll_into_view_if_needed()
    pg.page.locator(".tok[data-i='300']").click()
    assert pg.state()["token"] == "300"
    ARTIFACTS.mkdir(exist_ok=True)
    pg.page.screenshot(path=str(ARTIFACTS / "report-512.png"), full_page=True)
    pg.assert_clean()


def test_payload_in_the_page_is_the_one_written(reports):
    path, payload, run = reports["small"]
    back = payload_of(path.read_text(encoding="utf-8"))
    assert back["tokens"] == payload["tokens"]
    assert torch.equal(
        torch.from_numpy(decode_array(back["exact"]["1.1"]["weights"]).copy()),
        attention_steps(run.queries[1, 1], run.keys[1, 1], run.values[1, 1]).weights,
    )


def _contrast(a, b) -> float:
    def lum(c):
        c = [x / 255 for x in c[:3]]
        c = [x / 12.92 if x <= 0.03928 else ((x + 0.055) / 1.055) ** 2.4 for x in c]
        return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]

    hi, lo = sorted((lum(a), lum(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_numbers_in_the_cells_are_readable(open_page, tmp_path):
    """The journey example writes its weights in the cells: no veil over them, and text and cell colour
    at a WCAG contrast of at least 4.5 (grey 0.3273 and white 0.3546 on light blue were hard to read)."""
    path = tmp_path / "journey.html"
    write_report(example_report(load_example("journey")), path)
    pg = open_page(path, width=1100)
    cells = pg.page.evaluate(
        """() => { const h = document.getElementById('heatmap'), d = document.getElementById('overlay').dataset;
             const s = h.width / +d.size, cell = +d.cell, out = [];
             const all = h.getContext('2d').getImageData(0, 0, h.width, h.height).data;  // one read-back
             for (let i = 0; i < 3; i++) for (let j = 0; j < 3; j++) {
               const x0 = Math.round((+d.left + j * cell) * s) + 3, y0 = Math.round((+d.top + i * cell) * s) + 3;
               const n = Math.round(cell * s) - 6, px = [];
               for (let y = y0; y < y0 + n; y++) for (let x = x0; x < x0 + n; x++) {
                 const o = 4 * (y * h.width + x); px.push(all[o], all[o + 1], all[o + 2], all[o + 3]);
               }
               out.push([i, j, px]);
             }
             return out; }"""
    )
    for i, j, data in cells:
        assert pg.overlay_alpha(i, j) == 0, (i, j)  # nothing veils a cell that shows its number
        px = [tuple(data[k : k + 3]) for k in range(0, len(data), 4)]
        background = max(set(px), key=px.count)
        ink = max(px, key=lambda p: sum(abs(a - b) for a, b in zip(p, background, strict=True)))
        assert _contrast(background, ink) >= 4.5, (i, j, background, ink)
    pg.assert_clean()


def test_a_long_input_report_has_statistics_and_matrices_of_the_stored_heads_only(open_page, tmp_path):
    """Statistics mode (no weight matrices kept): grey thumbnails for heads without a matrix, a message
    instead of the heatmap, and the tiled path's heaviest keys of the selected query."""
    from selfattention.hf import AttentionCall

    run = synthetic_run(40, n_layers=2, n_heads=3, head_dim=6, seed=5)
    run.calls = [
        AttentionCall(
            run.queries[la][None], run.keys[la][None], run.values[la][None], None, False, None, False, 40
        )
        for la in range(2)
    ]
    full_weights, run.attentions = run.attentions, None
    p = model_report(run, head=(1, 2), token=5, exact_budget_mb=1e-6, top_k=3)
    assert p["u8_heads"] == ["1.2"] and list(p["exact"]) == ["1.2"]
    path = tmp_path / "stats.html"
    write_report(p, path)
    pg = open_page(path)
    assert pg.page.locator(".thumb.nomatrix").count() == 5
    tip = pg.hover(5, 7)
    assert float(tip["weight"]) == pytest.approx(
        float(full_weights[1, 2, int(tip["query"]), int(tip["key"])]), rel=1e-5
    )
    pg.page.locator(".thumb[data-layer='0'][data-head='1']").click()
    assert "not stored in this file" in pg.page.locator("#trace").inner_text()
    keys = [
        int(k)
        for k in pg.page.eval_on_selector_all(
            "#trace .chips span[data-key]", "els => els.map(e => e.dataset.key)"
        )
    ]
    assert keys == torch.topk(full_weights[0, 1, 5], 3).indices.tolist()
    assert "No matrix" not in pg.page.locator("#trace").inner_text()
    pg.assert_clean()


def test_a_report_made_in_chinese_shows_chinese_words(open_page, tmp_path):
    """``--lang zh``: the page's own words (headings, trace tables, caveat) come from the catalog."""
    from selfattention import i18n

    with i18n.use_language("zh"):
        path = tmp_path / "zh.html"
        write_report(example_report(load_example("two-token")), path)
    pg = open_page(path)
    pg.assert_clean()
    assert pg.page.evaluate("document.documentElement.lang") == "zh"
    assert pg.page.locator(".tokens-card h2").inner_text() == "Token"
    assert "请谨慎解读" in pg.page.locator("#caveat").inner_text()
    assert "不能想当然地把注意力权重等同于" in pg.page.locator("#caveat").inner_text()
    trace = pg.page.locator("#trace").inner_text()
    assert "注意力分数" in trace and "上下文向量" in trace
    assert "Read with care" not in pg.page.locator("#caveat").inner_text()
