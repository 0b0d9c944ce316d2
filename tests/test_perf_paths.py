"""The per-call shortcuts of the fast paths keep every check: the shape verdict cached by check_qkv, the
one-number deferred NaN/inf check of the fused kernel's result, the one-op log-sum-exp fix of the vendor
backward. Oracles: float64 reference math (tests/oracle.py) and the spec."""

from __future__ import annotations

import math

import pytest
import torch

from selfattention import functional
from selfattention._validation import check_qkv
from selfattention.flash_kvcache import flash_attn_with_kvcache
from selfattention.tiled import tiled_attention
from tests.oracle import attention_ref


def test_cached_shapes_still_check_types_and_dtypes():
    q = torch.randn(1, 3, 7, 5)
    k = torch.randn(1, 3, 9, 5)
    check_qkv(q, k, k)  # the shape triple is now cached
    with pytest.raises(TypeError, match="same dtype"):
        check_qkv(q, k.double(), k)
    with pytest.raises(TypeError, match="floating"):
        check_qkv(q, k, k.int())
    with pytest.raises(TypeError, match="layout"):
        check_qkv(q, k.to_sparse(), k)
    with pytest.raises(TypeError, match="enable_gqa"):
        check_qkv(q, k, k, enable_gqa=1)


def test_cache_is_per_shape_and_per_gqa_flag():
    q = torch.randn(1, 4, 7, 5)
    k = torch.randn(1, 2, 9, 5)
    batch, tq, tk = check_qkv(q, k, k, enable_gqa=True)
    assert (tuple(batch), tq, tk) == ((1, 4), 7, 9)
    with pytest.raises(ValueError, match="enable_gqa"):  # same shapes, other flag: not the cached verdict
        check_qkv(q, k, k)
    with pytest.raises(ValueError, match="head_dim"):
        check_qkv(q, torch.randn(1, 2, 9, 6), torch.randn(1, 2, 9, 6), enable_gqa=True)


@pytest.mark.parametrize("t", [7, 97])
def test_deferred_check_hidden_nan_never_leaks(t):
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(1, 2, t, 6, generator=g, dtype=torch.float64) for _ in range(3))
    k[..., -1, :] = math.nan  # the last key: hidden from every query but the last by the causal mask
    v[..., -1, :] = math.inf
    with torch.no_grad():
        out = tiled_attention(q.float(), k.float(), v.float(), is_causal=True)
    ref, _ = attention_ref(q[..., :-1, :], k[..., :-1, :], v[..., :-1, :], is_causal=True)
    torch.testing.assert_close(out[..., :-1, :].double(), ref.reshape(1, 2, t - 1, 6), rtol=1e-5, atol=1e-5)


def test_deferred_check_nan_query_row_matches_the_spec():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 5, generator=g) for _ in range(3))
    q[0, 1, 4] = math.nan  # the fused kernel drops NaN scores: the row must not come back as "sees nothing"
    with torch.no_grad():
        out = tiled_attention(q, k, v)
    want = functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, want, equal_nan=True)
    assert torch.isnan(out[0, 1, 4]).all() and torch.isfinite(out[0, 0]).all()


def test_decode_step_nan_beyond_cache_length_never_leaks():
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(1, 40, 3, 6, generator=g)
    vc = torch.randn(1, 40, 3, 6, generator=g)
    kc[:, 33:] = math.nan  # past cache_seqlens: never visible
    vc[:, 33:] = math.inf
    q = torch.randn(1, 1, 3, 6, generator=g)
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([33], dtype=torch.int32), causal=True)
    ref, _ = attention_ref(q.transpose(1, 2), kc[:, :33].transpose(1, 2), vc[:, :33].transpose(1, 2))
    torch.testing.assert_close(out.transpose(1, 2).double(), ref.reshape(1, 3, 1, 6), rtol=1e-5, atol=1e-5)


def test_gradient_of_a_row_that_sees_nothing_is_zero():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 7, 5, generator=g).requires_grad_() for _ in range(3))
    mask = torch.ones(7, 7, dtype=torch.bool)
    mask[2] = False  # query 2 sees no key: zeros, zero gradient (the vendor backward's lse fix)
    out = tiled_attention(q, k, v, mask)
    out.sum().backward()
    assert torch.equal(out[0, :, 2], torch.zeros(2, 5))
    assert torch.equal(q.grad[0, :, 2], torch.zeros(2, 5))
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
