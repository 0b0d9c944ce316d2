"""selfattention.hf's mask function: transformers' mask recipes as lazy predicates, never dense masks.

Oracles: transformers' own ``sdpa_mask`` (the dense mask of the same recipe), its eager attention functions
(gpt-oss sinks, T5 bias, Gemma 2 soft-cap) and its eager/sdpa models on the same weights.
"""

from __future__ import annotations

import math
import types

import pytest
import torch

pytest.importorskip("transformers")

from transformers import masking_utils as mu  # noqa: E402

from selfattention import hf, hf_dense, hf_masks  # noqa: E402
from tests import tiny_models  # noqa: E402
from tests.tiny_models import build  # noqa: E402

pytestmark = pytest.mark.usefixtures("hf_registered")


def _padding(b: int, t: int) -> torch.Tensor:
    am = torch.ones(b, t, dtype=torch.bool)  # (transformers turns the 2-D mask into bool before sdpa_mask)
    am[0, :3] = False  # left padding
    am[-1, -2:] = False  # right padding
    return am


RECIPES = {
    "causal": (lambda: mu.causal_mask_function, ("causal",)),
    "window": (lambda: mu.sliding_window_causal_mask_function(4), ("causal", "window")),
    "chunked": (lambda: mu.chunked_causal_mask_function(3, torch.tensor([3, 0, 1])), ("causal", "chunks")),
    "bidirectional": (lambda: mu.bidirectional_mask_function, ()),
    "bidirectional window": (lambda: mu.sliding_window_bidirectional_mask_function(2), ("predicate",)),
    "or (image tokens)": (
        lambda: mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv < 2),
        ("predicate",),
    ),
    "packed": (
        lambda: mu.and_masks(
            mu.causal_mask_function,
            mu.packed_sequence_mask_function(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2]] * 3)),
        ),
        ("causal", "documents"),
    ),
}
# (Tq, Tk, q_offset, kv_offset): prefill, decode with a cache, a chunk after cached keys, a sliding cache
SIZES = [(13, 13, 0, 0), (1, 13, 12, 0), (4, 13, 9, 0), (2, 5, 10, 8), (7, 11, 0, 0)]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_lazy_mask_is_transformers_sdpa_mask(recipe, sizes, padded):
    """The LazyMask stands for exactly the mask transformers' sdpa_mask materialises, and keeps the
    recognised cases structural (no predicate evaluated per block for them)."""
    make, kinds = RECIPES[recipe]
    tq, tk, qo, ko = sizes
    if recipe == "packed" and (qo, ko) != (0, 0):
        pytest.skip("transformers only packs sequences without a cache")
    am = _padding(3, ko + tk) if padded else None
    ref = mu.sdpa_mask(3, tq, tk, qo, ko, mask_function=make(), attention_mask=am, allow_is_causal_skip=False)
    lazy = hf.attention_mask(3, tq, tk, qo, ko, mask_function=make(), attention_mask=am)
    assert isinstance(lazy, hf_masks.LazyMask) and lazy.shape == (3, 1, tq, tk)
    assert torch.equal(lazy.to_dense(), ref.expand(3, 1, tq, tk))
    got = tuple(k for k in lazy.kinds if k != "padding")
    assert got == kinds, lazy
    vis = lazy.visibility
    assert (vis.mod is None) == ("predicate" not in kinds)
    m = vis.attn_mask
    assert m is None or m.shape == (3, 1, 1, tk)  # padding: one row of keys, never (Tq, Tk)


def test_a_prepared_lazy_mask_is_returned_as_it_is():
    lazy = hf.attention_mask(2, 5, 5)
    assert hf.attention_mask(2, 5, 5, attention_mask=lazy) is lazy


# ---------------------------------------------------------------- no (T, T) tensor on a sliding-window model


def _largest_op_allocation(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(e.self_cpu_memory_usage for e in prof.events())  # per call, not summed over calls


def test_sliding_window_model_builds_no_tq_by_tk_tensor(monkeypatch):
    """Mistral with window 4 at T = 2048: every attention call gets a LazyMask (causal + window +
    key-only padding, no per-block predicate), and no operation allocates T²/2 bytes (a (T, T) bool mask
    alone needs T²; the largest allocation left is the logits, 2·T·99 floats). transformers' own sdpa
    path is the control: its mask allocation is caught."""
    model = build("mistral")
    t = 2048
    ids = torch.randint(3, tiny_models.VOCAB, (2, t), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, t, dtype=torch.long)
    am[0, :5] = 0
    seen = []
    inner = hf.attention_forward

    def spy(module, q, k, v, mask, *a, **kw):
        seen.append(mask)
        return inner(module, q, k, v, mask, *a, **kw)

    from transformers import AttentionInterface

    AttentionInterface.register("selfattention", spy)
    try:
        with torch.no_grad(), hf.using(model):
            run = lambda: model(input_ids=ids, attention_mask=am)  # noqa: E731
            ours = _largest_op_allocation(run)
    finally:
        AttentionInterface.register("selfattention", hf.attention_forward)
    assert seen and all(isinstance(m, hf_masks.LazyMask) for m in seen)
    for m in seen:
        vis = m.visibility
        assert vis.window == 4 and vis.mod is None and vis.attn_mask.shape == (2, 1, 1, t)
    with torch.no_grad(), hf.using(model, "sdpa"):
        theirs = _largest_op_allocation(lambda: model(input_ids=ids, attention_mask=am))
    assert theirs >= t * t  # the control: a dense mask is visible to this measurement
    assert ours < t * t / 2, (ours, theirs)


# ---------------------------------------------------------------- the engine routes: sinks, softcap, bias


def _module(training: bool = False, groups: int = 2, sinks=None):
    m = types.SimpleNamespace(is_causal=True, training=training, num_key_value_groups=groups, sinks=sinks)
    m.config = types.SimpleNamespace(_attn_implementation="selfattention")
    return m


def _qkv(tq, tk, h=4, hkv=2, d=7, dtype=torch.float64, grad=False):
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(2, n, t, d, generator=g, dtype=dtype) for n, t in ((h, tq), (hkv, tk), (hkv, tk))]
    return [x.requires_grad_(grad) for x in ts]


@pytest.fixture
def no_dense_routes(monkeypatch):
    """Fail if the materialising helpers of the old route run (sink column, dense soft-capped scores)."""

    def boom(*a, **k):
        raise AssertionError("the dense route ran")

    monkeypatch.setattr(hf_dense, "with_sink", boom)
    monkeypatch.setattr(hf_dense, "softcapped_scores", boom)
    monkeypatch.setattr(hf_dense, "additive_mask", boom)


@pytest.mark.parametrize("sizes", [(97, 97, 0, 0), (1, 40, 39, 0), (5, 37, 20, 3)])
def test_sinks_on_a_window_match_gpt_oss_eager_with_gradients(no_dense_routes, sizes):
    """gpt-oss sinks (s_aux) on a sliding window with padding: no (Tq, Tk + 1) mask column; output and
    gradients (q, k, v and the sinks) equal transformers' gpt-oss eager attention, float64."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    tq, tk, qo, ko = sizes
    q, k, v = _qkv(tq, tk, grad=True)
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    am = _padding(2, ko + tk)
    fn = mu.sliding_window_causal_mask_function(16)
    lazy = hf.attention_mask(2, tq, tk, qo, ko, mask_function=fn, attention_mask=am)
    dense = mu.sdpa_mask(2, tq, tk, qo, ko, mask_function=fn, attention_mask=am, allow_is_causal_skip=False)
    additive = torch.zeros(dense.shape, dtype=torch.float64).masked_fill(~dense, -math.inf)
    module = _module(sinks=sinks)
    ours, w = hf.attention_forward(module, q, k, v, lazy, scaling=0.3, s_aux=sinks)
    theirs, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    assert w is None and (ours - theirs).abs().max() <= 1e-12
    gy = torch.randn(ours.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g_ours = torch.autograd.grad(ours, (q, k, v, sinks), gy)
    g_theirs = torch.autograd.grad(theirs, (q, k, v, sinks), gy)
    for a, b in zip(g_ours, g_theirs, strict=True):
        assert (a - b).abs().max() <= 1e-11 * max(1.0, float(b.abs().max()))
    assert g_theirs[3].abs().max() > 1e-3


def test_softcap_on_a_lazy_window_matches_the_float64_definition(no_dense_routes):
    """Gemma 2's soft-cap (scores → cap · tanh(scores / cap), then the mask) as a score mod on a lazy
    window with padding, against the definition in float64 (Gemma 2's own eager softmax is float32)."""
    q, k, v = _qkv(33, 33, grad=True)
    am = _padding(2, 33)
    fn = mu.sliding_window_causal_mask_function(8)
    lazy = hf.attention_mask(2, 33, 33, mask_function=fn, attention_mask=am)
    dense = mu.sdpa_mask(2, 33, 33, mask_function=fn, attention_mask=am, allow_is_causal_skip=False)
    ours, _ = hf.attention_forward(_module(), q, k, v, lazy, scaling=0.5, softcap=1.5)
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.tanh(q @ kr.transpose(-1, -2) * 0.5 / 1.5) * 1.5
    w = torch.softmax(scores.masked_fill(~dense, -math.inf), dim=-1).nan_to_num(0.0)
    theirs = (w @ vr).transpose(1, 2)
    assert (ours - theirs).abs().max() <= 1e-12
    gy = torch.randn(ours.shape, dtype=torch.float64)
    g_ours, g_theirs = torch.autograd.grad(ours, (q, k, v), gy), torch.autograd.grad(theirs, (q, k, v), gy)
    for a, b in zip(g_ours, g_theirs, strict=True):
        assert (a - b).abs().max() <= 1e-11


@pytest.mark.parametrize("grad", [False, True])
def test_position_bias_with_a_lazy_mask_matches_t5_eager(no_dense_routes, grad):
    """T5: the dense position_bias the model gives, with padding as a key-only mask; with grad the
    bias gets its gradient from the engine."""
    from transformers.models.t5.modeling_t5 import eager_attention_forward

    q, k, v = _qkv(9, 12, h=4, hkv=4, grad=True)
    bias = torch.randn(1, 4, 9, 12, dtype=torch.float64, requires_grad=grad)
    am = _padding(2, 12)
    lazy = hf.attention_mask(2, 9, 12, mask_function=mu.bidirectional_mask_function, attention_mask=am)
    additive = torch.zeros(2, 1, 1, 12, dtype=torch.float64).masked_fill(~am.bool()[:, None, None], -math.inf)
    module = _module(groups=1)
    ours, _ = hf.attention_forward(module, q, k, v, lazy, scaling=1.0, position_bias=bias)
    theirs, _ = eager_attention_forward(module, q, k, v, additive, scaling=1.0, position_bias=bias)
    assert (ours - theirs).abs().max() <= 1e-12
    wrt = (q, k, v, bias) if grad else (q, k, v)
    gy = torch.randn(ours.shape, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(ours, wrt, gy), torch.autograd.grad(theirs, wrt, gy), strict=True):
        assert (a - b).abs().max() <= 1e-11


def test_a_generic_predicate_matches_sdpa_with_the_dense_mask():
    """An or_masks recipe (image tokens seen by all) is a per-block predicate; the result equals torch
    SDPA with transformers' dense mask, T = 97 (blocks that do not divide T, hidden blocks)."""
    fn = mu.or_masks(mu.sliding_window_causal_mask_function(5), lambda b, h, q, kv: kv < 3)
    q, k, v = _qkv(97, 97, hkv=4)
    am = _padding(2, 97)
    lazy = hf.attention_mask(2, 97, 97, mask_function=fn, attention_mask=am)
    dense = mu.sdpa_mask(2, 97, 97, mask_function=fn, attention_mask=am, allow_is_causal_skip=False)
    assert "predicate" in lazy.kinds
    ours, _ = hf.attention_forward(_module(groups=1), q, k, v, lazy)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense).transpose(1, 2)
    assert (ours - ref).abs().max() <= 1e-12


def test_packed_sequences_in_a_model_match_eager():
    """Llama with two sequences packed into one row (position_ids restart, no attention_mask):
    transformers' packed recipe becomes documents, and the output equals eager's."""
    model = build("llama")
    ids = torch.randint(3, tiny_models.VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]])
    seen = []
    orig = hf_masks.mask_function

    def spy(*a, **kw):
        out = orig(*a, **kw)
        seen.append(out)
        return out

    with torch.no_grad():
        with hf.using(model, "eager"):
            ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register("selfattention", spy)
        try:
            with hf.using(model):
                ours = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        finally:
            AttentionMaskInterface.register("selfattention", hf.attention_mask)
    assert seen and all("documents" in m.kinds and "predicate" not in m.kinds for m in seen)
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("causal", [False, True])
def test_position_bias_without_grad_is_one_fused_call_that_hides_nan_keys(no_dense_routes, causal):
    """Inference with T5's bias: one vendor call with the dense bias; a padded key holding NaN never
    leaks (the result is recomputed exactly), a query that sees no key gets zeros."""
    from transformers.models.t5.modeling_t5 import eager_attention_forward

    q, k, v = _qkv(12, 12, h=4, hkv=4)
    bias = torch.randn(1, 4, 12, 12, dtype=torch.float64)
    am = _padding(2, 12)
    fn = mu.causal_mask_function if causal else mu.bidirectional_mask_function
    lazy = hf.attention_mask(2, 12, 12, mask_function=fn, attention_mask=am)
    dense = mu.sdpa_mask(2, 12, 12, mask_function=fn, attention_mask=am, allow_is_causal_skip=False)
    additive = torch.zeros(dense.shape, dtype=torch.float64).masked_fill(~dense, -math.inf)
    module = _module(groups=1)
    with torch.no_grad():
        theirs, _ = eager_attention_forward(module, q, k, v, additive, scaling=1.0, position_bias=bias)
        theirs = theirs.nan_to_num(0.0)  # eager: NaN for a row with no visible key; ours: zeros
        ours, _ = hf.attention_forward(module, q, k, v, lazy, scaling=1.0, position_bias=bias)
        assert (ours - theirs).abs().max() <= 1e-12
        k2, v2 = k.clone(), v.clone()
        k2[~am.bool()[:, None, :, None].expand_as(k2)] = math.nan
        v2[~am.bool()[:, None, :, None].expand_as(v2)] = math.inf
        dirty, _ = hf.attention_forward(module, q, k2, v2, lazy, scaling=1.0, position_bias=bias)
    assert torch.isfinite(dirty).all() and (dirty - theirs).abs().max() <= 1e-12


@pytest.mark.parametrize("small", [0, hf_masks.SMALL])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "gemma2", "gpt_oss", "t5", "bert"])
def test_models_match_eager_on_both_lazy_routes(monkeypatch, name, small):
    """The block engine's plans (``SMALL = 0``: every call planned) and the one-call dense-bias route of
    small calls both give transformers' eager logits, padded batch, float32."""
    monkeypatch.setattr(hf_masks, "SMALL", small)
    model = build(name)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, tiny_models.VOCAB, (2, 11), generator=g)
    am = torch.ones(2, 11, dtype=torch.long)
    am[0, :3] = 0
    batch = {"input_ids": ids, "attention_mask": am}
    real = am.bool()
    if name == "t5":
        batch["decoder_input_ids"] = torch.randint(3, tiny_models.VOCAB, (2, 6), generator=g)
        real = torch.ones(2, 6, dtype=torch.bool)
    outs = {}
    with torch.no_grad():
        for impl in ("eager", "selfattention"):
            with hf.using(model, impl):
                out = model(**batch)
                outs[impl] = out.logits if hasattr(out, "logits") else out.last_hidden_state
    ref = outs["eager"][real]
    assert (outs["selfattention"][real] - ref).abs().max() <= 2e-5 * ref.abs().max()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["mistral", "gpt_oss", "gemma2"])
def test_generation_with_cache_on_the_engine_route_matches_eager(monkeypatch, name, cache):
    """Greedy decoding, left-padded batch, with every call planned by the engine (``SMALL = 0``): the
    lazy masks at the cache's offsets (decode steps, the sliding layers' caches) give eager's tokens."""
    monkeypatch.setattr(hf_masks, "SMALL", 0)
    model = build(name)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, tiny_models.VOCAB, (2, 7), generator=g)
    am = torch.ones(2, 7, dtype=torch.long)
    am[0, :2] = 0
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation=cache)
    tokens = {}
    with torch.no_grad():
        for impl in ("eager", "selfattention"):
            with hf.using(model, impl):
                tokens[impl] = model.generate(input_ids=ids, attention_mask=am, **kw)
    assert torch.equal(tokens["eager"], tokens["selfattention"])
