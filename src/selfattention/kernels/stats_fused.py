"""Output and statistics in one sweep, for the common case: one row tile's whole score row at a time.

:func:`selfattention.kernels.stats.sweep` needs the log-sum-exp ℓ from the kernel's forward and then
computes every score a second time. For dense attention and plain causal self-attention with finite,
moderate inputs on CPU, this module computes the output too, from the same scores, so the scores are
formed once: per (batch, key/value head, 64 query rows of its G query heads), with s the base-2 scores
(q·scale·log₂e against k)::

    m = max_j s_j     p_j = 2^(s_j − m)     l = Σ_j p_j     out = (p V) / l     ℓ = (m + log₂ l)·ln 2
    entropy = ln 2 · (log₂ l − Σ_j p_j (s_j − m) / l)     column sums += Σ_rows p_j / l
    top-k: the k largest s_j (groups of 16 strided columns first, as in the sweep), weight p_j / l

— two matrix products per score (as in any attention kernel) instead of three, and ``exp2`` of scores that
are base-2 from the product (4× faster than ``exp`` on CPU, see :mod:`.fast_exp`). The row tile's scores
are kept whole (G·64 rows × the keys they see; per-thread buffers, :func:`.pool.scratch`), so the path is taken only while that stays ≤ :data:`MAX_ROW_TILE` elements (T ≤ 16384 for G = 1), and only
where no weight can fall below float's smallest normal (|s − m| ≤ 2·max|q|·max|k|·|scale|·log₂e, plus
log₂ Tk, under 125): every weight is then a normal float, so nothing needs the sweep's clamps. Any other
problem (a mask, a window, a bias, NaN/inf, huge scores, CUDA) gets ``None`` and takes the general route.

Source: lecture 003's softmax(Q Kᵀ/√d_k) V written out per row; the statistics as in :mod:`.stats`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from . import pool
from .stats_tile import compiled, row_topk

if TYPE_CHECKING:
    from .engine import Problem

__all__ = ["MAX_ROW_TILE", "ROWS", "attention_with_stats"]

ROWS = 64
"""Query rows per job (per query head)."""

MAX_ROW_TILE = 1 << 20
"""Most score elements a job keeps (4 MiB of float32 per worker, twice: scores and weights)."""

_HIDDEN = -1e30  # a hidden key's base-2 score: 2^(−1e30 − m) = 0 and 0 · (−1e30) = 0 (−inf would give NaN)
_LOG2E, _LN2 = 1.0 / math.log(2.0), math.log(2.0)


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prob: Problem) -> bool:
    """Whether :func:`attention_with_stats` takes this problem (canonical q (B, H, Tq, D), k, v)."""
    calls = prob.plan.calls
    if q.device.type != "cpu" or prob.dropout is not None or len(calls) != 1:
        return False
    call = calls[0]
    b, h, tq, _ = q.shape
    tk = k.shape[2]
    if call.count != 1 or call.tile or (call.r0, call.rows, call.c0, call.cols) != (0, tq, 0, tk):
        return False
    if call.causal and tq != tk:
        return False
    g = h // k.shape[1]
    if g * ROWS * tk > MAX_ROW_TILE:
        return False
    qmax, kmax = q.norm(dim=-1).amax(), k.norm(dim=-1).amax()
    if not (bool(torch.isfinite(qmax)) and bool(torch.isfinite(kmax)) and bool(torch.isfinite(v.sum()))):
        return False
    reach = 2.0 * float(qmax) * float(kmax) * abs(prob.scale) * _LOG2E + math.log2(max(tk, 1))
    return reach < 125.0


def attention_with_stats(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prob: Problem, top_k: int, columns: bool
) -> tuple[torch.Tensor, ...] | None:
    """(out (B, H, Tq, Dv), lse, entropy (B, H, Tq), top weights, top indices (B, H, Tq, k), column sums
    (B, H, Tk) or None) for canonical float32/float64 q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk,
    Dv) — or None where the problem is not :func:`eligible`."""
    if not eligible(q, k, v, prob):
        return None
    b, h, tq, _ = q.shape
    hk, tk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hk
    causal = prob.plan.calls[0].causal
    qs = (q * (prob.scale * _LOG2E)).unflatten(1, (hk, g))  # (B, Hk, G, Tq, D) base-2 scores against k
    kt = k.transpose(-1, -2)  # (B, Hk, D, Tk), a view
    out = q.new_empty((b, hk, g, tq, dv))
    lse = q.new_empty((b, hk, g, tq))
    ent = q.new_empty((b, hk, g, tq))
    tw = q.new_empty((b, hk, g, tq, top_k))
    ti = torch.empty((b, hk, g, tq, top_k), dtype=torch.int64, device=q.device)
    cs = q.new_zeros((b, hk, g, tk)) if columns else None
    topk_of_rows = compiled(row_topk)
    above = torch.ones((ROWS, ROWS), dtype=torch.bool, device=q.device).triu(1)
    # a job: batch row bi, key/value heads [h0, h1), query rows [i0, i1) of their G query heads; a few heads
    # at a time so that each op covers ≥ 256 rows (a job is ~40 ops; per-op overhead is then negligible)
    nh = max(1, min(hk, MAX_ROW_TILE // (g * ROWS * tk)))
    jobs = [
        (bi, h0, min(hk, h0 + nh), i0, min(tq, i0 + ROWS))
        for i0 in range(0, tq, ROWS)
        for bi in range(b)
        for h0 in range(0, hk, nh)
    ]
    if causal:
        jobs.reverse()  # the longest rows first

    def run(job):
        bi, h0, h1, i0, i1 = job
        n, r = h1 - h0, i1 - i0
        w, rows = (i1 if causal else tk), n * g * r
        s_buf, p_buf = pool.scratch("stats_fused", (rows * w, rows * w), q.dtype, q.device)
        qb = qs[bi, h0:h1, :, i0:i1].reshape(n, g * r, -1)
        s = torch.bmm(qb, kt[bi, h0:h1, :, :w], out=s_buf[: rows * w].view(n, g * r, w))
        if causal:  # keys i0 … i1 − 1 form the square on the diagonal
            s.view(n, g, r, w)[..., i0:].masked_fill_(above[:r, :r], _HIDDEN)
        m = s.amax(dim=-1, keepdim=True)  # (n, G·r, 1)
        s.sub_(m)
        p = torch.exp2(s, out=p_buf[: rows * w].view(n, g * r, w))  # base 2 already: no product before
        total = p.sum(dim=-1, keepdim=True)  # ≥ 1: the maximum contributes 2⁰
        inv = total.reciprocal()
        o = torch.bmm(p, v[bi, h0:h1, :w]).mul_(inv)
        out[bi, h0:h1, :, i0:i1] = o.view(n, g, r, dv)
        log_total = total.log2()
        lse[bi, h0:h1, :, i0:i1] = ((m + log_total) * _LN2).view(n, g, r)
        ps = torch.linalg.vecdot(p, s).unsqueeze(-1)  # Σ p (s − m)
        ent[bi, h0:h1, :, i0:i1] = ((log_total - ps * inv) * _LN2).clamp_min(0.0).view(n, g, r)
        if top_k:  # scripted: its ~30 small ops run without the GIL
            vals, cols = topk_of_rows(s_buf, rows, w, top_k, 2 * _HIDDEN)
            hidden = vals < _HIDDEN / 2
            wts = torch.exp2(vals) * inv.view(rows, 1)
            tw[bi, h0:h1, :, i0:i1] = wts.masked_fill(hidden, 0.0).view(n, g, r, top_k)
            ti[bi, h0:h1, :, i0:i1] = cols.masked_fill(hidden, -1).view(n, g, r, top_k)
        if cs is None:
            return None
        # Σ_rows p / l per query head: (n·G, 1, r) @ (n·G, r, w)
        return torch.bmm(inv.view(n * g, 1, r), p.view(n * g, r, w)).view(n, g, w)

    for (bi, h0, h1, _, _), part in zip(jobs, pool.run(run, jobs), strict=True):
        if part is not None:
            cs[bi, h0:h1, :, : part.shape[-1]] += part
    return (
        out.view(b, h, tq, dv),
        lse.view(b, h, tq),
        ent.view(b, h, tq),
        tw.view(b, h, tq, top_k),
        ti.view(b, h, tq, top_k),
        None if cs is None else cs.view(b, h, tk),
    )
