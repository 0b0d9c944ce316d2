"""Edges of the drop-in promise found by a breaker run against torch's own functions: autocast, tensors made
under ``torch.inference_mode``, and numpy / 0-d tensor scales. The oracle is torch's SDPA / flex_attention
in the same situation (their dtype rules), and float64 math."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import selfattention as sa
from selfattention import flash, mods


def _qkv(seed=0, shape=(1, 2, 37, 16)):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g) for _ in range(3))


def _ref(q, k, v, causal=False, scale=None, cap=None):
    s = q.double() @ k.double().transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.parametrize("backend", [None, "tiled", "torch"])
def test_sdpa_under_cpu_autocast_casts_like_torch(backend):
    q, k, v = _qkv()
    mask = torch.randn(37, 37, generator=torch.Generator().manual_seed(5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        ours = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
        mixed = sa.scaled_dot_product_attention(q.bfloat16(), k, v, is_causal=True, backend=backend)
        mixed_t = F.scaled_dot_product_attention(q.bfloat16(), k, v, is_causal=True)
    assert theirs.dtype == ours.dtype == mixed.dtype == mixed_t.dtype == torch.bfloat16
    b = tuple(t.bfloat16() for t in (q, k, v))
    s = b[0].double() @ b[1].double().transpose(-1, -2) / 4 + mask.bfloat16().double()
    want = torch.softmax(s, -1) @ b[2].double()
    naive = (theirs.double() - want).abs().max()
    assert (ours.double() - want).abs().max() <= 2 * naive + 1e-2
    assert (mixed.double() - _ref(*b, causal=True)).abs().max() < 3e-2


def test_flex_under_cpu_autocast_casts_like_torch():
    q, k, v = _qkv(1)
    bm = sa.create_block_mask(mods.causal_mask, None, None, 37, 37)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = sa.flex_attention(q, k, v, block_mask=bm)
        mixed = sa.flex_attention(q.bfloat16(), k, v, score_mod=mods.softcap(5.0))
        theirs = torch_flex(q.bfloat16(), k, v, score_mod=mods.softcap(5.0))
    assert ours.dtype == mixed.dtype == theirs.dtype == torch.bfloat16
    b = tuple(t.bfloat16() for t in (q, k, v))
    assert (ours.double() - _ref(*b, causal=True)).abs().max() < 3e-2
    assert (mixed.double() - theirs.double()).abs().max() < 3e-2


def test_inference_mode_tensors_on_the_score_mod_paths():
    """Score-mod kernel, max scores, flash-attn's softcap / ALiBi: checkpointed blocks used to raise
    "Inference tensors cannot be saved for backward" although nothing requires grad."""
    with torch.inference_mode():
        q, k, v = _qkv(2)
    cap = mods.softcap(3.0)
    out = sa.flex_attention(q, k, v, score_mod=cap)
    assert (out.double() - _ref(q, k, v, cap=3.0)).abs().max() < 1e-5
    _, aux = sa.flex_attention(q, k, v, score_mod=cap, return_aux=sa.flex.AuxRequest(max_scores=True))
    s = q.double() @ k.double().transpose(-1, -2) / 4
    assert (aux.max_scores.double() - (3 * torch.tanh(s / 3)).amax(-1)).abs().max() < 1e-5
    qf, kf, vf = (t.transpose(1, 2) for t in (q, k, v))
    fl = flash.flash_attn_func(qf, kf, vf, softcap=3.0)
    assert (fl.transpose(1, 2).double() - _ref(q, k, v, cap=3.0)).abs().max() < 1e-5
    with torch.no_grad():
        want = flash.flash_attn_func(
            qf.clone(), kf.clone(), vf.clone(), alibi_slopes=torch.tensor([0.5, 0.25])
        )
    got = flash.flash_attn_func(qf, kf, vf, alibi_slopes=torch.tensor([0.5, 0.25]))
    assert torch.equal(got, want)


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), torch.tensor(0.3), 0.3])
def test_flex_takes_the_scales_torch_takes(scale):
    q, k, v = _qkv(3)
    ours = sa.flex_attention(q, k, v, scale=scale)
    assert (ours.double() - _ref(q, k, v, scale=0.3)).abs().max() < 1e-5
    assert (ours - torch_flex(q, k, v, scale=scale)).abs().max() < 1e-5


def test_autocast_leaves_float64_alone_and_reaches_compiled_calls():
    """torch's rule: autocast casts float32/16 inputs, never float64; and a compiled function that calls
    attention under autocast gets the autocast dtype as torch's own SDPA does (found by a breaker run)."""
    q64 = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    q = torch.randn(1, 2, 16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sa.scaled_dot_product_attention(q64, q64, q64, backend="tiled").dtype == torch.float64
        assert sa.flex_attention(q64, q64, q64).dtype == torch.float64

    def ours(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return sa.scaled_dot_product_attention(x, x, x, backend="tiled")

    def theirs(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.scaled_dot_product_attention(x, x, x)

    got = torch.compile(ours, backend="aot_eager", fullgraph=True)(q)
    want = torch.compile(theirs, backend="aot_eager")(q)
    assert got.dtype == want.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() < 3e-2
