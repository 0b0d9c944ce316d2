"""Streaming statistics (:func:`selfattention.tiled.tiled_attention_with_stats`) against the float64 loop
oracle (tests/oracle.py): entropy, top-k and column sums from the materialised weights."""

from __future__ import annotations

import math

import pytest
import torch

from selfattention.tiled import tiled_attention_with_stats
from tests.oracle import attention_ref


def _qkv(b, h, hk, tq, tk, d, dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hk, tk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hk, tk, dv, generator=g, dtype=dtype)
    return q, k, v


def _oracle_stats(q, k, v, vis, top_k):
    """(out, lse, entropy, top weights, top indices (-1 past the visible keys), column sums) in float64
    from the loop oracle's weights; ``vis`` bool broadcastable to (B, H, Tq, Tk)."""
    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out, w = attention_ref(q, kr, vr, attn_mask=vis)
    scores = (q.double() @ kr.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    seen = vis.expand(w.shape)
    w = torch.where(seen, w, 0.0)  # the loop oracle writes e/z = 0/NaN into the hidden entries of a NaN row
    lse = torch.logsumexp(torch.where(seen, scores, -math.inf), dim=-1)
    ent = -(w * torch.log(torch.where(w > 0, w, torch.ones_like(w)))).sum(-1)
    kk = min(top_k, w.shape[-1])
    tw, ti = w.topk(kk, dim=-1)
    ti = ti.masked_fill(tw == 0, -1)
    if kk < top_k:
        tw = torch.cat([tw, tw.new_zeros((*tw.shape[:-1], top_k - kk))], -1)
        ti = torch.cat([ti, ti.new_full((*ti.shape[:-1], top_k - kk), -1)], -1)
    return out, lse, ent, tw, ti, w.sum(-2)


def _check(out, st, ref, atol=1e-10):
    r_out, r_lse, r_ent, r_tw, r_ti, r_cs = ref
    assert torch.allclose(out.double(), r_out, atol=atol, rtol=0)
    assert torch.equal(torch.isinf(st.lse), torch.isinf(r_lse))
    fin = torch.isfinite(r_lse)
    assert torch.allclose(st.lse.double()[fin], r_lse[fin], atol=atol, rtol=0)
    assert torch.allclose(st.entropy.double(), r_ent, atol=atol, rtol=0)
    assert torch.allclose(st.topk_weights.double(), r_tw, atol=atol, rtol=0)
    assert torch.equal(st.topk_indices, r_ti)
    assert torch.allclose(st.column_sums.double(), r_cs, atol=atol, rtol=0)


# ---------------------------------------------------------------- hidden keys never leak (issue 19, 5)


@pytest.mark.parametrize("blocks", [(4, 3), (256, 512)])
def test_nan_key_hidden_by_bool_mask_does_not_leak_into_stats(blocks):
    q, k, v = _qkv(1, 2, 2, 9, 11, 5, 3, seed=1)
    k[0, :, 4] = math.nan
    v[0, :, 7] = math.inf
    mask = torch.ones(9, 11, dtype=torch.bool)
    mask[:, 4] = False
    mask[:, 7] = False
    out, st = tiled_attention_with_stats(
        q, k, v, attn_mask=mask, top_k=3, block_q=blocks[0], block_k=blocks[1]
    )
    assert not (st.topk_indices == 4).any() and not (st.topk_indices == 7).any()
    for t in (out, st.entropy, st.topk_weights, st.column_sums, st.lse):
        assert torch.isfinite(t).all()
    assert torch.equal(st.column_sums[..., [4, 7]], torch.zeros(1, 2, 2, dtype=torch.float64))
    _check(out, st, _oracle_stats(q, k, v, mask, 3))


def test_nan_key_of_another_document_does_not_leak_into_stats():
    q, k, v = _qkv(1, 2, 1, 13, 13, 4, 4, seed=2)
    ids = torch.tensor([0] * 6 + [1] * 7)
    k[0, 0, 2] = math.nan  # document 0's rows see it (NaN in, NaN out); document 1 must not
    out, st = tiled_attention_with_stats(
        q, k, v, document_ids=ids, enable_gqa=True, top_k=2, block_q=3, block_k=5
    )
    vis = ids[:, None] == ids[None, :]
    r_out, r_lse, r_ent, r_tw, r_ti, r_cs = _oracle_stats(q, k, v, vis, 2)
    b = slice(6, None)
    assert torch.isnan(st.entropy[..., :6]).all() and torch.isnan(st.column_sums[..., :6]).all()
    assert torch.allclose(out[..., b, :], r_out[..., b, :], atol=1e-10, rtol=0)
    assert torch.allclose(st.entropy[..., b], r_ent[..., b], atol=1e-10, rtol=0)
    assert torch.allclose(st.column_sums[..., b], r_cs[..., b], atol=1e-10, rtol=0)
    assert torch.allclose(st.topk_weights[..., b, :], r_tw[..., b, :], atol=1e-10, rtol=0)
    assert torch.equal(st.topk_indices[..., b, :], r_ti[..., b, :])
