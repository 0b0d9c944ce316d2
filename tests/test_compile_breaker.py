"""The breaker's pass over the transforms: a Visibility's flex predicate is never dropped under
torch.compile / vmap / jit.trace (the custom op's schema cannot carry it), hidden NaN keys stay hidden
when compiled, shapes changing between calls, GQA under vmap."""

from __future__ import annotations

import pytest
import torch

import selfattention as sa
from selfattention.predicate import Predicate
from selfattention.visibility import Visibility
from tests.oracle import attention_ref


def _qkv(tq=7, tk=9, d=5):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 3, tq, d, generator=g), torch.randn(2, 3, tk, d, generator=g),
            torch.randn(2, 3, tk, d, generator=g))  # fmt: skip


def _banded(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (kv_idx > q_idx - 3)


def test_eager_visibility_with_a_mod_is_the_oracle():
    q, k, v = _qkv()
    vis = Visibility(7, 9, mod=Predicate(mask_mod=_banded))
    ref, _ = attention_ref(q, k, v, attn_mask=vis.to_mask("cpu"))
    torch.testing.assert_close(
        sa.scaled_dot_product_attention(q, k, v, attn_mask=vis).double(), ref, rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("transform", ["compile", "vmap"])
def test_a_visibility_predicate_is_refused_under_a_transform_never_dropped(transform):
    # before the fix: the op rebuilt the Visibility without its mod, and every hidden key was seen
    q, k, v = _qkv()
    vis = Visibility(7, 9, mod=Predicate(mask_mod=_banded))

    def f(q, k, v):
        return sa.scaled_dot_product_attention(q, k, v, attn_mask=vis)

    run = torch.compile(f, backend="eager", fullgraph=True) if transform == "compile" else torch.vmap(f)
    with pytest.raises(Exception, match="mask_mod/score_mod predicate.*to_mask"):
        run(q, k, v)
    # the dense mask it names works and equals the oracle
    mask = vis.to_mask("cpu")

    def g(q, k, v):
        return sa.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    run = torch.compile(g, backend="eager", fullgraph=True) if transform == "compile" else torch.vmap(g)
    torch.testing.assert_close(
        run(q, k, v).double(), attention_ref(q, k, v, attn_mask=mask)[0], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("backend", ["reference", "torch", "tiled"])
def test_hidden_nan_keys_under_compile_match_eager(backend):
    q, k, v = _qkv()
    k[..., -1, :], v[..., -1, :] = float("nan"), float("inf")
    m = torch.ones(7, 9, dtype=torch.bool)
    m[:, -1] = False
    m[2] = False  # a query that sees nothing: zeros

    def f(q, k, v, m):
        return sa.scaled_dot_product_attention(q, k, v, attn_mask=m, backend=backend)

    got = torch.compile(f, backend="eager", fullgraph=True)(q, k, v, m)
    assert torch.isfinite(got).all() and torch.equal(got[..., 2, :], torch.zeros_like(got[..., 2, :]))
    torch.testing.assert_close(got, f(q, k, v, m), rtol=0, atol=0)
    ref, _ = attention_ref(q, k[..., :-1, :], v[..., :-1, :], attn_mask=m[:, :-1])
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


def test_shapes_changing_between_calls_dynamic_and_gqa_vmap():
    f = torch.compile(lambda q, k: sa.scaled_dot_product_attention(q, k, k, is_causal=True), dynamic=True,
                      backend="eager", fullgraph=True)  # fmt: skip
    for t in (1, 7, 13, 97):
        q, k = torch.randn(1, 2, t, 6), torch.randn(1, 2, t + 3, 6)
        ref, _ = attention_ref(q, k, k, is_causal=True)
        torch.testing.assert_close(f(q, k).double(), ref, rtol=1e-5, atol=1e-6)
    qg, kg = torch.randn(4, 2, 6, 5, 3), torch.randn(4, 2, 2, 8, 3)
    got = torch.vmap(lambda q, k: sa.scaled_dot_product_attention(q, k, k, enable_gqa=True))(qg, kg)
    ref, _ = attention_ref(qg, kg.repeat_interleave(3, dim=2), kg.repeat_interleave(3, dim=2))
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
