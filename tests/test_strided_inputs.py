"""Inputs whose last dim is not stride 1 (keys made as (B, H, D, T).transpose(-1, -2), as Inkling's short
convolution produces them): torch 2.13's fused CPU kernels read such rows as if contiguous and give wrong
numbers without an error. Found by a sweep of transformers architectures: the transformers backend's
no-grad fast paths handed such views to the kernel (logits off by 25 %). Every entry point is checked
against float64 math on contiguous copies, forward and gradients."""

from __future__ import annotations

import math
import types

import pytest
import torch

import selfattention as sa
from selfattention import hf
from selfattention.flash import flash_attn_func
from selfattention.kernels import vendor


def _views(seed: int = 0, b: int = 2, h: int = 4, hk: int = 2, t: int = 37, d: int = 16):
    """q (B, H, T, D), k/v (B, Hk, T, D) float32 views with last-dim stride T (transposed storage)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, t, generator=g).transpose(-1, -2)
    k = torch.randn(b, hk, d, t, generator=g).transpose(-1, -2)
    v = torch.randn(b, hk, d, t, generator=g).transpose(-1, -2)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == t
    return q, k, v


def _oracle(q, k, v, causal: bool, bias=None):
    """float64 (B, H, T, D); causal is top-left (Tq == Tk here)."""
    g = q.shape[1] // k.shape[1]
    kr, vr = (x.double().repeat_interleave(g, 1) for x in (k, v))
    s = q.double() @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias.double()
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ vr


@pytest.mark.parametrize("causal", [False, True])
def test_the_vendor_kernel_gets_unit_stride_rows(causal):
    q, k, v = _views()
    out, lse = vendor.forward(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), None, causal, 0.25)
    assert (out.double() - _oracle(q, k, v, causal)).abs().max() < 1e-5
    do = torch.randn(2, 4, 16, 37).transpose(-1, -2)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    got = vendor.backward(do, q, kk, vv, out, lse, None, causal, 0.25)
    want = vendor.backward(*(x.contiguous() for x in (do, q, kk, vv, out, lse)), None, causal, 0.25)
    for a, b_ in zip(got, want, strict=True):
        assert (a - b_).abs().max() < 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_the_transformers_backend_with_strided_views(causal, grad):
    """The mask function's LazyMask (the plain fast path) and a position bias (the dense-bias path)."""
    from transformers import masking_utils as mu

    q, k, v = _views(1)
    q.requires_grad_(grad)
    module = types.SimpleNamespace(is_causal=causal, training=False, num_key_value_groups=2)
    module.config = types.SimpleNamespace(_attn_implementation=hf.NAME)
    fn = mu.causal_mask_function if causal else mu.bidirectional_mask_function
    lazy = hf.attention_mask(2, 37, 37, mask_function=fn)
    bias = torch.randn(1, 4, 37, 37, generator=torch.Generator().manual_seed(2))
    for pb in (None, bias):
        ours, _ = hf.attention_forward(module, q, k, v, lazy, scaling=0.25, position_bias=pb)
        want = _oracle(q.detach(), k, v, causal, pb).transpose(1, 2)
        assert (ours.double() - want).abs().max() < 1e-5
        if grad:
            (g,) = torch.autograd.grad(ours.sum(), q)
            qd = q.detach().double().requires_grad_(True)
            (gw,) = torch.autograd.grad(_oracle(qd, k, v, causal, pb).sum(), qd)
            assert (g.double() - gw).abs().max() < 1e-4


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_flex_and_flash_with_strided_views(causal):
    q, k, v = _views(3)
    want = _oracle(q, k, v, causal)
    tiled = sa.scaled_dot_product_attention(q, k, v, is_causal=causal, backend="tiled", enable_gqa=True)
    assert (tiled.double() - want).abs().max() < 1e-5
    bm = sa.create_block_mask(sa.mods.causal_mask if causal else sa.noop_mask, None, None, 37, 37)
    flex = sa.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert (flex.double() - want).abs().max() < 1e-5
    # flash-attn's layout (B, T, H, D), its last dim strided too
    qf, kf, vf = (torch.randn(x.shape[0], x.shape[1], 16, 37).transpose(-1, -2) for x in (q, k, v))
    qf, kf, vf = (y.transpose(1, 2) for y in (qf, kf, vf))  # (B, T, H, D), stride(-1) = 37
    assert qf.stride(-1) != 1
    fl = flash_attn_func(qf, kf, vf, causal=causal)
    want_f = _oracle(qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2), causal).transpose(1, 2)
    assert (fl.double() - want_f).abs().max() < 1e-5
