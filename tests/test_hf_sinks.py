"""Attention sinks in selfattention.hf without a mask column: per head (gpt-oss' ``s_aux``, (H,)) and per query
(``sinks``, (B, H, Tq, 1)), both as out · σ(lse − sink) on the engine, gradients to the sinks included.

Oracles: the float64 definition (softmax over [scores, sink] with the sink's column dropped; written in
tests/test_hf_grad.py's ``reference``) and transformers' gpt-oss eager attention (per-head sinks).
"""

from __future__ import annotations

import math
import types

import pytest
import torch

pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

from selfattention import hf, hf_dense, mods  # noqa: E402
from tests.test_hf_grad import reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("hf_registered")


@pytest.fixture
def no_sink_column(monkeypatch):
    """Fail if the materialising route runs (the sink as a (Tq, Tk + 1) mask column)."""

    def boom(*a, **k):
        raise AssertionError("the dense sink route ran")

    monkeypatch.setattr(hf_dense, "with_sink", boom)
    monkeypatch.setattr(hf_dense, "additive_mask", boom)


def _module(groups: int = 2, sinks=None):
    m = types.SimpleNamespace(is_causal=True, training=False, num_key_value_groups=groups, sinks=sinks)
    m.config = types.SimpleNamespace(_attn_implementation="selfattention")
    return m


def _qkv(b, tq, tk, h=4, hkv=2, d=7, dv=10, dtype=torch.float64):
    g = torch.Generator().manual_seed(11)
    shapes = ((h, tq, d), (hkv, tk, d), (hkv, tk, dv))
    return [torch.randn(b, n, t, x, generator=g, dtype=dtype).requires_grad_(True) for n, t, x in shapes]


def _padding(b: int, t: int, hide: int | None = None) -> torch.Tensor:
    am = torch.ones(b, t, dtype=torch.bool)
    am[0, : min(3, t - 1)] = False
    if b > 1:
        am[-1, -2:] = False
    if hide is not None:
        am[hide] = False
    return am


RECIPES = {
    "window 5": lambda: mu.sliding_window_causal_mask_function(5),
    "causal": lambda: mu.causal_mask_function,
    "bidirectional": lambda: mu.bidirectional_mask_function,
}
SIZES = [(97, 97, 0, 0), (1, 40, 39, 0), (5, 37, 20, 3), (7, 7, 0, 0)]  # (Tq, Tk, q_offset, kv_offset)


@pytest.mark.parametrize("sink_batch", [2, 1])
@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_per_query_sinks_match_the_float64_reference(no_sink_column, recipe, sizes, sink_batch):
    """``sinks`` (B or 1, H, Tq, 1) on a lazy mask with padding and grouped heads: output and gradients
    (q, k, v, sinks) equal the float64 definition — float64 to 1e-10, float32 to 1e-5 relative."""
    tq, tk, qo, ko = sizes
    am = _padding(2, ko + tk)
    lazy = hf.attention_mask(2, tq, tk, qo, ko, mask_function=RECIPES[recipe](), attention_mask=am)
    keep = lazy.to_dense()
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        q, k, v = _qkv(2, tq, tk, dtype=dtype)
        sinks = (2 * torch.randn(sink_batch, 4, tq, 1, dtype=dtype)).requires_grad_(True)
        out, w = hf.attention_forward(_module(), q, k, v, lazy, scaling=0.35, sinks=sinks)
        zero_bias = torch.zeros((), dtype=torch.float64)
        ref = reference(q, k, v, zero_bias, keep, 0.35, sinks=sinks)
        assert w is None and out.dtype == dtype and out.shape == (2, tq, 4, 10)
        got_out = out.transpose(1, 2)
        assert (got_out - ref).abs().max() <= tol * max(1.0, float(ref.detach().abs().max()))
        gy = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
        got = torch.autograd.grad(got_out, (q, k, v, sinks), gy.to(dtype))
        want = torch.autograd.grad(ref, (q, k, v, sinks), gy)
        for name, a, e in zip(("q", "k", "v", "sinks"), got, want, strict=True):
            assert (a - e).abs().max() <= tol * max(1.0, float(e.abs().max())), name
        assert want[3].abs().max() > 1e-3  # the sinks matter


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_per_head_sinks_match_gpt_oss_eager_with_a_blind_batch_entry(no_sink_column, dtype):
    """``s_aux`` (H,) on a causal mask where every key of one batch entry is padding: that entry's rows
    give all their weight to the sink (output 0, as gpt-oss' eager), the rest equals gpt-oss eager;
    gradients to q, k, v and the sinks too."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    tq = tk = 23
    q, k, v = _qkv(2, tq, tk, dv=7, dtype=dtype)
    sinks = torch.randn(4, dtype=dtype, requires_grad=True)
    am = _padding(2, tk, hide=1)
    lazy = hf.attention_mask(2, tq, tk, mask_function=mu.causal_mask_function, attention_mask=am)
    additive = torch.zeros(lazy.shape, dtype=dtype).masked_fill(~lazy.to_dense(), -math.inf)
    module = _module(sinks=sinks)
    ours, _ = hf.attention_forward(module, q, k, v, lazy, scaling=0.3, s_aux=sinks)
    theirs, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.3)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert ours[1].abs().max() == 0 and (ours - theirs).abs().max() <= tol
    gy = torch.randn(ours.shape, dtype=dtype)
    for a, e in zip(
        torch.autograd.grad(ours, (q, k, v, sinks), gy),
        torch.autograd.grad(theirs, (q, k, v, sinks), gy),
        strict=True,
    ):
        assert torch.isfinite(a).all() and (a - e).abs().max() <= tol * max(1.0, float(e.abs().max()))


def test_sinks_in_a_mask_less_call_match_the_reference(no_sink_column):
    """transformers passes no mask for a plain causal prefill: per-query sinks on that call too."""
    q, k, v = _qkv(1, 19, 19)
    sinks = torch.randn(1, 4, 19, 1, dtype=torch.float64, requires_grad=True)
    out, _ = hf.attention_forward(_module(), q, k, v, None, sinks=sinks)
    keep = torch.ones(19, 19, dtype=torch.bool).tril()
    ref = reference(q, k, v, torch.zeros(()), keep, 1 / math.sqrt(7), sinks=sinks)
    assert (out.transpose(1, 2) - ref).abs().max() <= 1e-12
    (g,) = torch.autograd.grad(out.sum(), sinks)
    (e,) = torch.autograd.grad(ref.sum(), sinks)
    assert (g - e).abs().max() <= 1e-11


class _Storages(TorchDispatchMode):
    """The largest storage (bytes) and the shapes of every tensor an op returns, backward included."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.shapes = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
                self.shapes.append(tuple(t.shape))
        return out


def _sinks_call(t: int, materialise: bool) -> _Storages:
    q, k, v = _qkv(1, t, t, d=16, dv=16, dtype=torch.float32)
    sinks = torch.randn(1, 4, t, 1, requires_grad=True)
    lazy = hf.attention_mask(1, t, t, mask_function=mu.sliding_window_causal_mask_function(64))
    seen = _Storages()
    with seen:
        if materialise:  # the control: a recording takes the materialising route (a sink column)
            with hf.recording():
                out, _ = hf.attention_forward(_module(), q, k, v, lazy, scaling=0.25, sinks=sinks)
        else:
            out, _ = hf.attention_forward(_module(), q, k, v, lazy, scaling=0.25, sinks=sinks)
        out.sum().backward()
    assert torch.isfinite(sinks.grad).all() and sinks.grad.abs().max() > 0
    return seen


def test_per_query_sinks_allocate_no_tq_by_tk_tensor():
    """A window of 64 at T = 1024 with per-query sinks, forward and backward: no op returns a tensor of
    T²/4 floats or one with a (T + 1)-wide last dimension; the materialising route (the control) does."""
    t = 1024
    ours = _sinks_call(t, materialise=False)
    assert ours.largest < t * t, ours.largest  # bytes: a quarter of a (T, T) float32 tensor
    assert not any(s and s[-1] == t + 1 for s in ours.shapes)
    control = _sinks_call(t, materialise=True)
    assert control.largest >= 4 * t * (t + 1) and any(s and s[-1] == t + 1 for s in control.shapes)


def test_attention_sink_on_a_row_that_sees_nothing_is_zero_with_finite_gradients():
    """ℓ = −inf (no visible key): the output stays 0 and every gradient finite, also with a −inf sink."""
    out = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    lse = torch.tensor([[[0.5, -math.inf, 1.0], [-math.inf, 0.0, 2.0]]], dtype=torch.float64)
    lse.requires_grad_(True)
    sinks = torch.tensor(
        [[[[0.3], [-math.inf], [1.0]], [[-math.inf], [0.2], [-math.inf]]]], dtype=torch.float64
    )
    sinks.requires_grad_(True)
    y = mods.attention_sink(out, lse, sinks)
    assert y[0, 0, 1].abs().max() == 0 and y[0, 1, 0].abs().max() == 0
    assert torch.equal(y[0, 1, 2], out[0, 1, 2])  # a −inf sink on a row that sees keys takes no weight
    half = torch.sigmoid(torch.tensor(-0.2, dtype=torch.float64))
    assert torch.allclose(y[0, 1, 1], out[0, 1, 1] * half, rtol=1e-15, atol=0)
    for g in torch.autograd.grad(y.sum(), (out, lse, sinks)):
        assert torch.isfinite(g).all()


@pytest.mark.parametrize(
    "shape",
    [(2, 4, 5, 1), (1, 3, 6, 1), (3, 4, 6, 1), (1, 4, 6), (4,)],
)
def test_sinks_of_a_wrong_shape_are_refused_by_name(shape):
    """Query (2, 4, 6, 7): per-query sinks must be (1 or 2, 4, 6, 1) — anything else names the argument."""
    q, k, v = _qkv(2, 6, 6)
    with pytest.raises(ValueError, match=r"sinks must be a tensor of shape \(B, H, Tq, 1\) = \(2, 4, 6, 1\)"):
        hf.attention_forward(_module(), q, k, v, None, sinks=torch.zeros(shape))
    with pytest.raises(ValueError, match=r"attention_sink: sinks must have shape \(4,\) or"):
        mods.attention_sink(torch.zeros(2, 4, 6, 3), torch.zeros(2, 4, 6), torch.zeros(2, 4, 5, 1))
