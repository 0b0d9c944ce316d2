"""Under torch.compile, torch.export, torch.func (vmap, jacrev), batched gradients and torch.jit.trace.

Every backend is one registered custom op there (selfattention.ops). Oracles: the same backend run
eagerly (compiled and eager must agree), the float64 spec computed sample by sample (vmap, batched
gradients) and its Jacobian from torch.autograd.functional.jacobian (jacrev). Sizes are tiny: compiling
on CPU costs seconds, and most compiles use the ``aot_eager`` backend (the same tracing, no code
generation); the README's example is compiled with inductor, the default.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import selfattention as sa
from selfattention import functional as spec

BACKENDS = ["reference", "torch", "tiled"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(tq=5, tk=7, h=4, hkv=2, d=6, dv=5, b=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, tk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, tk, dv, generator=g, dtype=dtype)
    return q, k, v


def _mask(tq=5, tk=7):
    m = torch.rand(tq, tk, generator=torch.Generator().manual_seed(3)) > 0.4
    m[1] = False  # a query that sees nothing: zeros, never NaN
    return m


def _breaks(fn, *args, **kwargs) -> int:
    torch._dynamo.reset()
    n = torch._dynamo.explain(fn)(*args, **kwargs).graph_break_count
    torch._dynamo.reset()
    return n


# ------------------------------------------------------------------------------------- the README example
def test_readme_multihead_attention_compiles_with_no_graph_break():
    # README, "Use it from Python": the MultiHeadAttention lines, compiled with the default backend
    torch.manual_seed(0)
    mha = sa.MultiHeadAttention(embed_dim=64, num_heads=8, num_kv_heads=2, backend="tiled").eval()
    x = torch.randn(2, 10, 64)
    with torch.no_grad():
        want, _ = mha(x, is_causal=True)
        assert _breaks(mha, x, is_causal=True) == 0
        compiled = torch.compile(mha, fullgraph=True)
        got, _ = compiled(x, is_causal=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_function_matches_eager_with_masks_gqa_and_gradients(backend):
    q, k, v = _qkv()
    mask = _mask()
    mask[:, 3] = False
    bias = torch.randn(1, 4, 5, 7)
    k[0, 1, 3] = math.nan  # a NaN in a key that the mask hides: it must not leak (0 · NaN)

    def f(q, k, v, m, b):
        a = sa.scaled_dot_product_attention(q, k, v, m, enable_gqa=True, backend=backend)
        c = sa.scaled_dot_product_attention(q, k.nan_to_num(), v, b, is_causal=True, enable_gqa=True,
                                            backend=backend)  # fmt: skip
        return a + c

    assert _breaks(f, q, k, v, mask, bias) == 0
    leaves = [t.clone().requires_grad_() for t in (q, v, bias)]
    want = f(leaves[0], k, leaves[1], mask, leaves[2])
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    leaves2 = [t.clone().requires_grad_() for t in (q, v, bias)]
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(leaves2[0], k, leaves2[1], mask, leaves2[2])
    got_grads = torch.autograd.grad(got.square().sum(), leaves2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the blind query (mask row 1) stays zero inside the compiled graph
    assert torch.equal(sa.scaled_dot_product_attention(q, k.nan_to_num(), v, mask, enable_gqa=True,
                                                       backend=backend)[:, :, 1], torch.zeros(2, 4, 5))  # fmt: skip


def test_a_nan_in_a_float_mask_is_still_refused_when_compiled():
    q, k, v = _qkv()
    bad = torch.zeros(5, 7)
    bad[2, 2] = math.nan
    f = torch.compile(lambda q, m: sa.scaled_dot_product_attention(q, k, v, m, enable_gqa=True), fullgraph=True,
                      backend="aot_eager")  # fmt: skip
    with pytest.raises(ValueError, match="NaN"):
        f(q, bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_small_transformers_model_compiles_with_no_graph_break(backend, monkeypatch):
    pytest.importorskip("transformers")
    from selfattention import hf
    from tests.tiny_models import build

    hf.register()
    monkeypatch.setattr(hf, "BACKEND", backend)
    model = build("llama")
    model.set_attn_implementation("selfattention")
    ids = torch.randint(3, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[0, :3] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=pad).logits
        assert _breaks(model, input_ids=ids, attention_mask=pad) == 0
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(
            input_ids=ids, attention_mask=pad
        ).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------- torch.export
@pytest.mark.parametrize("backend", BACKENDS)
def test_export_multihead_attention(backend):
    torch.manual_seed(1)
    mha = sa.MultiHeadAttention(embed_dim=12, num_heads=4, num_kv_heads=2, backend=backend).eval()

    class Causal(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, x, pad):
            return self.mha(x, key_padding_mask=pad, is_causal=True)[0]

    x = torch.randn(2, 6, 12)
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[1, :2] = False
    ep = torch.export.export(Causal(), (x, pad))
    assert any("selfattention.attention" in str(n.target) for n in ep.graph.nodes)
    x2 = torch.randn(2, 6, 12)
    torch.testing.assert_close(ep.module()(x2, pad), Causal()(x2, pad), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------- torch.func
def _per_sample(fn, *xs):
    return torch.stack([fn(*(x[i] for x in xs)) for i in range(xs[0].shape[0])])


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_matches_a_loop_of_the_spec(backend):
    q, k, v = _qkv(b=3, dtype=torch.float64)
    masks = torch.stack([_mask(), ~_mask(), _mask().roll(1, 1)])  # one mask per sample

    def f(q, k, v, m):
        return sa.scaled_dot_product_attention(q, k, v, m, is_causal=True, enable_gqa=True, backend=backend)

    got = torch.func.vmap(f)(q, k, v, masks)

    def oracle(q, k, v, m):
        return spec.scaled_dot_product_attention(q, k, v, m, is_causal=True, enable_gqa=True)

    torch.testing.assert_close(got, _per_sample(oracle, q, k, v, masks), rtol=1e-10, atol=1e-10)
    # key/value shared by every sample (in_dims None)
    got = torch.func.vmap(f, in_dims=(0, None, None, None))(q, k[0], v[0], masks[0])
    want = _per_sample(lambda q: oracle(q, k[0], v[0], masks[0]), q)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_jacrev_matches_the_float64_jacobian(backend):
    q, k, v = _qkv(tq=3, tk=4, h=2, hkv=1, d=3, dv=2, b=1, dtype=torch.float64)
    mask = torch.tensor([[True, False, True, True], [False, False, False, False], [True, True, False, True]])

    def f(q, k, v):
        return sa.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, backend=backend)

    jac = torch.func.jacrev(f, argnums=(0, 1, 2))(q, k, v)
    want = torch.autograd.functional.jacobian(
        lambda q, k, v: spec.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True), (q, k, v)
    )
    for a, b in zip(jac, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_grads_batched_matches_a_loop(backend):
    q, k, v = (t.requires_grad_() for t in _qkv(dtype=torch.float64))
    out = sa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend)
    cot = torch.randn(3, *out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "no batching rule, falling back to a loop" notes
        got = torch.autograd.grad(out, (q, k, v), cot, is_grads_batched=True)
    ref = spec.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for i in range(3):
        want = torch.autograd.grad(ref, (q, k, v), cot[i], retain_graph=True)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a[i], b, rtol=1e-9, atol=1e-10)


# ------------------------------------------------------------------------------------------ jit.trace
@pytest.mark.parametrize("backend", BACKENDS)
def test_jit_trace(backend):
    q, k, v = _qkv()

    def f(q, k, v):
        return sa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(f, (q, k, v), check_trace=False)
    q2, k2, v2 = _qkv(seed=5)
    torch.testing.assert_close(traced(q2, k2, v2), f(q2, k2, v2), rtol=1e-6, atol=1e-6)
    assert "selfattention::attention" in str(traced.graph)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_dropout_backward_replays_the_forward_masks(backend):
    # out = (D ∘ P) V is linear in V: <w, out> = <dV, V> holds only if the backward used the forward's
    # dropout masks D (a second draw would give another matrix)
    g = torch.Generator().manual_seed(2)
    q, k = (
        torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64),
        torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64),
    )
    v = torch.randn(2, 3, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        return sa.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend=backend)

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (dv,) = torch.autograd.grad(out, v, w)
    assert abs(float((out * w).sum() - (v * dv).sum())) <= 1e-10
    eager = f(q, k, v)  # another draw: different masks, so the check above could fail
    assert not torch.allclose(eager, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_lengths_and_a_window_visibility_compile(backend):
    from selfattention.visibility import Visibility

    def f(q, k, v):
        return sa.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for t in (5, 9, 13):  # one graph, symbolic lengths
        q, k, v = _qkv(tq=t, tk=t, hkv=4, seed=t)
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=1e-6, atol=1e-6)
    q, k, v = _qkv(tq=9, tk=9, hkv=4)
    vis = Visibility(9, 9, is_causal=True, window=3)
    want = spec.scaled_dot_product_attention(q.double(), k.double(), v.double(), vis)
    got = torch.compile(lambda q: sa.scaled_dot_product_attention(q, k, v, vis, backend=backend), fullgraph=True,
                        backend="aot_eager")(q)  # fmt: skip
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
