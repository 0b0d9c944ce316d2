"""Statistics of the attention weights without the n × n matrix: one sweep over the engine's block plan.

Given the final log-sum-exp ℓ of every query row (from the kernel's forward), the weights of a tile are
α = exp(S − ℓ) exactly, so a second sweep over the same calls (skipped blocks stay skipped) gives:

* entropy  H_i = −Σ_j α_ij log α_ij = ℓ_i − Σ_j α_ij s_ij (nats),
* the top-k keys of every query (the largest scores are the largest weights) and their weights,
* column sums Σ_i α_ij: the attention each key receives.

The scores are recomputed with torch ops, tile by tile; the row tiles are independent jobs on
single-threaded workers (:mod:`selfattention.kernels.pool`), so that a core busy with another process
delays one job rather than every op. A hidden key never reaches a statistic, even if it holds NaN/inf
(the bias is applied as a select, as in :func:`selfattention.kernels.exact.scores_tile`).

Why not on the vendor kernel: Σ_j α_ij s_ij = scale · q_i · Σ_j α_ij k_j (the keys as extra value columns
of the output's call) and c_j = exp of the log-sum-exp of the transposed problem with −ℓ folded in as one
more dimension are both exact, but measured at T = 4096 (causal, H = 8, D = 64, same process) they cost
2.04× SDPA's causal forward (the output's call with values [v | k]: the fused CPU kernel wants one head
size, so q and k are padded to 128) and 1.32×, while in the sweep that top-k needs anyway they add an
``exp`` and two sums to each score tile (≈ 25 % of the sweep). See docs/performance.md and
benchmarks/stats_parts.py.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from . import exact, pool
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
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    prob: Problem,
    top_k: int,
    columns: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(entropy (B, H, Tq), top weights (B, H, Tq, k), top indices (B, H, Tq, k), column sums (B, H, Tk))
    for canonical q (B, H, Tq, D), k (B, Hkv, Tk, D) in the compute dtype and the final ``lse``, from
    score tiles."""
    b, h, tq, _ = q.shape
    tk = k.shape[2]
    ent = q.new_zeros((b, h, tq))  # −Σ α log α
    vals = q.new_full((b, h, tq, top_k), -math.inf)  # log α of the best keys so far
    idx = torch.full((b, h, tq, top_k), -1, dtype=torch.int64, device=q.device)
    cols = q.new_zeros((b, h, tk, 1)) if columns else None
    # log α = s − ℓ; a row that sees nothing gets ℓ = +inf, so α = 0 everywhere
    neg_lse = torch.where(
        lse == -math.inf, torch.full((), -math.inf, dtype=lse.dtype, device=lse.device), -lse
    )
    qs = q * prob.scale
    blind = bool((lse == -math.inf).any())  # such rows make every tile's scores −inf
    for call in prob.plan.calls:
        bias = _tile(prob, call, q.device)
        rows = slice(call.r0, call.r1)
        for qv, kv, _, heads in _call_views(call, qs, k, k[..., :0]):
            (nl,) = _stack_rows(call, neg_lse[:, heads, rows])
            e, tv, ti, cs = _sweep_view(qv, kv, nl, bias, call, top_k, columns, blind)
            ent[:, heads, rows] += _unstack(call, e, b)
            merged_v = torch.cat([vals[:, heads, rows], _unstack(call, tv, b)], dim=-1)
            merged_i = torch.cat([idx[:, heads, rows], _unstack(call, ti, b)], dim=-1)
            best_v, pick = _topk(merged_v, top_k)
            vals[:, heads, rows] = best_v
            idx[:, heads, rows] = merged_i.gather(-1, pick)
            if cols is not None:
                _fold(call, cs.unsqueeze(-1), b, cols[:, heads])  # a view: adds into cols
    hidden = vals == -math.inf
    weights = torch.exp(vals).masked_fill(hidden, 0.0)
    return (
        ent.clamp_min(0.0),
        weights,
        idx.masked_fill(hidden, -1),
        None if cols is None else cols.squeeze(-1),
    )


_ROWS, _COLS = 32, 2048  # a score tile of (heads sharing a key) × 32 rows × 2048 keys: few ops, in cache


_GROUP = 16  # top-k of a tile row from the k best of w/16 groups of 16 strided columns


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (values, indices) along the last dim, largest first, of a short last dim: k rounds of
    ``max`` (``torch.topk`` spends ≈ 1.4 µs per row on rows of 32–64 entries on CPU, ``max`` ≈ 20 ns)."""
    if k == 1:
        return x.max(dim=-1, keepdim=True)
    if k > 8 or k >= x.shape[-1]:
        return x.topk(k, dim=-1)
    x = x.clone()
    vals, idx = [], []
    for _ in range(k):
        v, i = x.max(dim=-1, keepdim=True)
        vals.append(v)
        idx.append(i)
        x.scatter_(-1, i, -math.inf)
    return torch.cat(vals, dim=-1), torch.cat(idx, dim=-1)


def _tile_topk(s: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (values, columns) along the last dim of a score tile, largest first.

    A full ``torch.topk`` costs ~2.5× the matmul that made the tile; instead: the columns are split into
    m = w/16 groups (group c holds columns c, c + m, c + 2m, …, so the maximum is one vectorised pass),
    and the k largest scores lie in the k groups with the largest maxima (a score outside them is beaten
    by k group maxima), so only those 16·k candidates are ranked."""
    w = s.shape[-1]
    m = w // _GROUP
    if m < 2 * k:
        return _topk(s, k)
    _, groups = _topk(s[..., : _GROUP * m].unflatten(-1, (_GROUP, m)).amax(-2), k)  # (…, k)
    cand = (groups.unsqueeze(-1) + m * torch.arange(_GROUP, device=s.device)).flatten(-2)  # (…, 16k)
    if w > _GROUP * m:  # the last w mod 16 columns are candidates too
        rest = torch.arange(_GROUP * m, w, device=s.device).expand(*cand.shape[:-1], -1)
        cand = torch.cat([cand, rest], dim=-1)
    v, pick = _topk(s.gather(-1, cand), k)
    return v, cand.gather(-1, pick)


def _sweep_view(qv, kv, nl, bias, call, top_k: int, columns: bool, blind: bool):
    """Statistics of one kernel view: q (B', Hq, R, D) already scaled, k (B', Hk, C, D), −ℓ (B', Hq, R).
    Returns per-row −Σ α log α, top log α and their key positions, and per-head column sums Σ α.

    The row tiles are independent jobs (each writes its own rows; column sums come back per job and are
    added here), run by :func:`selfattention.kernels.pool.run` on one thread each."""
    bq_, hq, rows, d = qv.shape
    hk, ncols = kv.shape[1], kv.shape[2]
    g = hq // hk
    n = bq_ * hk
    finite = bool(torch.isfinite(qv.sum())) and bool(torch.isfinite(kv.sum()))
    ent = qv.new_zeros((n, g, rows))
    tv = qv.new_empty((n, g, rows, top_k))
    ti = torch.empty((n, g, rows, top_k), dtype=torch.int64, device=qv.device)
    cs = qv.new_zeros((n, g, ncols)) if columns else None
    # absolute key position of column 0 of each stacked sub-call (views are (B·Hx, count, ...))
    base = torch.full((n, 1, 1), call.c0, dtype=torch.int64, device=qv.device)
    if call.count > 1:
        base = (call.c0 + call.step * torch.arange(call.count, device=qv.device)).repeat(bq_).view(n, 1, 1)
    view = _View(
        q5=qv.unflatten(1, (hk, g)),  # (B', Hk, G, R, D)
        kt=kv.reshape(n, ncols, d).transpose(1, 2).contiguous(),  # (N, D, C): a plain gemm operand
        nl5=nl.unflatten(1, (hk, g)),  # (B', Hk, G, R)
        bias5=exact._bias5(bias, hk, g),
        causal=call.causal,
        top_k=top_k,
        columns=columns,
        blind=blind,
        finite=finite,
        ent=ent,
        tv=tv,
        ti=ti,
        base=base,
    )
    jobs = list(exact.tiles(rows, ncols, call.causal, _ROWS, _COLS))
    jobs.sort(key=lambda job: -len(job[2]))  # the widest rows first: the threads finish together
    for part in pool.run(lambda job: _row_tile(view, *job), jobs):
        if cs is not None and part is not None:
            cs[:, :, : part.shape[-1]] += part
    return (
        ent.reshape(bq_, hq, rows),
        tv.reshape(bq_, hq, rows, top_k),
        ti.reshape(bq_, hq, rows, top_k),
        None if cs is None else cs.reshape(bq_, hq, ncols),
    )


@dataclass
class _View:
    """What the row-tile jobs of one view share: inputs, flags, and the outputs they write rows of."""

    q5: torch.Tensor
    kt: torch.Tensor
    nl5: torch.Tensor
    bias5: torch.Tensor | None
    causal: bool
    top_k: int
    columns: bool
    blind: bool
    finite: bool
    ent: torch.Tensor
    tv: torch.Tensor
    ti: torch.Tensor
    base: torch.Tensor


_LOCAL = threading.local()


def _scratch(size: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two flat buffers of at least ``size`` elements, kept per thread: a fresh 2 MiB tile per chunk
    costs page faults on every allocation (large blocks come from mmap), more than the ops on it."""
    bufs = getattr(_LOCAL, "bufs", None)
    if bufs is None or bufs[0].numel() < size or bufs[0].dtype != dtype or bufs[0].device != device:
        bufs = (torch.empty(size, dtype=dtype, device=device), torch.empty(size, dtype=dtype, device=device))
        _LOCAL.bufs = bufs
    return bufs


def _row_tile(vw: _View, i0: int, i1: int, chunks: list[tuple[int, int]]) -> torch.Tensor | None:
    """Rows [i0, i1) of a view over their key chunks: writes entropy and top-k of those rows, returns
    their column sums (N, G, last column) or None."""
    bq_, hk, g, _, d = vw.q5.shape
    n, top_k = bq_ * hk, vw.top_k
    r = i1 - i0
    if not chunks:
        vw.tv[:, :, i0:i1], vw.ti[:, :, i0:i1] = -math.inf, -1
        return None
    qb = vw.q5[..., i0:i1, :].reshape(n, g * r, d)
    nlb = vw.nl5[..., i0:i1].reshape(n, g * r, 1)
    cs = vw.q5.new_zeros((n, g, chunks[-1][1])) if vw.columns else None
    ent = vw.ent[:, :, i0:i1]
    cand_v, cand_i = [], []
    size = n * g * r * max(j1 - j0 for j0, j1 in chunks)
    s_buf, p_buf = _scratch(size, qb.dtype, qb.device)
    for j0, j1 in chunks:
        w = j1 - j0
        s = s_buf[: n * g * r * w].view(n, g * r, w)
        torch.bmm(qb, vw.kt[:, :, j0:j1], out=s).add_(nlb)  # log α = s − ℓ, (N, G·r, w)
        masked = vw.blind
        if vw.bias5 is not None:
            rs = slice(i0, i1) if vw.bias5.shape[-2] != 1 else slice(None)
            cs_ = slice(j0, j1) if vw.bias5.shape[-1] != 1 else slice(None)
            blk = vw.bias5[..., rs, cs_]
            s5 = s.view(bq_, hk, g, r, w)
            s5.add_(blk)
            # −inf hides the key even where its score is NaN/inf (NaN + −inf = NaN): a select, not a sum
            s5.masked_fill_(blk == -math.inf, -math.inf)
            masked = True
        if vw.causal and j1 > i0:  # the tile crosses the diagonal
            hide = (
                torch.arange(j0, j1, device=s.device)[None, :]
                > torch.arange(i0, i1, device=s.device)[:, None]
            )
            s.view(n, g, r, w).masked_fill_(hide, -math.inf)
            masked = True
        v_, i_ = _tile_topk(s, min(top_k, w))
        cand_v.append(v_)
        cand_i.append(i_ + j0)
        if vw.finite:
            # exp of a score far below the row's log-sum-exp is a denormal (60× slower on x86) or,
            # for −inf, a slow special case: floor at −87 (exp ≈ 1.6e-38), then make those exactly 0
            s.clamp_min_(-87.0)
            p = torch.exp(s, out=p_buf[: s.numel()].view(s.shape))
            if masked:
                torch.nn.functional.threshold_(p, 1.7e-38, 0.0)
        else:
            p = torch.exp(s, out=p_buf[: s.numel()].view(s.shape))
            if masked:
                s.nan_to_num_(nan=0.0, neginf=0.0)  # α log α = 0 where α = 0
        if cs is not None:
            cs[:, :, j0:j1] += p.view(n, g, r, w).sum(2)
        ent -= p.mul_(s).sum(-1).view(n, g, r)  # p is scratch: α log α in place
    mv, mi = torch.cat(cand_v, dim=-1), torch.cat(cand_i, dim=-1)
    if mv.shape[-1] < top_k:  # fewer keys than k in this view
        pad = top_k - mv.shape[-1]
        mv = torch.cat([mv, mv.new_full((*mv.shape[:-1], pad), -math.inf)], dim=-1)
        mi = torch.cat([mi, mi.new_full((*mi.shape[:-1], pad), -1)], dim=-1)
    best, pick = _topk(mv, top_k)
    vw.tv[:, :, i0:i1] = best.view(n, g, r, top_k)
    vw.ti[:, :, i0:i1] = (mi.gather(-1, pick) + vw.base).view(n, g, r, top_k)
    return cs
