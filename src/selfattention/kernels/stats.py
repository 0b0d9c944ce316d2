"""Statistics of the attention weights without the n × n matrix: one sweep over the engine's block plan.

Given the final log-sum-exp ℓ of every query row (from the kernel's forward), the weights of a tile are
α = exp(S − ℓ) exactly, so a second sweep over the same calls (skipped blocks stay skipped) gives:

* entropy  H_i = −Σ_j α_ij log α_ij = ℓ_i − Σ_j α_ij s_ij (nats),
* the top-k keys of every query (the largest scores are the largest weights) and their weights,
* column sums Σ_i α_ij: the attention each key receives.

The scores are recomputed with torch ops, tile by tile (:func:`selfattention.kernels.exact.scores_tile`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import exact
from .engine import Problem, _call_views, _fold, _stack_rows, _tile, _unstack

__all__ = ["AttentionStats", "sweep"]


@dataclass
class AttentionStats:
    """Per-query and per-key statistics of the attention weights, computed without the n×n matrix.

    Shapes for query (..., H, Tq, D) and key (..., Hkv, Tk, D); float32 (float64 for float64 input).

    Attributes:
        lse: (..., H, Tq) log Σⱼ exp(sᵢⱼ) over the visible scaled scores; -inf for a query that sees
            no key.
        entropy: (..., H, Tq) −Σⱼ αᵢⱼ log αᵢⱼ in nats; 0 for a query that sees no key (its maximum,
            log(number of visible keys), is reached by uniform weights).
        topk_indices: (..., H, Tq, k) int64 key positions of the k largest weights, largest first;
            -1 where a query sees fewer than k keys.
        topk_weights: (..., H, Tq, k) the weights αᵢⱼ of those keys (0 where the index is -1).
        column_sums: (..., H, Tk) Σᵢ αᵢⱼ — the attention each key receives, summed over queries
            (before dropout); None if not requested.
    """

    lse: torch.Tensor
    entropy: torch.Tensor
    topk_indices: torch.Tensor
    topk_weights: torch.Tensor
    column_sums: torch.Tensor | None


def sweep(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, prob: Problem, top_k: int, columns: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(entropy (B, H, Tq), top weights (B, H, Tq, k), top indices (B, H, Tq, k), column sums (B, H, Tk))
    for canonical q (B, H, Tq, D), k (B, Hkv, Tk, D) in the compute dtype and the final ``lse``."""
    b, h, tq, _ = q.shape
    tk = k.shape[2]
    psum = q.new_zeros((b, h, tq))  # Σ α s
    vals = q.new_full((b, h, tq, top_k), -math.inf)
    idx = torch.full((b, h, tq, top_k), -1, dtype=torch.int64, device=q.device)
    cols = q.new_zeros((b, h, tk, 1)) if columns else None
    lse_ref = torch.where(lse == -math.inf, torch.full((), math.inf, dtype=lse.dtype, device=lse.device), lse)
    for call in prob.plan.calls:
        bias = _tile(prob, call, q.device)
        rows = slice(call.r0, call.r1)
        for qv, kv, _, heads in _call_views(call, q, k, k[..., :0]):
            (lv,) = _stack_rows(call, lse_ref[:, heads, rows])
            ps, tv, ti, cs = _sweep_view(qv, kv, lv, bias, call, prob, top_k, columns)
            psum[:, heads, rows] += _unstack(call, ps, b)
            merged_v = torch.cat([vals[:, heads, rows], _unstack(call, tv, b)], dim=-1)
            merged_i = torch.cat([idx[:, heads, rows], _unstack(call, ti, b)], dim=-1)
            best_v, pick = merged_v.topk(top_k, dim=-1)
            vals[:, heads, rows] = best_v
            idx[:, heads, rows] = merged_i.gather(-1, pick)
            if cols is not None:
                _fold(call, cs.unsqueeze(-1), b, cols[:, heads])  # a view: adds into cols
    seen = lse != -math.inf
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    entropy = torch.where(seen, lse - psum, zero).clamp_min(0.0)
    hidden = vals == -math.inf
    weights = torch.exp(vals - torch.where(seen, lse, zero).unsqueeze(-1)).masked_fill(hidden, 0.0)
    return entropy, weights, idx.masked_fill(hidden, -1), None if cols is None else cols.squeeze(-1)


def _sweep_view(qv, kv, lv, bias, call, prob: Problem, top_k: int, columns: bool):
    """The statistics of one kernel view: q (B', Hq, R, D), k (B', Hk, C, D), lse (B', Hq, R)."""
    bq_, hq, rows, _ = qv.shape
    hk, ncols = kv.shape[1], kv.shape[2]
    g = hq // hk
    q5 = qv.unflatten(1, (hk, g))
    bias5 = exact._bias5(bias, hk, g)
    l5 = lv.unflatten(1, (hk, g))[..., None]  # (B', Hk, G, R, 1)
    ps = qv.new_zeros((bq_, hk, g, rows))
    tv = qv.new_full((bq_, hk, g, rows, top_k), -math.inf)
    ti = torch.full((bq_, hk, g, rows, top_k), -1, dtype=torch.int64, device=qv.device)
    cs = qv.new_zeros((bq_, hk, g, ncols)) if columns else None
    # absolute key position of column 0 of each stacked sub-call (views are (B·Hx, count, ...))
    base = torch.zeros((), dtype=torch.int64, device=qv.device) + call.c0
    if call.count > 1:
        base = (call.c0 + call.step * torch.arange(call.count, device=qv.device)).view(1, -1, 1, 1, 1)
    for i0, i1, chunks in exact.tiles(rows, ncols, call.causal, prob.exact_block_q, prob.exact_block_k):
        for j0, j1 in chunks:
            s = exact.scores_tile(q5, kv, bias5, call.causal, prob.scale, i0, i1, j0, j1)
            p = torch.exp(s - l5[..., i0:i1, :])  # α, 0 where hidden and for rows that see nothing
            ps[..., i0:i1] += (
                p * torch.where(p > 0, s, torch.zeros((), dtype=s.dtype, device=s.device))
            ).sum(-1)
            kk = min(top_k, j1 - j0)
            bv, bi = s.topk(kk, dim=-1)
            mv = torch.cat([tv[..., i0:i1, :], bv], dim=-1)
            mi = torch.cat([ti[..., i0:i1, :], bi + j0 + base], dim=-1)
            best, pick = mv.topk(top_k, dim=-1)
            tv[..., i0:i1, :] = best
            ti[..., i0:i1, :] = mi.gather(-1, pick)
            if cs is not None:
                cs[..., j0:j1] += p.sum(dim=-2)
    return (
        ps.flatten(1, 2),
        tv.flatten(1, 2),
        ti.flatten(1, 2),
        None if cs is None else cs.flatten(1, 2),
    )
