"""The report's view switches (raw · ‖α f(x)‖ · rollout · flow, by token · by word) in a real browser.

Playwright driving Debian's chromium, like tests/test_report_browser.py (skipped where it is missing).
"""

from __future__ import annotations

import math

import pytest

from selfattention import attribution
from selfattention.report import model_report, write_report
from selfattention.report.views import add_views
from selfattention.words import WordGroups, aggregate

from . import test_report_browser as _browser_tests
from .test_report import synthetic_run

# the browser, the page helper and the skips (no playwright, no chromium) of the report's browser tests
browser, open_page, pytestmark = _browser_tests.browser, _browser_tests.open_page, _browser_tests.pytestmark

GROUPS = WordGroups(
    words=["[CLS]", "w1w2", "w3", "w4w5", "[SEP]"], groups=[[0], [1, 2], [3], [4, 5], [6]], segmenter="t"
)


@pytest.fixture(scope="module")
def views_page(tmp_path_factory):
    run = synthetic_run(7, n_layers=3, n_heads=2, head_dim=5, seed=4)
    payload = add_views(model_report(run, head=(1, 1), token=1), run, GROUPS)
    path = tmp_path_factory.mktemp("views") / "views.html"
    write_report(payload, path)
    return path, run


def _click(pg, toggle: str, attr: str, value: str) -> None:
    pg.page.click(f"#{toggle} button[data-{attr}='{value}']")
    part = 0 if attr == "unit" else 1
    pg.page.wait_for_function(
        "([v, k]) => document.getElementById('app').dataset.view.split(':')[k] === v", arg=[value, part]
    )


def _close_8bit(shown: float, want: float) -> None:
    assert abs(math.sqrt(shown) - math.sqrt(max(want, 0.0))) <= 0.5 / 255 + 1e-6, (shown, want)


def test_switching_measure_and_unit_redraws_with_the_views_values(open_page, views_page):
    path, run = views_page
    pg = open_page(path)
    assert pg.state()["view"] == "tokens:raw"
    assert pg.page.locator("#measure-toggle").is_visible() and pg.page.locator("#unit-toggle").is_visible()
    raw = pg.hover(2, 3)
    assert float(raw["weight"]) == pytest.approx(float(run.attentions[1, 1, 2, 3]), rel=1e-6)

    _click(pg, "measure-toggle", "measure", "rollout")
    assert pg.state()["view"] == "tokens:rollout"
    rollout = attribution.attention_rollout(run.attentions)[1].numpy()  # the selected layer: 1
    _close_8bit(float(pg.hover(2, 3)["weight"]), float(rollout[2, 3]))
    assert "Abnar" in pg.page.locator("#head-stats").inner_text()

    _click(pg, "unit-toggle", "unit", "words")
    assert pg.state()["view"] == "words:rollout"
    assert pg.page.locator("#tokens .tok").count() == 5
    words = aggregate(attribution.attention_rollout(run.attentions)[1], GROUPS.groups).numpy()
    _close_8bit(float(pg.hover(1, 3)["weight"]), float(words[1, 3]))
    assert "raw weights over tokens" in pg.page.locator("#trace").inner_text()

    _click(pg, "measure-toggle", "measure", "norm")
    norm = attribution.value_norm_weights(run.attentions, run.values)[1, 1]  # head (1, 1): α_ij ‖v_j‖
    want = aggregate(norm / norm.sum(-1, keepdim=True), GROUPS.groups).numpy()
    _close_8bit(float(pg.hover(4, 0)["weight"]), float(want[4, 0]))

    _click(pg, "measure-toggle", "measure", "raw")
    _click(pg, "unit-toggle", "unit", "tokens")
    assert pg.state()["view"] == "tokens:raw" and pg.page.locator("#tokens .tok").count() == 7
    back = pg.hover(2, 3)
    assert back["exact"] == "1" and float(back["weight"]) == float(raw["weight"])
    pg.assert_clean()


def test_flow_button_is_disabled_for_long_texts(open_page, tmp_path):
    run = synthetic_run(attribution.FLOW_MAX_TOKENS + 3, n_layers=2, n_heads=2, head_dim=4, seed=1)
    path = tmp_path / "long.html"
    write_report(add_views(model_report(run), run), path)
    pg = open_page(path)
    assert pg.page.locator("#measure-toggle button[data-measure='flow']").is_disabled()
    assert pg.page.locator("#unit-toggle button[data-unit='words']").is_disabled()
    pg.page.click("#measure-toggle button[data-measure='rollout']")
    pg.page.wait_for_function("() => document.getElementById('app').dataset.view === 'tokens:rollout'")
    pg.assert_clean()
