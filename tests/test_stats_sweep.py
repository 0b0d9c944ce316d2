"""The statistics sweep's job (:mod:`selfattention.kernels.stats_tile`): scripted and plain Python give the
float64 oracle's statistics, over several key chunks and top-k spans, with the denormal guard on and off,
and ``top_k=0``. Small tile constants make the multi-chunk / multi-span paths run at test sizes."""

from __future__ import annotations

import math

import pytest
import torch

from selfattention.kernels import stats_tile
from selfattention.tiled import tiled_attention_with_stats
from tests.oracle import visible_mask


def _ref(q, k, v, vis, top_k):
    """(out, lse, entropy, top weights, top indices (-1 where hidden), column sums) in float64."""
    g = q.shape[1] // k.shape[1]
    kr, vr = (t.double().repeat_interleave(g, 1) for t in (k, v))
    s = (q.double() @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1)
    w = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    ent = -(w * torch.where(w > 0, s - lse[..., None], 0.0)).sum(-1)
    tw, ti = w.topk(min(top_k, w.shape[-1]), -1)
    return w @ vr, lse, ent, tw, ti.masked_fill(tw == 0, -1), w.sum(-2)


@pytest.fixture
def job(small_stat_tiles):
    return small_stat_tiles


def test_the_job_is_scripted_on_this_torch():
    """A silent fallback to Python would bring back the GIL-bound sweep: scripting must work here."""
    assert isinstance(stats_tile.compiled(), torch.jit.ScriptFunction)


_CASES = {
    "causal, several chunks and spans": (3, 1, 203, 203, {"is_causal": True}),
    "dense Tq != Tk, remainder columns": (2, 2, 37, 251, {}),
    "window (stacked calls), GQA": (4, 2, 150, 150, {"window": 61}),
    "causal Tq > Tk (blind rows)": (2, 1, 70, 45, {"is_causal": True}),
}


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.parametrize("top_k", [0, 1, 5])
def test_sweep_matches_float64_oracle(job, case, top_k):
    h, hk, tq, tk, kw = _CASES[case]
    g = torch.Generator().manual_seed(tq * 7 + tk)
    q = torch.randn(2, h, tq, 20, generator=g, dtype=torch.float64) * 2
    k = torch.randn(2, hk, tk, 20, generator=g, dtype=torch.float64)
    v = torch.randn(2, hk, tk, 3, generator=g, dtype=torch.float64)
    out, st = tiled_attention_with_stats(q, k, v, enable_gqa=True, top_k=top_k, **kw)
    vis = visible_mask(tq, tk, is_causal=kw.get("is_causal", False), window=kw.get("window"))
    r_out, r_lse, r_ent, r_tw, r_ti, r_cs = _ref(q, k, v, vis, top_k)
    assert torch.allclose(out, r_out, atol=1e-10)
    assert torch.allclose(st.entropy, r_ent, atol=1e-10)
    assert torch.allclose(st.column_sums, r_cs, atol=1e-10)
    assert st.topk_weights.shape == (2, h, tq, top_k) and st.topk_indices.shape == (2, h, tq, top_k)
    if top_k:
        kk = r_tw.shape[-1]
        assert torch.allclose(st.topk_weights[..., :kk], r_tw, atol=1e-12)
        assert torch.equal(st.topk_indices[..., :kk], r_ti)
        assert (st.topk_indices[..., kk:] == -1).all() and (st.topk_weights[..., kk:] == 0).all()


@pytest.mark.parametrize("spread", [0.5, 40.0])
def test_float32_weights_below_the_floor_are_zero_not_denormal(job, spread):
    """spread 40: most weights lie far below e^-87 (the denormal floor), so the guarded path (clamp,
    threshold) runs; spread 0.5: every row is provably above it and the unguarded path runs. Both give the
    float64 statistics to float32 precision."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 120, 16, generator=g) * spread
    k = torch.randn(1, 2, 120, 16, generator=g)
    v = torch.randn(1, 2, 120, 4, generator=g)
    _, st = tiled_attention_with_stats(q, k, v, is_causal=True, top_k=3)
    vis = visible_mask(120, 120, is_causal=True)
    _, r_lse, r_ent, r_tw, r_ti, r_cs = _ref(q, k, v, vis, 3)
    # a float32 weight exp(s − ℓ) carries a relative error of about |s|·eps: scale the tolerance with ℓ
    tol = 1e-5 + 4 * torch.finfo(torch.float32).eps * r_lse.abs().max().item()
    assert torch.isfinite(st.entropy).all() and (st.entropy >= 0).all()
    assert torch.allclose(st.entropy.double(), r_ent, atol=tol, rtol=tol)
    assert torch.allclose(st.column_sums.double(), r_cs, atol=tol, rtol=tol)
    assert torch.allclose(st.topk_weights.double(), r_tw, atol=tol, rtol=tol)


def test_top_k_zero_and_bad_top_k():
    q = torch.randn(1, 1, 5, 4)
    _, st = tiled_attention_with_stats(q, q, q, is_causal=True, top_k=0)
    assert st.topk_indices.shape == (1, 1, 5, 0) and st.topk_weights.shape == (1, 1, 5, 0)
    with pytest.raises(ValueError, match="top_k must be a non-negative int, got -1"):
        tiled_attention_with_stats(q, q, q, top_k=-1)
    with pytest.raises(TypeError, match="top_k must be a non-negative int, got float"):
        tiled_attention_with_stats(q, q, q, top_k=2.0)
