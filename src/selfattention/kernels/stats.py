"""Statistics of the attention weights without the n × n matrix: one sweep over the engine's block plan.

(Dense and plain causal problems with moderate scores take :mod:`.stats_fused` instead, which forms the
scores once for the output and the statistics together; this sweep serves every other plan.)

Given the final log-sum-exp ℓ of every query row (from the kernel's forward), the weights of a tile are
α = exp(S − ℓ) exactly, so a second sweep over the same calls (skipped blocks stay skipped) gives:

* entropy  H_i = −Σ_j α_ij log α_ij = ℓ_i − Σ_j α_ij s_ij (nats),
* the top-k keys of every query (the largest scores are the largest weights) and their weights,
* column sums Σ_i α_ij: the attention each key receives.

The scores are recomputed with torch ops, tile by tile (:func:`selfattention.kernels.stats_tile.row_tile`):
one ``bmm`` of q with −ℓ as an extra column against kᵀ with a row of ones gives log α directly (on a
tile with a bias, s + bias − ℓ is summed in that order instead, and a problem with a bias also sums each
row's weights: rows where they do not sum to 1 — scores swamped by a −1e9 padding bias — are swept once
more with −log Σ α as one more term); then
``exp`` (:mod:`selfattention.kernels.fast_exp`), one sum over the rows (column sums), one product and one
sum over the keys (entropy), and for top-k one ``amax`` over groups of 16 strided columns, the k best groups being ranked once per span of
chunks. Tiles are ≤ 1 MiB so that these passes run from L2. The denormal guard (clamp, threshold) runs
only on rows where a weight can fall below e^-87 (|q|·max|k| + ℓ bounds s − ℓ from below). The jobs —
a few heads × a row tile — run on single-threaded workers (:mod:`selfattention.kernels.pool`), so that a
core busy with another process delays one job rather than every op, and the job is compiled by
TorchScript so that the workers do not queue on the GIL between ops. A hidden key never reaches a
statistic, even if it holds NaN/inf (the bias is applied as a select, as in
:func:`selfattention.kernels.exact.scores_tile`).

Why not on the vendor kernel: Σ_j α_ij s_ij = scale · q_i · Σ_j α_ij k_j (the keys as extra value columns
of the output's call) and c_j = exp of the log-sum-exp of the transposed problem with −ℓ folded in as one
more dimension are both exact, but measured at T = 4096 (causal, H = 8, D = 64, same process) they cost
2.04× SDPA's causal forward (the output's call with values [v | k]: torch 2.13's fused CPU kernel refuses
a value head size other than the query's — "Q/K/V should have the same head size" — so q and k are
padded to 128) and 1.32×, while the sweep's element-wise passes cost ≈ 0.4 of its ``bmm``. See
docs/performance.md and benchmarks/stats_parts.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import call_ops, exact, pool
from .engine import Problem
from .stats_tile import compiled, topk_rounds

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
    # log α = s − ℓ; a row that sees nothing gets ℓ = +inf, so α = 0 everywhere
    neg_lse = torch.where(
        lse == -math.inf, torch.full((), -math.inf, dtype=lse.dtype, device=lse.device), -lse
    )
    blind = bool((lse == -math.inf).any())  # such rows make every tile's scores −inf
    biased = any(call.tile for call in prob.plan.calls)
    # a large ℓ is itself only known to ulp(ℓ) (scores of 10⁶: weights off by 30 %): such problems sum each
    # row's weights as a biased one does, and rows that do not sum to 1 are swept again (below)
    seen_lse = lse[torch.isfinite(lse)]
    big = seen_lse.numel() > 0 and float(seen_lse.abs().amax()) * torch.finfo(lse.dtype).eps > 1e-5
    corr = q.new_zeros((b, h, tq))
    qs = q * prob.scale
    # with a large ℓ every term is added after the score (s, then − ℓ, then a correction): the gemm's −ℓ
    # column rounds s − ℓ to ulp(s) and −ℓ + corr to ulp(ℓ) (two tied keys at 2²⁶: log 2 vanished, weight 1
    # each)
    ent, vals, idx, cols, zsum = _pass(qs, k, neg_lse, corr, prob, top_k, columns, blind, biased or big, big)
    if zsum is not None:
        # A bias of large finite values (−1e9, finfo.min: transformers' padding rows) swamps the scores: ℓ
        # itself is then only known to ulp(ℓ), and exp(s + bias − ℓ) no longer sums to 1 (a row masked
        # everywhere with −1e9 gets weight 1 on every key in float32). Σ_j α_ij is exactly 1 otherwise: where
        # it is not, one more sweep subtracts log Σ_j α_ij as a separate term, after s + bias − ℓ.
        # Scores of 10⁹ and more: ℓ is off by more than exp's range (ulp(ℓ) ≥ 64), so every weight of a
        # row under- or overflowed (Σ α = 0 or inf) and no sum can say by how much. Such rows take ℓ = their
        # largest score instead, every term added after the score: the top weight is exp(s − s) = 1 exactly,
        # and the rows are summed once more.
        lost = torch.isfinite(lse) & ~((zsum > 0) & torch.isfinite(zsum))
        relost = bool(lost.any())
        if relost:
            zero = torch.zeros((), dtype=neg_lse.dtype, device=neg_lse.device)
            top = _pass(qs, k, torch.where(lost, zero, neg_lse), corr, prob, 1, False, blind, False, True)[1]
            lost = lost & torch.isfinite(top[..., 0])
            neg_lse = torch.where(lost, -top[..., 0], neg_lse)
            zsum = _pass(qs, k, neg_lse, corr, prob, 0, False, blind, True, True)[4]
        seen = zsum > 0
        off = torch.where(seen, zsum, torch.ones((), dtype=zsum.dtype, device=zsum.device)).log()
        if relost or bool((off.abs() > math.sqrt(torch.finfo(q.dtype).eps)).any()):
            ent, vals, idx, cols, _ = _pass(
                qs, k, neg_lse, -off, prob, top_k, columns, blind, False, big or relost
            )
    hidden = vals == -math.inf
    # below the floor a weight is 0, as in the column sums and the entropy (exp would give a denormal)
    weights = torch.exp(vals).masked_fill(vals < _floor(vals.dtype), 0.0)
    return (
        ent.clamp_min(0.0),
        weights,
        idx.masked_fill(hidden, -1),
        None if cols is None else cols.squeeze(-1),
    )


def _pass(
    qs, k, neg_lse, corr, prob: Problem, top_k: int, columns: bool, blind: bool, sums: bool, separate=False
):
    """One sweep over the plan: (−Σ α log α, top log α, their keys, column sums (B, H, Tk, 1) or None,
    row sums Σ α or None) with log α = s + bias − ℓ + ``corr`` (``separate``: added in that order even
    without a bias, instead of −ℓ + corr as one more column of the gemm)."""
    b, h, tq, _ = qs.shape
    tk = k.shape[2]
    ent = qs.new_zeros((b, h, tq))  # −Σ α log α
    vals = qs.new_full((b, h, tq, top_k), -math.inf)  # log α of the best keys so far
    idx = torch.full((b, h, tq, top_k), -1, dtype=torch.int64, device=qs.device)
    cols = qs.new_zeros((b, h, tk, 1)) if columns else None
    zsum = qs.new_zeros((b, h, tq)) if sums else None
    for call in prob.plan.calls:
        bias = call_ops.tile(prob, call, qs.device)
        rows = slice(call.r0, call.r1)
        for qv, kv, _, heads in call_ops.call_views(call, qs, k, k[..., :0]):
            nl, cr = call_ops.stack_rows(call, neg_lse[:, heads, rows], corr[:, heads, rows])
            if bias is None and separate:
                bias = torch.zeros((1, 1, 1, 1), dtype=qs.dtype, device=qs.device)
            e, tv, ti, cs, zs = _sweep_view(qv, kv, nl, cr, bias, call, top_k, columns, blind, sums)
            ent[:, heads, rows] += call_ops.unstack(call, e, b)
            if zsum is not None:
                zsum[:, heads, rows] += call_ops.unstack(call, zs, b)
            if top_k:
                merged_v = torch.cat([vals[:, heads, rows], call_ops.unstack(call, tv, b)], dim=-1)
                merged_i = torch.cat([idx[:, heads, rows], call_ops.unstack(call, ti, b)], dim=-1)
                best_v, pick = topk_rounds(merged_v, top_k)
                vals[:, heads, rows] = best_v
                idx[:, heads, rows] = merged_i.gather(-1, pick)
            if cols is not None:
                call_ops.fold(call, cs.unsqueeze(-1), b, cols[:, heads])  # a view: adds into cols
    return ent, vals, idx, cols, zsum


_ROWS, _COLS, _TILE = 64, 1024, 1 << 18  # score tiles of ≤ 64 rows × ≤ 1024 keys × heads, ≤ 1 MiB: in L2
_SPAN = 8  # chunks whose score tiles are kept for one top-k choice: ≤ 8 MiB of scratch per worker
# _COLS must be a multiple of the top-k group size (16): only a row's last chunk may have a remainder


def _sweep_view(qv, kv, nl, cr, bias, call, top_k: int, columns: bool, blind: bool, sums: bool):
    """Statistics of one kernel view: q (B', Hq, R, D) already scaled, k (B', Hk, C, D), −ℓ and the
    correction (B', Hq, R). Returns per-row −Σ α log α, top log α and their key positions, per-head column
    sums Σ α, and (``sums``) per-row sums Σ α.

    The jobs — a few heads × a row tile, over its key chunks (:func:`selfattention.kernels.stats_tile.row_tile`)
    — are independent (each writes its own rows; column sums come back per job and are added here), run
    by :func:`selfattention.kernels.pool.run` on one thread each. Tiles are kept small enough to stay in a
    core's L2 cache: the element-wise passes over a tile then cost a third of what they cost from memory."""
    bq_, hq, rows, d = qv.shape
    hk, ncols = kv.shape[1], kv.shape[2]
    g = hq // hk
    finite = bool(torch.isfinite(qv.sum())) and bool(torch.isfinite(kv.sum()))
    ent = qv.new_zeros((bq_, hk, g, rows))
    tv = qv.new_empty((bq_, hk, g, rows, top_k))
    ti = torch.empty((bq_, hk, g, rows, top_k), dtype=torch.int64, device=qv.device)
    cs = qv.new_zeros((bq_, hk, g, ncols)) if columns else None
    zs = qv.new_zeros((bq_, hk, g, rows)) if sums else None
    # absolute key position of column 0 of each stacked sub-call (views are (B·Hx, count, ...))
    base = torch.full((bq_, hk, 1, 1, 1), call.c0, dtype=torch.int64, device=qv.device)
    if call.count > 1:
        base = (call.c0 + call.step * torch.arange(call.count, device=qv.device)).repeat(bq_)
        base = base.view(bq_, hk, 1, 1, 1)
    # −ℓ rides along as one more column of q against a column of ones in k: the gemm gives s − ℓ at once.
    # Not with a bias: s + bias − ℓ is then summed in that order (a bias of −1e9 and ℓ ≈ −1e9 cancel only
    # after the bias is added), and the correction is one more term, after them
    nl5 = None
    if bias is None:
        q5 = torch.cat([qv, (nl + cr).unsqueeze(-1)], dim=-1)
    else:
        q5 = torch.cat([qv, torch.zeros_like(nl).unsqueeze(-1)], dim=-1)
        nl5 = torch.stack([nl, cr], dim=-1).unflatten(1, (hk, g))  # (B', Hk, G, R, 2)
    q5 = q5.unflatten(1, (hk, g))  # (B', Hk, G, R, D + 1)
    kt = torch.cat([kv, kv.new_ones((bq_, hk, ncols, 1))], dim=-1).transpose(-1, -2).contiguous()
    floor = _floor(qv.dtype)
    safe = None
    if finite and bias is None and not blind:
        # s − ℓ ≥ −(|q|·max|k| + ℓ): rows where that stays above the floor cannot give a denormal weight
        reach = qv.norm(dim=-1) * kv.norm(dim=-1).amax() - (nl + cr)  # (B', Hq, R)
        safe = (reach < -floor - 1.0).unflatten(1, (hk, g))
    bias5 = exact.bias_5d(bias, hk, g)
    above = _above_diagonal(qv.device)
    assert _COLS % 16 == 0, "stats._COLS must be a multiple of 16"
    nb = max(1, min(hk, _TILE // (g * _ROWS * min(_COLS, ncols))))  # key heads per job
    jobs = [
        (bi, h0, min(hk, h0 + nb), *tile)
        for tile in exact.tiles(rows, ncols, call.causal, _ROWS, _COLS)
        for bi in range(bq_)
        for h0 in range(0, hk, nb)
    ]
    jobs.sort(key=lambda job: -job[-1][-1][1] if job[-1] else 0)  # the widest rows first
    fn = compiled()

    def run(job):
        bi, h0, h1, i0, i1, chunks = job
        n_rows = (h1 - h0) * g * (i1 - i0)
        wmax = max((j1 - j0 for j0, j1 in chunks), default=0)
        span = min(_SPAN, len(chunks)) if top_k else 1
        tile = n_rows * wmax
        s_buf, p_buf, c_buf = pool.scratch("stats", (max(span, 1) * tile, tile, tile), qv.dtype, qv.device)
        return fn(
            q5, kt, bias5, nl5, safe, ent, zs, tv, ti, base, above, s_buf, p_buf, c_buf,
            bi, h0, h1, i0, i1, chunks, call.causal, top_k, columns, blind, finite, floor, max(span, 1),
        )  # fmt: skip

    for (bi, h0, h1, *_), part in zip(jobs, pool.run(run, jobs), strict=True):
        if cs is not None and part is not None:
            cs[bi, h0:h1, :, : part.shape[-1]] += part
    return (
        ent.reshape(bq_, hq, rows),
        tv.reshape(bq_, hq, rows, top_k),
        ti.reshape(bq_, hq, rows, top_k),
        None if cs is None else cs.reshape(bq_, hq, ncols),
        None if zs is None else zs.reshape(bq_, hq, rows),
    )


def _floor(dtype: torch.dtype) -> float:
    """The lowest log-weight kept: below it exp gives a denormal (60× slower on x86), so such weights are 0."""
    return float(math.ceil(math.log(torch.finfo(dtype).tiny)))


_ABOVE: dict[torch.device, torch.Tensor] = {}


def _above_diagonal(device: torch.device) -> torch.Tensor:
    """Bool (≥ _ROWS, ≥ _ROWS): True above the diagonal (a causal square's hidden keys)."""
    t = _ABOVE.get(device)
    if t is None or t.shape[0] < _ROWS:
        t = _ABOVE[device] = torch.ones((_ROWS, _ROWS), dtype=torch.bool, device=device).triu(1)
    return t
