"""Streaming statistics (:func:`selfattention.tiled.tiled_attention_with_stats`) against the float64 loop
oracle (tests/oracle.py): entropy, top-k and column sums from the materialised weights."""

from __future__ import annotations

import math

import pytest
import torch

from selfattention.tiled import tiled_attention_with_stats
from tests.oracle import attention_ref, visible_mask


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


# ---------------------------------------------------------------- every visibility against the oracle


def _block_mask(tq, tk):
    """Hides whole blocks (keys 8..23 for every row, rows 0..3 entirely) and a checkerboard elsewhere."""
    m = (torch.arange(tq)[:, None] + torch.arange(tk)[None, :]) % 3 != 0
    m[:, 8:24] = False
    m[:4] = False
    return m


_CASES = {
    "causal": (23, 23, {"is_causal": True}),
    "causal Tq<Tk": (7, 12, {"is_causal": True}),
    "causal Tq>Tk (blind rows)": (12, 7, {"is_causal": True}),
    "window": (29, 31, {"window": 5}),
    "dense Tq!=Tk": (9, 26, {}),
    "blocks hidden": (21, 30, {"mask": True}),
}


def _vis_of(tq, tk, kw):
    if kw.get("mask"):
        return _block_mask(tq, tk)
    return visible_mask(tq, tk, is_causal=kw.get("is_causal", False), window=kw.get("window"))


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.parametrize("blocks", [(4, 7), (5, 3), (128, 512)])
@pytest.mark.parametrize("top_k", [1, 3, 40])
def test_stats_match_float64_oracle(case, blocks, top_k):
    tq, tk, kw = _CASES[case]
    q, k, v = _qkv(2, 4, 2, tq, tk, 6, 5, seed=tq * 31 + tk)
    vis = _vis_of(tq, tk, kw)
    args = {"attn_mask": vis} if kw.get("mask") else kw
    out, st = tiled_attention_with_stats(
        q, k, v, enable_gqa=True, top_k=top_k, block_q=blocks[0], block_k=blocks[1], **args
    )
    _check(out, st, _oracle_stats(q, k, v, vis, top_k))


def test_stats_documents_match_float64_oracle():
    q, k, v = _qkv(1, 3, 1, 40, 40, 7, 3, seed=5)
    ids = torch.tensor([0] * 5 + [1] * 20 + [2] * 3 + [3] * 12)
    out, st = tiled_attention_with_stats(
        q, k, v, document_ids=ids, enable_gqa=True, top_k=4, block_q=8, block_k=8
    )
    _check(out, st, _oracle_stats(q, k, v, ids[:, None] == ids[None, :], 4))


def test_stats_float_mask_match_float64_oracle():
    q, k, v = _qkv(1, 2, 2, 11, 14, 5, 4, seed=6)
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(1, 2, 11, 14, generator=g, dtype=torch.float64)
    bias[..., 3:9] = -math.inf
    out, st = tiled_attention_with_stats(q, k, v, attn_mask=bias, top_k=2, block_q=4, block_k=5)
    kr, vr = k, v
    ref_out, w = attention_ref(q, kr, vr, attn_mask=bias)
    s = q @ k.transpose(-1, -2) / math.sqrt(5) + bias
    assert torch.allclose(out, ref_out, atol=1e-10)
    assert torch.allclose(st.lse, torch.logsumexp(s, -1), atol=1e-10)
    ent = -(w * torch.log(torch.where(w > 0, w, torch.ones_like(w)))).sum(-1)
    assert torch.allclose(st.entropy, ent, atol=1e-10)
    assert torch.allclose(st.column_sums, w.sum(-2), atol=1e-10)
    tw, ti = w.topk(2, -1)
    assert torch.allclose(st.topk_weights, tw, atol=1e-10) and torch.equal(st.topk_indices, ti)


@pytest.mark.parametrize("kw", [{"is_causal": True}, {"window": 100}, {}])
def test_stats_float32_t1025_match_float64(kw):
    """Default blocks (several calls, block skipping) in float32: within 1e-5 of float64 math."""
    q, k, v = _qkv(1, 2, 1, 1025, 1025, 40, 24, dtype=torch.float32, seed=8)
    out, st = tiled_attention_with_stats(q, k, v, enable_gqa=True, top_k=4, **kw)
    vis = _vis_of(1025, 1025, kw)
    kr, vr = (t.double().repeat_interleave(2, 1) for t in (k, v))
    s = (q.double() @ kr.transpose(-1, -2) / math.sqrt(40)).masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    w = torch.exp(s - lse[..., None])
    ent = -(w * torch.where(w > 0, s - lse[..., None], 0.0)).sum(-1)
    assert torch.allclose(out.double(), w @ vr, atol=1e-5, rtol=1e-5)
    assert torch.allclose(st.lse.double(), lse, atol=1e-5, rtol=1e-5)
    assert torch.allclose(st.entropy.double(), ent, atol=1e-5 * (1 + lse.abs().max().item()), rtol=1e-5)
    assert torch.allclose(st.column_sums.double(), w.sum(-2), atol=1e-5, rtol=1e-5)
    tw, ti = w.topk(4, -1)
    ti = ti.masked_fill(tw == 0, -1)
    assert torch.allclose(st.topk_weights.double(), tw, atol=1e-5, rtol=1e-5)
    assert (st.topk_indices == ti).double().mean() > 0.999  # float32 near-ties may swap


def test_stats_without_column_sums_or_top_k():
    q, k, v = _qkv(1, 2, 2, 10, 10, 4, 4, seed=9)
    vis = visible_mask(10, 10, is_causal=True)
    ref = _oracle_stats(q, k, v, vis, 2)
    _, st = tiled_attention_with_stats(q, k, v, is_causal=True, top_k=2, column_sums=False)
    assert st.column_sums is None and torch.allclose(st.entropy, ref[2], atol=1e-10)


@pytest.mark.parametrize("kw", [{"is_causal": True}, {}, {"window": 333}])
@pytest.mark.parametrize("top_k", [1, 4, 9])
def test_stats_float64_wide_tiles_match_float64(kw, top_k):
    """Default blocks, tiles wide enough for the grouped top-k (widths not multiples of 16)."""
    q, k, v = _qkv(1, 2, 2, 1100, 1100, 24, 8, seed=10)
    q = q * 3  # peaked weights: a few keys dominate
    out, st = tiled_attention_with_stats(q, k, v, top_k=top_k, **kw)
    vis = _vis_of(1100, 1100, kw)
    s = (q @ k.transpose(-1, -2) / math.sqrt(24)).masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    w = torch.exp(s - lse[..., None])
    ent = -(w * torch.where(w > 0, s - lse[..., None], 0.0)).sum(-1)
    tw, ti = w.topk(top_k, -1)
    ti = ti.masked_fill(tw == 0, -1)
    assert torch.allclose(out, w @ v, atol=1e-10, rtol=0)
    assert torch.allclose(st.entropy, ent, atol=1e-10, rtol=0)
    assert torch.allclose(st.column_sums, w.sum(-2), atol=1e-10, rtol=0)
    assert torch.allclose(st.topk_weights, tw, atol=1e-12, rtol=0) and torch.equal(st.topk_indices, ti)
