"""The one-pass output + statistics path (:mod:`selfattention.kernels.stats_fused`): which problems it takes,
and that what it returns matches a float64 oracle (the sweep's own tests run it too, see conftest)."""

from __future__ import annotations

import math

import pytest
import torch

from selfattention.kernels import stats_fused
from selfattention.tiled import tiled_attention_with_stats


def _oracle(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    kr, vr = (t.double().repeat_interleave(g, 1) for t in (k, v))
    s = q.double() @ kr.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    lse = torch.logsumexp(s, -1)
    w = torch.exp(s - lse[..., None])
    ent = -(w * torch.where(w > 0, s - lse[..., None], 0.0)).sum(-1)
    return w @ vr, lse, ent, w


@pytest.fixture
def taken(monkeypatch):
    """How many calls the one-pass path answered."""
    count = [0]
    real = stats_fused.attention_with_stats

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        count[0] += out is not None
        return out

    monkeypatch.setattr(stats_fused, "attention_with_stats", spy)
    return count


@pytest.mark.parametrize("rows", [64, 5])
@pytest.mark.parametrize(
    "b, h, hk, tq, tk, causal, top_k",
    [
        (2, 4, 2, 97, 97, True, 3),
        (1, 3, 1, 7, 130, False, 4),
        (1, 2, 2, 70, 70, True, 20),
        (1, 1, 1, 33, 9, False, 16),
    ],
)
def test_matches_float64_and_is_taken(monkeypatch, taken, rows, b, h, hk, tq, tk, causal, top_k):
    monkeypatch.setattr(stats_fused, "ROWS", rows)
    monkeypatch.setattr(stats_fused, "MAX_ROW_TILE", 4 * rows * tk)  # several key heads per job when hk > 1
    g = torch.Generator().manual_seed(tq + tk)
    q, k, v = (torch.randn(b, n, t, 16, generator=g) for n, t in ((h, tq), (hk, tk), (hk, tk)))
    out, st = tiled_attention_with_stats(q, k, v, is_causal=causal, top_k=top_k, enable_gqa=True)
    assert taken[0] == 1
    r_out, r_lse, r_ent, w = _oracle(q, k, v, causal)
    for got, ref in ((out, r_out), (st.lse, r_lse), (st.entropy, r_ent), (st.column_sums, w.sum(-2))):
        assert torch.allclose(got.double(), ref, atol=2e-6, rtol=1e-5)
    kk = min(top_k, tk)
    ref_w = w.topk(kk, -1).values
    assert torch.allclose(st.topk_weights[..., :kk].double(), ref_w, atol=1e-6)
    # the named keys carry those weights, and −1 / 0 exactly where a query sees fewer than k keys
    seen = (torch.arange(tk) <= torch.arange(tq)[:, None]).sum(-1) if causal else torch.full((tq,), tk)
    assert torch.equal(st.topk_indices >= 0, (torch.arange(top_k) < seen[:, None]).expand_as(st.topk_indices))
    picked = w.gather(-1, st.topk_indices.clamp_min(0)).masked_fill(st.topk_indices < 0, 0.0)
    assert torch.allclose(picked, st.topk_weights.double(), atol=1e-6)


@pytest.mark.parametrize("case", ["window", "mask", "nan", "huge", "offset"])
def test_other_problems_take_the_sweep_and_still_match(taken, case):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(3))
    kw: dict = {"is_causal": True}
    vis = torch.ones(40, 40, dtype=torch.bool).tril()
    if case == "window":
        kw = {"window": 5}
        vis = vis & ~torch.ones(40, 40, dtype=torch.bool).tril(-5)
    elif case == "mask":
        vis = torch.rand(40, 40, generator=g) > 0.3
        vis[:, 0] = True
        kw = {"attn_mask": vis}
    elif case == "nan":  # a NaN key the causal mask hides from every query before it
        k = k.clone()
        k[0, :, 39] = math.nan
        vis = vis.clone()
        vis[:, 39] = False
        kw = {"attn_mask": vis}
    elif case == "huge":  # scores of hundreds: a weight can fall below float's smallest normal
        q = q * 60.0
    elif case == "offset":  # causal with Tq < Tk: bottom-right aligned, not the plain square
        q = q[:, :, :25]
        vis = torch.arange(40) <= torch.arange(25)[:, None] + 15
    out, st = tiled_attention_with_stats(q, k, v, top_k=2, **kw)
    assert taken[0] == 0
    s = (q.double() @ k.double().transpose(-1, -2) / math.sqrt(8)).masked_fill(~vis, -math.inf)
    w = torch.softmax(s, -1)
    if case != "nan":
        assert torch.allclose(out.double(), w @ v.double(), atol=1e-5)
    assert torch.allclose(st.column_sums.double(), w.sum(-2), atol=1e-4)


def test_bfloat16_within_twice_the_naive_error(taken):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 300, 32, generator=g) for _ in range(3))
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    out, st = tiled_attention_with_stats(qb, kb, vb, is_causal=True, top_k=0)
    assert taken[0] == 1 and out.dtype == torch.bfloat16
    r_out, _, r_ent, _ = _oracle(qb.float(), kb.float(), vb.float(), True)
    mask = torch.ones(300, 300, dtype=torch.bool).tril()
    naive = torch.softmax((qb @ kb.transpose(-1, -2) / math.sqrt(32)).masked_fill(~mask, -math.inf), -1) @ vb
    assert (out.double() - r_out).abs().max() <= 2 * (naive.double() - r_out).abs().max()
    assert torch.allclose(st.entropy.double(), r_ent, atol=1e-4)


def test_a_negative_scale_counts_by_its_size(taken):
    """The eligibility bound uses |scale|: scale = −30 gives scores of hundreds (weights below float's
    smallest normal), which the sweep serves, with no denormal in any statistic."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 16, 8, generator=g) for _ in range(3))
    _, st = tiled_attention_with_stats(q, k, v, scale=-30.0, top_k=16)
    assert taken[0] == 0
    tiny = torch.finfo(torch.float32).tiny
    for t in (st.topk_weights, st.column_sums, st.entropy):
        assert not ((t != 0) & (t.abs() < tiny)).any()


def test_scores_of_a_million_still_give_weights_that_sum_to_one():
    """ℓ ≈ 10⁶ is known to ulp(ℓ) = 0.06 only: the sweep used to return top weights of 1.28 and column sums
    summing to more than Tq; rows whose weights do not sum to 1 are now swept again."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4, 2, generator=g) for _ in range(3))
    _, st = tiled_attention_with_stats(q, k, v, scale=1e6, top_k=2)
    s = q.double() @ k.double().transpose(-1, -2) * 1e6
    w = torch.softmax(s, -1)
    assert torch.allclose(st.topk_weights[..., 0].double(), w.amax(-1), atol=1e-4)
    assert torch.allclose(st.column_sums.double(), w.sum(-2), atol=1e-4)
