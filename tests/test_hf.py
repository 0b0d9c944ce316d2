"""selfattention.hf: our attention inside transformers models, against transformers' own eager and sdpa.

Tiny random-weight models (tests/tiny_models.py): BERT, GPT-2, Llama (GQA), Mistral (window), Qwen2 (full
and window layers), Gemma 2 (softcap; no sdpa in transformers: eager only), BART (cross-attention), T5
(relative position bias), gpt-oss (attention sinks; eager only). The oracles are transformers' own
attention functions, run on the same weights; direct calls are checked against transformers' sdpa and
eager functions, which are independent of this library.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

pytest.importorskip("transformers")

import selfattention  # noqa: E402
from selfattention import hf  # noqa: E402
from tests import tiny_models  # noqa: E402
from tests.tiny_models import ENCODER_DECODER, NAMES, NO_SDPA, build  # noqa: E402

T = 9


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert hf.register() == "selfattention"
    # tiny matrices: one thread (on a shared, busy machine a second thread makes every op wait ~20 ms)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    return {name: build(name) for name in NAMES}


def _batch(name: str, side: str, seed: int = 1) -> dict[str, torch.Tensor]:
    """Two sequences of T tokens; the first is padded by 3 on ``side``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, tiny_models.VOCAB, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    if side == "left":
        mask[0, :3] = 0
    else:
        mask[0, -3:] = 0
    ids[mask == 0] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if name in ENCODER_DECODER:
        batch["decoder_input_ids"] = torch.randint(3, tiny_models.VOCAB, (2, 6), generator=g)
    return batch


def _out(model, batch, impl: str, **kw):
    model.set_attn_implementation(impl)
    out = model(**batch, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state, out


def _real(name: str, batch) -> torch.Tensor:
    """Positions whose outputs are defined: real tokens (all decoder positions for encoder-decoders)."""
    if name in ENCODER_DECODER:
        return torch.ones(batch["decoder_input_ids"].shape, dtype=torch.bool)
    return batch["attention_mask"].bool()


def _references(name: str) -> list[str]:
    return ["eager"] if name in NO_SDPA else ["eager", "sdpa"]


# ---------------------------------------------------------------- registration


def test_register_is_idempotent_and_registers_both_functions():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert hf.register() == hf.register() == "selfattention"
    assert AttentionInterface()["selfattention"] is hf.attention_forward
    assert AttentionMaskInterface()["selfattention"] is hf.attention_mask


def test_attention_function_without_its_mask_function_refuses(models):
    """Registering only the attention function (as transformers' docs show) means no mask is built:
    padding would be attended to. That must be an error, not a silent 0.6 difference."""
    from transformers import AttentionInterface

    AttentionInterface.register("sa-no-mask", hf.attention_forward)
    model = models["bert"]
    with pytest.raises(RuntimeError, match="no mask function registered.*sa-no-mask"):
        _out(model, _batch("bert", "right"), "sa-no-mask")
    model.set_attn_implementation("eager")


# ---------------------------------------------------------------- forward passes


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", NAMES)
def test_forward_matches_transformers_float32(models, name, side):
    model, batch = models[name], _batch(name, side)
    real = _real(name, batch)
    with torch.no_grad():
        ours, _ = _out(model, batch, "selfattention")
        for impl in _references(name):
            theirs, _ = _out(model, batch, impl)
            assert (ours - theirs)[real].abs().max() <= 2e-5, impl
    assert ours[real].abs().max() > 0.1  # not trivially zero


@pytest.mark.parametrize(
    "name", ["bert", "llama", "qwen2", "gemma2", "t5", "bart"]
)  # gpt-oss' MoE: no float64
def test_forward_matches_transformers_float64(models, name):
    """float64: sdpa within 1e-10; eager within 1e-6 only, as its softmax runs in float32. (Right padding:
    eager turns a float64 row of only masked keys into NaN, which then spreads to every position.)"""
    model, batch = models[name].double(), _batch(name, "right")
    real = _real(name, batch)
    try:
        with torch.no_grad():
            ours, _ = _out(model, batch, "selfattention")
            for impl in _references(name):
                theirs, _ = _out(model, batch, impl)
                assert ours.dtype == torch.float64
                assert (ours - theirs)[real].abs().max() <= (1e-10 if impl == "sdpa" else 1e-6), impl
    finally:
        model.float()


@pytest.mark.parametrize("name", ["llama", "gemma2", "t5", "gpt_oss", "bert"])
def test_forward_bfloat16_is_as_close_to_float64_as_eager(models, name):
    """bf16: our error against the exact result (eager in float64; gpt-oss' MoE: float32) is at most 2×
    that of transformers' eager in bf16."""
    model, batch = models[name], _batch(name, "right")
    real = _real(name, batch)
    with torch.no_grad():
        exact, _ = _out(model if name == "gpt_oss" else model.double(), batch, "eager")
        model.to(torch.bfloat16)
        try:
            ours, _ = _out(model, batch, "selfattention")
            eager, _ = _out(model, batch, "eager")
        finally:
            model.float()
    assert ours.dtype == torch.bfloat16
    err_ours = (ours.double() - exact)[real].abs().max()
    err_eager = (eager.double() - exact)[real].abs().max()
    assert err_ours <= 2 * err_eager + 1e-3, (float(err_ours), float(err_eager))


@pytest.mark.parametrize("name", ["bert", "llama", "gemma2", "bart", "t5", "gpt_oss"])
def test_output_attentions_equal_eager_weights_in_the_models_dtype(models, name):
    model, batch = models[name], _batch(name, "left")
    with torch.no_grad():
        _, ours = _out(model, batch, "selfattention", output_attentions=True)
        _, eager = _out(model, batch, "eager", output_attentions=True)
    fields = (
        ["attentions"]
        if name not in ENCODER_DECODER
        else [
            "encoder_attentions",
            "decoder_attentions",
            "cross_attentions",
        ]
    )
    for field in fields:
        mine, theirs = getattr(ours, field), getattr(eager, field)
        assert len(mine) == len(theirs) > 0
        for a, b in zip(mine, theirs, strict=True):
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
            # rows of padding queries differ by convention (eager: uniform; ours: zeros); compare real rows
            rows = batch["attention_mask"].bool() if field in ("attentions", "encoder_attentions") else None
            diff = (a - b).abs() if rows is None else (a - b).abs()[rows[:, None, :, None].expand_as(a)]
            assert diff.max() <= 2e-6, field


def test_weights_are_not_materialised_unless_asked(models, monkeypatch):
    """The fast path runs the dispatch; only output_attentions / capture() build the weight matrix."""
    model, batch = models["llama"], _batch("llama", "left")

    def boom(*args, **kwargs):
        raise AssertionError("attention_steps called on the fast path")

    monkeypatch.setattr(hf, "attention_steps", boom)
    with torch.no_grad():
        _, out = _out(model, batch, "selfattention")
        assert out.attentions is None
        with pytest.raises(AssertionError, match="fast path"):
            _out(model, batch, "selfattention", output_attentions=True)


def test_capture_records_one_trace_per_attention_call(models):
    model, batch = models["llama"], _batch("llama", "right")
    with torch.no_grad():
        _, eager = _out(model, batch, "eager", output_attentions=True)
        model.set_attn_implementation("selfattention")
        with selfattention.capture() as traces:
            model(**batch)
    assert len(traces) == 2
    for trace, theirs in zip(traces, eager.attentions, strict=True):
        real = batch["attention_mask"].bool()[:, None, :, None].expand_as(theirs)
        assert (trace["weights"] - theirs).abs()[real].max() <= 2e-6
        assert trace["query"].shape == (2, 4, T, 8) and trace["key"].shape == (2, 4, T, 8)  # GQA repeated


# ---------------------------------------------------------------- generation


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2", "gemma2", "gpt_oss", "bart"])
def test_greedy_generation_with_dynamic_and_static_cache(models, name, padded):
    """Without padding, the static cache's prefill passes no mask and keys padded to the cache length
    (Tq = 8, Tk = 13): the first step's logits must still be eager's (the old backend was off by 0.08–2.3
    there). With left padding transformers builds masks throughout."""
    model = models[name]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, tiny_models.VOCAB, (2, 8), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :2] = 0  # left padding (right padding for the encoder of BART: same mask, other side)
        if name in ENCODER_DECODER:
            mask = mask.flip(-1)
    ids[mask == 0] = 0
    runs = {}
    for impl in ("eager", "selfattention"):
        model.set_attn_implementation(impl)
        for cache in ("dynamic", "static"):
            with torch.no_grad():
                runs[impl, cache] = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=5,
                    do_sample=False,
                    cache_implementation=cache,
                    output_scores=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
    for cache in ("dynamic", "static"):
        ours, theirs = runs["selfattention", cache], runs["eager", cache]
        assert torch.equal(ours.sequences, theirs.sequences), cache
        for step_ours, step_theirs in zip(ours.scores, theirs.scores, strict=True):
            assert (step_ours - step_theirs).abs().max() <= 2e-5, cache


def test_output_attentions_with_a_static_cache_cover_every_cache_slot(models):
    """At prefill the keys of empty cache slots are cut for the computation; the weights returned still
    have a (zero) column for each slot, as eager's do."""
    model = models["llama"]
    ids = torch.randint(3, tiny_models.VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    runs = {}
    for impl in ("eager", "selfattention"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            runs[impl] = model.generate(
                input_ids=ids,
                max_new_tokens=3,
                do_sample=False,
                cache_implementation="static",
                output_attentions=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
    for ours, theirs in zip(runs["selfattention"].attentions, runs["eager"].attentions, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert a.shape == b.shape and (a - b).abs().max() <= 2e-6


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("name", ["llama", "gemma2", "t5", "gpt_oss", "bart"])
def test_gradients_equal_the_reference(models, name):
    """Every parameter's gradient, including T5's relative position bias, gpt-oss' sinks and the
    projections under Gemma 2's soft-cap, equals the one through transformers' own attention."""
    model, batch = models[name], _batch(name, "left")
    real = _real(name, batch)
    grads = {}
    for impl in ("selfattention", _references(name)[-1]):
        model.zero_grad()
        logits, _ = _out(model, batch, impl)
        weight = torch.linspace(-1, 1, logits.shape[-1])
        (logits[real] * weight).sum().backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ours, theirs = grads.pop("selfattention"), grads.popitem()[1]
    assert ours.keys() == theirs.keys()
    for n in ours:
        scale = theirs[n].abs().max().clamp_min(1e-3)
        assert (ours[n] - theirs[n]).abs().max() <= 2e-5 * scale, n
    special = {"t5": "relative_attention_bias", "gpt_oss": "sinks"}.get(name)
    if special:
        hit = [n for n in ours if special in n]
        assert hit and all(ours[n].abs().max() > 1e-4 for n in hit)


# ---------------------------------------------------------------- direct calls: semantics


def _module(is_causal: bool = True, training: bool = False, groups: int = 1, sinks=None):
    m = types.SimpleNamespace(is_causal=is_causal, training=training, num_key_value_groups=groups)
    m.config = types.SimpleNamespace(_attn_implementation="selfattention")
    m.sinks = sinks
    return m


def _qkv(tq: int, tk: int, h: int = 4, hkv: int = 2, d: int = 8, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, h, tq, d, generator=g, dtype=dtype)
    k = torch.randn(2, hkv, tk, d, generator=g, dtype=dtype)
    v = torch.randn(2, hkv, tk, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    ("tq", "tk", "causal"),
    [(3, 7, True), (1, 7, True), (5, 5, True), (3, 7, False), (7, 3, True), (6, 6, False)],
)
def test_mask_less_calls_behave_as_transformers_sdpa(tq, tk, causal):
    """No mask: causal calls are top-left aligned (a static cache's empty slots are never seen), a single
    query sees every key, non-causal calls see every key — exactly transformers' sdpa_attention_forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv(tq, tk)
    module = _module(is_causal=causal, groups=2)
    ours, w = hf.attention_forward(module, q, k, v, None, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    assert w is None and ours.shape == (2, tq, 4, 8)
    assert (ours - theirs).abs().max() <= 1e-12
    # and with the weights materialised, the same numbers
    ours_w, w = hf.attention_forward(module, q, k, v, None, scaling=0.3, output_attentions=True)
    assert (ours_w - theirs).abs().max() <= 1e-12 and w.shape == (2, 4, tq, tk)


def test_is_causal_argument_overrides_the_module_flag():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv(5, 5)
    for flag in (True, False):
        module = _module(is_causal=not flag, groups=2)
        ours, _ = hf.attention_forward(module, q, k, v, None, is_causal=flag)
        theirs, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=flag)
        assert (ours - theirs).abs().max() <= 1e-12


def test_mask_less_causal_call_applies_the_sliding_window():
    q, k, v = _qkv(9, 9)
    ours, w = hf.attention_forward(_module(groups=2), q, k, v, None, sliding_window=3, output_attentions=True)
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    keep = (j <= i) & (j > i - 3)
    assert torch.equal(w[0, 0] > 0, keep)
    masked, _ = hf.attention_forward(_module(groups=2), q, k, v, keep[None, None])
    assert (ours - masked).abs().max() <= 1e-12
    with pytest.raises(ValueError, match="sliding_window=3"):
        hf.attention_forward(_module(is_causal=False, groups=2), q, k, v, None, sliding_window=3)


def test_the_mask_function_names_a_padding_mask_of_another_batch_or_rank():
    """A 2-D padding mask with more rows than the batch, or not 2-D: a ValueError naming attention_mask
    (eager and sdpa index its first rows and run on; our call raised deep inside torch without grad)."""
    from transformers.masking_utils import causal_mask_function

    for bad, words in (
        (torch.ones(3, 8, dtype=torch.long), "3 rows"),
        (torch.ones(2, 8, 8, dtype=torch.bool), "2-D padding mask"),
    ):
        with pytest.raises(ValueError, match=words) as err:
            hf.attention_mask(2, 8, 8, mask_function=causal_mask_function, attention_mask=bad)
        assert "attention_mask" in str(err.value)
    one = torch.ones(1, 8, dtype=torch.long)  # one row broadcasts over the batch
    assert hf.attention_mask(2, 8, 8, mask_function=causal_mask_function, attention_mask=one) is not None


@pytest.mark.parametrize("grad", [False, True])
def test_a_lazy_mask_keeps_the_padding_it_was_made_with(grad):
    """The caller edits its 2-D mask in place after the 4-D mask was made: as sdpa's dense mask, the lazy
    mask keeps the padding of when it was made, with and without autograd (it held a view of a bool mask,
    and one route followed the edit)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    am = torch.ones(2, 6, dtype=torch.bool)
    am[0, :2] = False
    lazy = hf.attention_mask(2, 6, 6, mask_function=causal_mask_function, attention_mask=am)
    dense = sdpa_mask(
        2, 6, 6, mask_function=causal_mask_function, attention_mask=am, allow_is_causal_skip=False
    )
    q, k, v = (t.float().requires_grad_(grad) for t in _qkv(6, 6))
    am[1, :3] = False  # after the masks were made
    with torch.set_grad_enabled(grad):
        ours, _ = hf.attention_forward(_module(groups=2), q, k, v, lazy)
        theirs, _ = sdpa_attention_forward(_module(groups=2), q, k, v, dense)
    assert (ours - theirs).abs().max() <= 1e-5
    assert torch.equal(lazy.to_dense()[1, 0, 5], torch.ones(6, dtype=torch.bool))


def test_bool_and_float_masks_match_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv(4, 6)
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(2, 1, 4, 6, generator=g) > 0.4
    keep[..., 0] = True
    bias = torch.where(keep, torch.randn(2, 1, 4, 6, generator=g, dtype=torch.float64), -math.inf)
    for mask in (keep, bias):
        ours, _ = hf.attention_forward(_module(groups=2), q, k, v, mask)
        theirs, _ = sdpa_attention_forward(_module(groups=2), q, k, v, mask)
        assert (ours - theirs).abs().max() <= 1e-12


def test_softcap_matches_gemma2_eager():
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q, k, v = _qkv(6, 6)
    q = 3 * q  # scores well past the cap
    keep = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -math.inf)
    module = _module(groups=2)
    ours, w = hf.attention_forward(module, q, k, v, keep, scaling=0.25, softcap=2.0, output_attentions=True)
    theirs, w_ref = eager_attention_forward(module, q, k, v, additive, scaling=0.25, softcap=2.0)
    uncapped, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25)
    # Gemma 2's eager softmax runs in float32
    assert (ours - theirs).abs().max() <= 1e-6 and (w - w_ref).abs().max() <= 1e-6
    assert (theirs - uncapped).abs().max() > 0.05  # the cap matters here
    # the definition in float64: softmax(2·tanh(Q Kᵀ · 0.25 / 2) + mask) V
    k4, v4 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    w_def = torch.softmax(2.0 * torch.tanh(q @ k4.transpose(-1, -2) * 0.25 / 2.0) + additive, dim=-1)
    assert (w - w_def).abs().max() <= 1e-12
    assert (ours - (w_def @ v4).transpose(1, 2)).abs().max() <= 1e-12
    fast, _ = hf.attention_forward(module, q, k, v, keep, scaling=0.25, softcap=2.0)
    assert (fast - ours).abs().max() <= 1e-12


def test_position_bias_matches_t5_eager_with_gradient():
    from transformers.models.t5.modeling_t5 import eager_attention_forward

    q, k, v = _qkv(5, 5, hkv=4)
    bias = torch.randn(1, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    keep[0, ..., :2] = False
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -1e30)
    module = _module(is_causal=False)
    ours, _ = hf.attention_forward(module, q, k, v, keep, scaling=1.0, position_bias=bias)
    (g_ours,) = torch.autograd.grad(ours.sum(), bias)
    theirs, _ = eager_attention_forward(module, q, k, v, additive, scaling=1.0, position_bias=bias)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), bias)
    assert (ours - theirs).abs().max() <= 1e-12
    assert (g_ours - g_theirs).abs().max() <= 1e-12 and g_theirs.abs().max() > 1e-3


def test_position_bias_in_a_mask_less_causal_call_with_padded_keys_matches_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v = _qkv(4, 9, hkv=4)
    bias = torch.randn(1, 4, 4, 9, dtype=torch.float64)
    ours, _ = hf.attention_forward(_module(), q, k, v, None, position_bias=bias)
    theirs, _ = sdpa_attention_forward(_module(), q, k, v, None, position_bias=bias)
    assert (ours - theirs).abs().max() <= 1e-12


@pytest.mark.parametrize("masked", [False, True])
def test_sinks_match_gpt_oss_eager_with_gradient(masked):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = _qkv(5, 5)
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    module = _module(groups=2, sinks=sinks)
    keep = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    if masked:
        keep = keep.expand(2, 1, 5, 5).clone()
        keep[1, :, 2, :] = False  # a query that sees no key: all its weight goes to the sink
    additive = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -1e30)
    ours, w = hf.attention_forward(module, q, k, v, keep, scaling=0.4, s_aux=sinks, output_attentions=True)
    theirs, w_ref = eager_attention_forward(module, q, k, v, additive, scaling=0.4)
    assert (ours - theirs).abs().max() <= 1e-12 and (w - w_ref).abs().max() <= 1e-12
    assert w.sum(-1).max() < 1 - 1e-3  # the sink takes a share of every row
    (g_ours,) = torch.autograd.grad(ours.sum(), sinks)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), sinks)
    assert (g_ours - g_theirs).abs().max() <= 1e-12 and g_theirs.abs().max() > 1e-3
    fast, _ = hf.attention_forward(module, q, k, v, keep, scaling=0.4, s_aux=sinks)
    assert (fast - theirs).abs().max() <= 1e-12


def test_per_query_sinks_match_the_definition():
    """``sinks`` (B, H, Tq, 1): softmax over [scores, sink] with the sink column dropped."""
    q, k, v = _qkv(4, 6, hkv=4)
    sinks = torch.randn(2, 4, 4, 1, dtype=torch.float64)
    ours, w = hf.attention_forward(
        _module(is_causal=False), q, k, v, None, sinks=sinks, output_attentions=True
    )
    logits = torch.cat([q @ k.transpose(-1, -2) / math.sqrt(8), sinks], dim=-1)
    w_ref = torch.softmax(logits, dim=-1)[..., :-1]
    assert (w - w_ref).abs().max() <= 1e-12
    assert (ours - (w_ref @ v).transpose(1, 2)).abs().max() <= 1e-12


def test_dropout_only_in_training():
    q, k, v = _qkv(5, 5)
    plain, _ = hf.attention_forward(_module(groups=2), q, k, v, None)
    eval_drop, _ = hf.attention_forward(_module(groups=2), q, k, v, None, dropout=0.5)
    assert torch.equal(plain, eval_drop)
    torch.manual_seed(0)
    train_drop, _ = hf.attention_forward(_module(groups=2, training=True), q, k, v, None, dropout=0.5)
    assert (train_drop - plain).abs().max() > 1e-3 and torch.isfinite(train_drop).all()


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"alibi_slopes": torch.ones(4)}, TypeError, "'alibi_slopes'"),
        ({"block_indices": 3}, ValueError, "block_indices need the key block size"),
        ({"window_size": (4, 0)}, TypeError, "'window_size'"),
        ({"softcap": 0.0}, ValueError, "softcap must be"),
        ({"softcap": float("nan")}, ValueError, "softcap must be"),
        ({"sliding_window": -1}, ValueError, "sliding_window must be"),
        ({"s_aux": torch.ones(3)}, ValueError, "one sink logit per query head"),
        ({"sinks": torch.ones(4)}, ValueError, r"sinks must be a tensor of shape \(B, H, Tq, 1\)"),
        ({"s_aux": torch.ones(4), "sinks": torch.ones(2, 4, 5, 1)}, ValueError, "not both"),
        ({"dropout": 1.5}, ValueError, "dropout_p"),
    ],
)
def test_arguments_it_cannot_honour_are_refused_by_name(kwargs, error, message):
    q, k, v = _qkv(5, 5, dtype=torch.float32)
    with pytest.raises(error, match=message):
        hf.attention_forward(_module(groups=2), q, k, v, None, **kwargs)


def test_ignored_and_none_arguments_are_accepted():
    q, k, v = _qkv(5, 5)
    plain, _ = hf.attention_forward(_module(groups=2), q, k, v, None)
    same, _ = hf.attention_forward(
        _module(groups=2),
        q,
        k,
        v,
        None,
        position_ids=torch.arange(5)[None],
        use_cache=True,
        cu_seq_lens_q=None,
        unknown_but_none=None,
        softcap=None,
        position_bias=None,
    )
    assert torch.equal(plain, same)


def test_a_mask_that_is_not_a_tensor_is_refused():
    q, k, v = _qkv(5, 5)
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor"):
        hf.attention_forward(_module(groups=2), q, k, v, [[True]])


def test_the_readme_s_offline_example_runs_and_matches_eager(capsys):
    """The README's "nothing downloaded" example (a tiny random Llama), run as written."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    tail = readme[readme.index("To try it with nothing downloaded") :]
    block = re.search(r"```python\n(.*?)```", tail, re.S).group(1)
    exec(compile(block, "README.md", "exec"), {})
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert float(printed) < 1e-5  # the README's figure is this machine's; another CPU rounds otherwise
