"""The O(n)-memory path: exact attention one block at a time, never forming the (Tq, Tk) score table.

Lecture 003 §4 warns that the score table QKᵀ grows as n²; at T = 65 536 one float32 head needs 16 GiB.
This module computes the same softmax(QKᵀ·scale + mask)V with the online softmax of FlashAttention
(Milakov & Gimelshein 2018; Dao 2023, "FlashAttention-2", Algorithms 1 and 2): queries are taken in
blocks of ``block_q`` rows, keys in chunks of at most ``block_k`` columns, and per query row only a
running maximum, a running sum and the partial output are kept. The autograd function saves the
inputs, the output and the per-row log-sum-exp ℓ (float32 at least) and recomputes the scores in the
backward pass: P = exp(S − ℓ), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − δ) with δ = rowsum(dO ∘ O),
dQ = dS K · scale, dK = dSᵀ Q · scale.

Memory is O((Tq + Tk)·D) plus one score tile of block_q × block_k per (batch · head).

Block skipping: a chunk of keys hidden from every query of a block by a causal mask, a sliding window
(``window=W``: the query at position p sees keys p−W+1 … p), a document mask (``document_ids``) or a
dense bool mask with no True in the chunk is never computed; chunks fully visible are computed without
any mask work. So the time is proportional to the visible area, e.g. for W = 512 at T = 16 384 about
1/20 of the dense work::

    causal, block_q = block_k = 2       window W = 3, block_q = 2
    keys →  0 1 2 3 4 5                 keys →  0 1 2 3 4 5
    q 0-1   ▣ . . . . .                 q 0-1   ▣ . . . . .     ▣ block computed with a mask
    q 2-3   ■ ▣ . . . .                 q 2-3   ▣ ▣ . . . .     ■ block computed, no mask work
    q 4-5   ■ ■ ▣ . . .                 q 4-5   . ▣ ▣ . . .     . never computed

Streaming statistics (:func:`tiled_attention_with_stats`): per-query log-sum-exp, entropy of the
weights, the top-k keys with their weights, and the attention each key receives (column sums), all
without the n × n matrix.

Speed on CPU (see the README's table, ``selfattention bench``): all heads in one ``bmm``, the score
scaling folded into the queries, buffers reused with ``out=``, the row sums fused into the P·V product
(V gets a column of ones), and — after the first chunk of a query block — no max pass at all: the
first chunk's exact row maximum is kept as the reference (``baddbmm`` subtracts it inside the matmul)
and the block is recomputed with the classic online maximum only if a sum overflows or turns NaN.
This is exact (the reference is a true maximum of some scores, so the sums are ≥ 1 and nothing
relevant underflows) and leaves one elementwise pass (``exp_``) per score.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ._validation import check_dropout, check_mask, check_positive_int, check_qkv, resolve_scale
from .functional import _empty_context

__all__ = [
    "AttentionStats",
    "tiled_attention",
    "tiled_attention_with_stats",
    "computed_fraction",
    "DEFAULT_BLOCK_Q",
    "DEFAULT_BLOCK_K",
]

DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 1024

_NEG_INF = -math.inf


# --------------------------------------------------------------------------------------------------
# The plan: which (query block, key chunk) pairs are computed and which need mask work
# --------------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    n: int  # flattened batch·kv-heads
    g: int  # query heads per key/value head (1 without GQA)
    tq: int
    tk: int
    batch: tuple[int, ...]  # output batch dims (heads included)
    scale: float
    is_causal: bool
    window: int | None
    q_doc: torch.Tensor | None  # (..., Tq) integer ids, or None
    k_doc: torch.Tensor | None  # (..., Tk)
    mask: torch.Tensor | None  # user mask, a view of shape (..., Tq, Tk) broadcastable to (*batch, Tq, Tk)
    dropout_p: float
    seed: int
    blocks: list[tuple[int, int, list[tuple[int, int, bool]]]] = field(default_factory=list)
    fast: list[tuple[int, bool]] = field(default_factory=list)  # set by the forward pass
    cache: dict = field(default_factory=dict)  # causal/window block masks by diagonal offset
    device: torch.device | None = None
    mask_src: torch.Tensor | None = None  # the user's mask as ≥ 2-D (what the mask gradient is for)


def _split(lo: int, hi: int, width: int, needs_mask: bool) -> list[tuple[int, int, bool]]:
    return [(j, min(j + width, hi), needs_mask) for j in range(lo, hi, width)]


def _make_blocks(
    tq: int,
    tk: int,
    block_q: int,
    block_k: int,
    is_causal: bool,
    window: int | None,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    dense_mask: bool,
) -> list[tuple[int, int, list[tuple[int, int, bool]]]]:
    """For each query block [i0, i1): the key chunks (j0, j1, needs_mask) that hold a visible key."""
    offset = tk - tq  # query i sits at key position offset + i (bottom-right)
    docs_sorted = False
    if q_doc is not None:
        qd = q_doc.reshape(-1, tq)
        kd = k_doc.reshape(-1, tk)
        # per position: the smallest and the largest id over the batch
        q_lo, q_hi = qd.amin(0), qd.amax(0)
        k_lo, k_hi = kd.amin(0), kd.amax(0)
        docs_sorted = tk <= 1 or bool((k_lo[1:] >= k_hi[:-1]).all())
    blocks = []
    for i0 in range(0, tq, block_q):
        i1 = min(i0 + block_q, tq)
        lo, hi = 0, tk
        flo, fhi = 0, tk  # keys visible to every query of the block (as far as causal/window say)
        if is_causal or window is not None:
            p0, p1 = offset + i0, offset + i1 - 1
            hi = min(tk, p1 + 1)
            fhi = min(tk, p0 + 1)
            if window is not None:
                lo = max(0, p0 - window + 1)
                flo = max(0, p1 - window + 1)
        doc_full = False
        if q_doc is not None:
            b_lo, b_hi = int(q_lo[i0:i1].min()), int(q_hi[i0:i1].max())
            doc_full = b_lo == b_hi
            if docs_sorted and hi > lo:
                # keys whose ids can equal one of the block's: a contiguous range when ids are sorted
                lo = max(lo, int(torch.searchsorted(k_hi.contiguous(), b_lo)))
                hi = min(hi, int(torch.searchsorted(k_lo.contiguous(), b_hi, right=True)))
        if hi <= lo:
            blocks.append((i0, i1, []))
            continue
        if fhi <= flo or fhi <= lo or flo >= hi:
            chunks = _split(lo, hi, block_k, True)
        else:
            flo, fhi = max(flo, lo), min(fhi, hi)
            chunks = _split(lo, flo, block_k, True) + _split(flo, fhi, block_k, False)
            chunks += _split(fhi, hi, block_k, True)
        if q_doc is not None:
            kept = []
            for j0, j1, needs in chunks:
                c_lo, c_hi = int(k_lo[j0:j1].min()), int(k_hi[j0:j1].max())
                if c_hi < b_lo or c_lo > b_hi:
                    continue  # no shared document id: hidden
                full = doc_full and c_lo == c_hi == b_lo
                kept.append((j0, j1, needs or not full))
            chunks = kept
        if dense_mask:
            chunks = [(j0, j1, True) for j0, j1, _ in chunks]
        # a narrow first chunk: its exact row maximum is the reference of the fast path
        blocks.append((i0, i1, chunks))
    return blocks


def _fit(m: torch.Tensor, plan: _Plan, bq: int, w: int) -> torch.Tensor:
    """A mask block (*lead, bq, w) broadcastable to (*batch, bq, w) → broadcastable to (N, G, bq, w)."""
    if m.dim() <= 2 or math.prod(m.shape[:-2]) == 1:
        return m.reshape(m.shape[-2:]) if m.dim() >= 2 else m  # broadcasts against (N, G, bq, w)
    return m.expand(*plan.batch, bq, w).reshape(plan.n, plan.g, bq, w)


def _block_mask(
    plan: _Plan, i0: int, i1: int, j0: int, j1: int, needs_mask: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(visible, bias, hidden) of one block, each broadcastable to (N, G, bq, w) or None.

    ``visible`` bool True = attend; ``bias`` the user's float mask block; ``hidden`` = ~visible when
    cheaply known (causal/window blocks are cached by their diagonal offset: every diagonal block of a
    causal mask is the same small triangle).
    """
    if not needs_mask:
        return None, None, None
    bq, w = i1 - i0, j1 - j0
    structured_only = plan.q_doc is None and plan.mask is None
    key = (j0 - i0 - (plan.tk - plan.tq), bq, w)
    if structured_only and key in plan.cache:
        return plan.cache[key]
    vis = None
    device = plan.device
    if plan.is_causal or plan.window is not None:
        offset = plan.tk - plan.tq
        q_pos = torch.arange(i0 + offset, i1 + offset, device=device)[:, None]
        k_pos = torch.arange(j0, j1, device=device)[None, :]
        vis = k_pos <= q_pos
        if plan.window is not None:
            vis = vis & (k_pos > q_pos - plan.window)
    if structured_only:
        plan.cache[key] = (vis, None, None if vis is None else ~vis)
        return plan.cache[key]
    if plan.q_doc is not None:
        dm = plan.q_doc[..., i0:i1, None] == plan.k_doc[..., None, j0:j1]  # (..., bq, w)
        dm = _fit(dm.unsqueeze(-3), plan, bq, w)
        vis = dm if vis is None else vis & dm
    bias = None
    if plan.mask is not None:
        um = _fit(plan.mask[..., i0:i1, j0:j1], plan, bq, w)
        if um.dtype == torch.bool:
            vis = um if vis is None else vis & um
        else:
            bias = um
    return vis, bias, None


def _apply_mask(
    s: torch.Tensor,
    plan: _Plan,
    vis: torch.Tensor | None,
    bias: torch.Tensor | None,
    hidden: torch.Tensor | None = None,
) -> None:
    """In place on scores s (N, G·bq, w): add the float bias, set hidden entries to -inf."""
    if vis is None and bias is None:
        return
    s4 = s.view(plan.n, plan.g, -1, s.shape[-1])
    if bias is not None:
        s4.add_(bias.to(s.dtype))
        vis_b = bias != _NEG_INF
        vis = vis_b if vis is None else vis & vis_b
        hidden = None
    s4.masked_fill_(~vis if hidden is None else hidden, _NEG_INF)


def _dropout_scale(plan: _Plan, i0: int, j0: int, shape: torch.Size, ref: torch.Tensor) -> torch.Tensor:
    """Keep-mask / (1 - p) of one block, drawn from a generator seeded by (seed, i0, j0).

    Forward and backward visit the same blocks, so they draw the same mask: nothing of size Tq × Tk
    is stored.
    """
    gen = torch.Generator(device=ref.device)
    gen.manual_seed((plan.seed * 1_000_003 + i0 * 65_537 + j0) % (2**63 - 1))
    keep = torch.rand(shape, generator=gen, device=ref.device, dtype=torch.float32) >= plan.dropout_p
    return keep.to(ref.dtype) / (1.0 - plan.dropout_p)


def computed_fraction(
    q_len: int,
    k_len: int,
    *,
    is_causal: bool = False,
    window: int | None = None,
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> float:
    """Fraction of the Tq × Tk score entries the tiled path computes (the rest is skipped).

    Pure integer arithmetic on the block plan (no timing, no randomness); the examples pass the block
    sizes explicitly so that they do not depend on the defaults.

    >>> computed_fraction(4096, 4096)
    1.0
    >>> computed_fraction(4096, 4096, is_causal=True, block_q=256, block_k=1024)  # triangle + diagonal
    0.53125
    >>> f = computed_fraction(16384, 16384, window=512, block_q=256, block_k=1024)
    >>> f, f * 16384 * 16384   # W = 512: about (512 + 256) / 16384 of the table, an exact entry count
    (0.04608345031738281, 12370432.0)
    """
    bq = block_q or DEFAULT_BLOCK_Q
    bk = block_k or DEFAULT_BLOCK_K
    q_doc, k_doc = _split_docs(document_ids, q_len, k_len)
    blocks = _make_blocks(q_len, k_len, bq, bk, is_causal, window, q_doc, k_doc, False)
    done = sum((i1 - i0) * (j1 - j0) for i0, i1, ch in blocks for j0, j1, _ in ch)
    return done / max(1, q_len * k_len)


def _split_docs(
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None, q_len: int, k_len: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if document_ids is None:
        return None, None
    if isinstance(document_ids, tuple | list):
        if len(document_ids) != 2:
            raise ValueError("document_ids must be a tensor (..., T) or a pair (query ids, key ids)")
        q_doc, k_doc = document_ids
    else:
        q_doc = k_doc = document_ids
    for name, ids, n in (("query document ids", q_doc, q_len), ("key document ids", k_doc, k_len)):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"document_ids must hold torch tensors, got {type(ids).__name__}")
        if ids.is_floating_point() or ids.dtype == torch.bool or ids.is_complex():
            raise TypeError(f"{name} must be an integer tensor, got dtype {ids.dtype}")
        if ids.dim() < 1 or ids.shape[-1] != n:
            raise ValueError(
                f"{name} must have shape (..., {n}) (one id per position), got {tuple(ids.shape)}"
                + ("; pass a pair (query ids, key ids) when Tq != Tk" if q_len != k_len else "")
            )
    return q_doc, k_doc


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------


def _range(dtype: torch.dtype) -> tuple[float, float]:
    """Row sums of exp(S) the fast path accepts: far from underflow and from overflow."""
    return (1e-20, 1e30) if dtype != torch.float64 else (1e-280, 1e280)


def _forward_block_fast(
    plan: _Plan,
    qb: torch.Tensor,
    kt: torch.Tensor,
    va: torch.Tensor,
    i0: int,
    i1: int,
    chunks: list[tuple[int, int, bool]],
    sbuf: torch.Tensor,
) -> torch.Tensor:
    """One query block without any running maximum: [Σ exp(S) V | Σ exp(S)], (N, R, Dv + 1).

    The weights are exp(S)/Σ exp(S) whatever the reference, so when every row sum of exp(S) lies well
    inside the float range (checked by the caller once for all rows: finite, in ``_range``), no max
    is needed at all and the only elementwise pass is ``exp_``. Rows out of range (scores above ~69 or
    all below ~−46), NaN/inf and rows with nothing visible send their block to
    :func:`_forward_block_safe`.

    qb (N, R, D) already scaled; kt (N, D, Tk); va (N, Tk, Dv + 1) = [V | 1] (row sums fused into the
    P·V product) without dropout, else V.
    """
    n, r = qb.shape[0], qb.shape[1]
    fused = plan.dropout_p == 0.0
    acc = None
    total = None
    for j0, j1, needs in chunks:
        w = j1 - j0
        s = sbuf[: n * r * w].view(n, r, w)
        vis, bias, hidden = _block_mask(plan, i0, i1, j0, j1, needs)
        torch.bmm(qb, kt[:, :, j0:j1], out=s)
        _apply_mask(s, plan, vis, bias, hidden)
        s.exp_()
        if not fused:
            part = s.sum(dim=-1, keepdim=True)
            total = part if total is None else total.add_(part)
            s.mul_(_dropout_scale(plan, i0, j0, s.shape, s))
        acc = torch.bmm(s, va[:, j0:j1]) if acc is None else acc.baddbmm_(s, va[:, j0:j1])
    return acc if fused else torch.cat([acc, total], dim=-1)


def _guarded_pv(p: torch.Tensor, v: torch.Tensor, vis: torch.Tensor | None, plan: _Plan) -> torch.Tensor:
    """p @ v where non-finite values of v reach only the queries that see them (as the reference)."""
    bad = ~torch.isfinite(v)
    if not bool(bad.any()):
        return p @ v
    clean = p @ torch.where(bad, torch.zeros((), dtype=v.dtype, device=v.device), v)
    honest = p @ v
    n, r, w = p.shape
    if vis is None:
        seen = torch.ones(n, r, w, dtype=v.dtype, device=v.device)
    else:
        seen = vis.expand(n, plan.g, r // plan.g, w).reshape(n, r, w).to(v.dtype)
    touches = (seen @ bad.to(v.dtype)) > 0
    return torch.where(touches, honest, clean)


def _forward_block_safe(
    plan: _Plan,
    qb: torch.Tensor,
    kt: torch.Tensor,
    v: torch.Tensor,
    i0: int,
    i1: int,
    chunks: list[tuple[int, int, bool]],
    stats: _StatsAcc | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query block with the classic online maximum (FlashAttention-2, Algorithm 1).

    Handles NaN/inf in keys and values exactly as the reference does. Returns (out, lse).
    """
    n, r = qb.shape[0], qb.shape[1]
    dv = v.shape[-1]
    m = qb.new_full((n, r, 1), _NEG_INF)
    total = qb.new_zeros((n, r, 1))
    acc = qb.new_zeros((n, r, dv))
    for j0, j1, needs in chunks:
        vis, bias, hidden = _block_mask(plan, i0, i1, j0, j1, needs)
        s = torch.bmm(qb, kt[:, :, j0:j1])
        _apply_mask(s, plan, vis, bias, hidden)
        if bias is not None:  # a -inf in the float mask hides the key too (also inside a causal block)
            keep = bias != _NEG_INF
            vis = keep if vis is None else vis & keep
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_ref = torch.where(m_new == _NEG_INF, torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_ref)  # 0 for the first visible chunk (m = -inf)
        p = torch.exp(s - m_ref)
        if stats is not None:
            stats.update(j0, s, p, alpha, m_ref)
        total = total * alpha + p.sum(dim=-1, keepdim=True)
        if plan.dropout_p > 0.0:
            p = p * _dropout_scale(plan, i0, j0, p.shape, p)
        acc = acc * alpha + _guarded_pv(p, v[:, j0:j1], vis, plan)
        m = m_new
    safe_total = torch.where(total == 0, torch.ones_like(total), total)
    out = acc / safe_total
    m_ref = torch.where(m == _NEG_INF, torch.zeros_like(m), m)
    lse = (m_ref + torch.log(total)).squeeze(-1)
    if stats is not None:
        stats.finish(total, lse)
    return out, lse


def _forward(
    plan: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stats: _StatsAcc | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (N, G, Tq, D), k (N, Tk, D), v (N, Tk, Dv) → out (N, G, Tq, Dv), lse (N, G, Tq).

    Every block first takes the fast path (no running maximum); one check over all rows afterwards
    sends the blocks holding a row out of range to the classic online softmax. With statistics, every
    block takes the classic path (it tracks more than sums).
    """
    n, g, tq = plan.n, plan.g, plan.tq
    dv = v.shape[-1]
    qs = q * plan.scale  # scale folded into the queries: S = (q·scale) kᵀ
    kt = k.transpose(1, 2)  # (N, D, Tk), a view
    redo = [(i0, i1, ch) for i0, i1, ch in plan.blocks if ch]
    sums = q.new_zeros((n, g, tq, dv + 1))  # [Σ exp(S) V | Σ exp(S)] per row
    if stats is None:
        va = torch.cat([v, v.new_ones((*v.shape[:-1], 1))], dim=-1) if plan.dropout_p == 0.0 else v
        widest = max((j1 - j0 for _, _, ch in plan.blocks for j0, j1, _ in ch), default=0)
        rows = max((i1 - i0 for i0, i1, _ in plan.blocks), default=0)
        sbuf = q.new_empty(n * g * rows * widest)
        for i0, i1, chunks in redo:
            qb = qs[:, :, i0:i1].reshape(n, g * (i1 - i0), -1)  # (N, G·bq, D); a view when G == 1
            acc = _forward_block_fast(plan, qb, kt, va, i0, i1, chunks, sbuf)
            sums[:, :, i0:i1] = acc.view(n, g, i1 - i0, dv + 1)
        total = sums[..., -1]
        lo, hi = _range(q.dtype)
        bad_rows = ~(torch.isfinite(sums).all(dim=-1) & (total >= lo) & (total <= hi))  # (N, G, Tq)
        bad_q = bad_rows.flatten(0, 1).any(dim=0)  # (Tq,)
        if bool(bad_q.any()):
            redo = [(i0, i1, ch) for i0, i1, ch in redo if bool(bad_q[i0:i1].any())]
        else:
            redo = []
        out = sums[..., :dv] / torch.where(total == 0, torch.ones_like(total), total).unsqueeze(-1)
        lse = torch.log(total)
    else:
        out = q.new_zeros((n, g, tq, dv))
        lse = q.new_full((n, g, tq), _NEG_INF)
    slow = {i0 for i0, _, _ in redo}
    plan.fast = [(i0, i0 not in slow) for i0, _, ch in plan.blocks if ch]
    for i0, i1, chunks in redo:
        bq = i1 - i0
        qb = qs[:, :, i0:i1].reshape(n, g * bq, -1)
        if stats is not None:
            stats.start(i0, i1)
        o, l = _forward_block_safe(plan, qb, kt, v, i0, i1, chunks, stats)
        out[:, :, i0:i1] = o.view(n, g, bq, dv)
        lse[:, :, i0:i1] = l.view(n, g, bq)
        if stats is not None and stats.column_sums is not None:
            stats.columns(qb, kt, i0, i1, chunks, l)
    # rows of blocks with no visible key at all: zeros and lse = -inf
    for i0, i1, chunks in plan.blocks:
        if not chunks:
            out[:, :, i0:i1] = 0
            lse[:, :, i0:i1] = _NEG_INF
    return out, lse


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------


def _backward(
    plan: _Plan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    mask_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """FlashAttention-2 Algorithm 2 with the query loop outside: dq per block, dk and dv accumulated.

    Blocks whose forward took the fast path (row sums of exp(S) in range) use E = exp(S) without a
    shift and fold the row factor e^(−ℓ) into dO instead (P = E·e^(−ℓ), so Pᵀ dO = Eᵀ (e^(−ℓ) dO) and
    P ∘ (dO Vᵀ − δ) = E ∘ (dO' Vᵀ − δ') with dO' = e^(−ℓ) dO, δ' = e^(−ℓ) δ); δ' rides in the matmul
    as an extra column: [dO' | −δ'] [V | 1]ᵀ = dO' Vᵀ − δ'. Other blocks subtract ℓ inside ``baddbmm``.

    Non-finite values (rare path, found by one-off finiteness checks): a query that sees no key
    (ℓ = −inf) has its NaN/inf zeroed (zero gradient, nothing reaches dK through 0 · NaN); NaN/inf in
    K or V enters the scores S (so a visible NaN key makes its rows' ℓ, P and gradients NaN: NaN in,
    NaN out) but the products dS·K and dO·Vᵀ use K and V with them zeroed, and dS is set to exactly 0
    where the key is hidden, so keys and values a NaN row cannot see get finite gradients.

    With ``mask_grad`` the float mask's gradient (= dS, summed over its broadcast dims) is returned too.
    """
    n, g = plan.n, plan.g
    if not bool(torch.isfinite(q).all()):
        blind = (lse == _NEG_INF).unsqueeze(-1)  # queries that see no key: they take no part
        q = torch.where(blind & ~torch.isfinite(q), torch.zeros((), dtype=q.dtype, device=q.device), q)
    k_raw = k
    bad_kv = not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all()))
    if bad_kv:
        k = torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0)
        v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    qs = q * plan.scale
    kt = k_raw.transpose(1, 2)  # scores from the true keys (hidden entries are overwritten by -inf)
    delta = (dout * out).sum(dim=-1, keepdim=True)  # δ = rowsum(dO ∘ O), (N, G, Tq, 1)
    guard = bad_kv or not bool(torch.isfinite(delta).all())  # NaN rows: keep dS = 0 where hidden
    if guard:  # an output entry that receives no gradient (dO = 0) adds 0 to δ, even if it is NaN
        delta = torch.where(dout == 0, torch.zeros((), dtype=out.dtype, device=out.device), dout * out)
        delta = delta.sum(dim=-1, keepdim=True)
    gm = None
    if mask_grad:
        gm = torch.zeros(plan.mask_src.shape, dtype=q.dtype, device=q.device)
    lse_ref = torch.where(lse == _NEG_INF, torch.zeros_like(lse), lse).unsqueeze(-1)
    va = torch.cat([v, v.new_ones((*v.shape[:-1], 1))], dim=-1)  # [V | 1], (N, Tk, Dv + 1)
    vat = va.transpose(1, 2)
    fast = dict(plan.fast)
    any_slow = plan.dropout_p > 0.0 or not all(fast.values())
    f = torch.exp(-lse_ref)
    doa_fast = torch.cat([dout * f, -delta * f], dim=-1)  # [dO' | −δ'], (N, G, Tq, Dv + 1)
    doa_slow = torch.cat([dout, -delta], dim=-1) if any_slow else None  # [dO | −δ]
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dva = torch.zeros_like(va)  # the last column collects nothing useful
    for i0, i1, chunks in plan.blocks:
        if not chunks:
            continue
        bq, r = i1 - i0, g * (i1 - i0)
        quick = fast.get(i0, False) and plan.dropout_p == 0.0
        qb = qs[:, :, i0:i1].reshape(n, r, -1)  # views when G == 1
        doa = (doa_fast if quick else doa_slow)[:, :, i0:i1].reshape(n, r, -1)
        dqb = dq[:, 0, i0:i1] if g == 1 else q.new_zeros((n, r, q.shape[-1]))
        neg_lse = None if quick else -lse_ref[:, :, i0:i1].reshape(n, r, 1)
        for j0, j1, needs in chunks:
            vis, bias, hidden = _block_mask(plan, i0, i1, j0, j1, needs)
            if quick:
                s = torch.bmm(qb, kt[:, :, j0:j1])  # S
            else:
                s = torch.baddbmm(neg_lse, qb, kt[:, :, j0:j1])  # S − ℓ
            _apply_mask(s, plan, vis, bias, hidden)
            hid = (s == _NEG_INF) if guard else None
            p = s.exp_()  # E = exp(S) or P = exp(S − ℓ); 0 where hidden
            if plan.dropout_p > 0.0:
                z = _dropout_scale(plan, i0, j0, p.shape, p)
                dva[:, j0:j1].baddbmm_((p * z).transpose(1, 2), doa)
                dp = torch.bmm(doa[..., :-1], vat[:, :-1, j0:j1]).mul_(z).add_(doa[..., -1:])
            else:
                dva[:, j0:j1].baddbmm_(p.transpose(1, 2), doa)
                dp = torch.bmm(doa, vat[:, :, j0:j1])  # dO Vᵀ − δ
            ds = dp.mul_(p)  # dS = P ∘ (dO Vᵀ − δ)
            if hid is not None:
                ds.masked_fill_(hid, 0.0)
            if gm is not None:
                _add_mask_grad(gm, ds, plan, i0, i1, j0, j1)
            dqb.baddbmm_(ds, k[:, j0:j1])
            dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), qb)  # qb carries the scale already
        if g != 1:
            dq[:, :, i0:i1] = dqb.view(n, g, bq, -1)
    dq.mul_(plan.scale)
    dmask = None if gm is None else gm.to(plan.mask_src.dtype)
    return dq, dk, dva[..., :-1], dmask


def _add_mask_grad(
    gm: torch.Tensor, ds: torch.Tensor, plan: _Plan, i0: int, i1: int, j0: int, j1: int
) -> None:
    """Add one block of dS (N, G·bq, w) into the mask gradient ``gm`` (mask shape, ≥ 2-D)."""
    rows = slice(i0, i1) if gm.shape[-2] != 1 else slice(0, 1)
    cols = slice(j0, j1) if gm.shape[-1] != 1 else slice(0, 1)
    target = gm[..., rows, cols]
    blk = ds.reshape(*plan.batch, i1 - i0, j1 - j0)  # head h = kv_head · G + g
    target += blk.sum_to_size(target.shape)


class _TiledAttention(torch.autograd.Function):
    """Tiled attention with a recomputing backward; saves q, k, v, out and lse only."""

    @staticmethod
    def forward(ctx, q, k, v, mask, plan):  # type: ignore[override]
        out, lse = _forward(plan, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: a second derivative is coming
            raise RuntimeError(
                "tiled attention is once_differentiable: it supports first-order gradients only, not "
                "create_graph=True / double backward; use backend='reference' for higher-order derivatives"
            )
        return _TiledAttention._backward_once(ctx, dout, _dlse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def _backward_once(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        mask_grad = ctx.needs_input_grad[3]
        dq, dk, dv, dmask = _backward(ctx.plan, q, k, v, out, lse, dout.contiguous(), mask_grad)
        return dq, dk, dv, dmask, None


# --------------------------------------------------------------------------------------------------
# Streaming statistics
# --------------------------------------------------------------------------------------------------


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


class _StatsAcc:
    """Accumulators of the streaming statistics, one query block at a time."""

    def __init__(self, plan: _Plan, top_k: int, columns: bool, dtype: torch.dtype, device: torch.device):
        self.plan, self.top_k = plan, top_k
        n, g, tq, tk = plan.n, plan.g, plan.tq, plan.tk
        self.entropy = torch.zeros(n, g, tq, dtype=dtype, device=device)
        self.top_val = torch.zeros((n, g, tq, top_k), dtype=dtype, device=device)  # 0 where index -1
        self.top_idx = torch.full((n, g, tq, top_k), -1, dtype=torch.int64, device=device)
        self.column_sums = torch.zeros(n, g, tk, dtype=dtype, device=device) if columns else None

    def start(self, i0: int, i1: int) -> None:
        n, r = self.plan.n, self.plan.g * (i1 - i0)
        self.i0, self.i1 = i0, i1
        like = self.entropy
        self.ps = like.new_zeros((n, r, 1))  # running Σ exp(s − m)·s
        self.vals = like.new_full((n, r, self.top_k), _NEG_INF)
        self.idx = torch.full((n, r, self.top_k), -1, dtype=torch.int64, device=like.device)

    def update(self, j0: int, s: torch.Tensor, p: torch.Tensor, alpha: torch.Tensor, m_ref) -> None:
        # entropy: H = ℓ − Σ αⱼ sⱼ, with Σ αⱼ sⱼ = Σ exp(sⱼ − m) sⱼ / Σ exp(sⱼ − m) accumulated online
        s_fin = torch.where(p > 0, s, torch.zeros((), dtype=s.dtype, device=s.device))
        self.ps = self.ps * alpha + (p * s_fin).sum(dim=-1, keepdim=True)
        kk = min(self.top_k, s.shape[-1])
        bv, bi = s.topk(kk, dim=-1)
        vals = torch.cat([self.vals, bv], dim=-1)
        idx = torch.cat([self.idx, bi + j0], dim=-1)
        self.vals, pick = vals.topk(self.top_k, dim=-1)
        self.idx = idx.gather(-1, pick)

    def finish(self, total: torch.Tensor, lse: torch.Tensor) -> None:
        n, g, bq = self.plan.n, self.plan.g, self.i1 - self.i0
        seen = total.squeeze(-1) > 0
        safe = torch.where(total == 0, torch.ones_like(total), total)
        mean_s = (self.ps / safe).squeeze(-1)
        ent = torch.where(seen, lse - mean_s, torch.zeros_like(lse)).clamp_min(0.0)
        self.entropy[:, :, self.i0 : self.i1] = ent.view(n, g, bq)
        lse_ref = torch.where(seen, lse, torch.zeros_like(lse)).unsqueeze(-1)
        weights = torch.exp(self.vals - lse_ref)
        hidden = self.vals == _NEG_INF
        self.top_val[:, :, self.i0 : self.i1] = weights.masked_fill(hidden, 0.0).view(n, g, bq, -1)
        self.top_idx[:, :, self.i0 : self.i1] = self.idx.masked_fill(hidden, -1).view(n, g, bq, -1)

    def columns(self, qb, kt, i0, i1, chunks, lse) -> None:
        """Second sweep over the block's keys with the final ℓ: column sums of P = exp(S − ℓ)."""
        plan = self.plan
        n, g, bq = plan.n, plan.g, i1 - i0
        lse_ref = torch.where(lse == _NEG_INF, torch.zeros_like(lse), lse).unsqueeze(-1)
        for j0, j1, needs in chunks:
            vis, bias, hidden = _block_mask(plan, i0, i1, j0, j1, needs)
            s = torch.baddbmm(-lse_ref, qb, kt[:, :, j0:j1])
            _apply_mask(s, plan, vis, bias, hidden)
            p = s.exp_().nan_to_num_(nan=0.0)
            self.column_sums[:, :, j0:j1] += p.view(n, g, bq, -1).sum(dim=2)


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def _prepare(
    query,
    key,
    value,
    attn_mask,
    dropout_p,
    is_causal,
    scale,
    enable_gqa,
    training,
    window,
    document_ids,
    block_q,
    block_k,
    dropout_seed,
):
    batch, q_len, k_len = check_qkv(query, key, value, enable_gqa=enable_gqa)
    check_mask(attn_mask, batch, q_len, k_len, query.device)
    dropout_p = check_dropout(dropout_p)
    if not training:
        dropout_p = 0.0
    scale = resolve_scale(scale, query.shape[-1])
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if window is not None:
        window = check_positive_int("window", window)
    bq = DEFAULT_BLOCK_Q if block_q is None else check_positive_int("block_q", block_q)
    bk = DEFAULT_BLOCK_K if block_k is None else check_positive_int("block_k", block_k)
    q_doc, k_doc = _split_docs(document_ids, q_len, k_len)
    if q_doc is not None:
        lead = batch[:-1] if query.dim() >= 3 else batch
        for ids in (q_doc, k_doc):
            try:
                ok = tuple(torch.broadcast_shapes(ids.shape[:-1], lead)) == tuple(lead)
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(
                    f"document_ids of shape {tuple(ids.shape)} do not broadcast to the batch dims "
                    f"{tuple(lead)} (heads excluded) + (T,)"
                )
            if ids.device != query.device:
                raise ValueError(f"document_ids are on {ids.device} but query is on {query.device}")

    # work in float32 at least (softmax statistics); float64 stays float64
    acc = torch.promote_types(query.dtype, torch.float32)
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    unbatched = q.dim() == 2
    if unbatched:
        q, k, v = q[None], k[None], v[None]
        batch = torch.Size((1, *batch))
    hq, hk = q.shape[-3], k.shape[-3]
    if hq != hk and hq % hk == 0 and (enable_gqa or hk == 1):
        # grouped-query layout without repeating K/V: (*lead, Hkv, G, Tq, D)
        g = hq // hk
        lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3])
        n = math.prod(lead) * hk
        q4 = q.expand(*lead, hq, q_len, q.shape[-1]).reshape(n, g, q_len, q.shape[-1])
        k3 = k.expand(*lead, hk, k_len, k.shape[-1]).reshape(n, k_len, k.shape[-1])
        v3 = v.expand(*lead, hk, k_len, v.shape[-1]).reshape(n, k_len, v.shape[-1])
    else:
        g = 1
        n = math.prod(batch)
        q4 = q.expand(*batch, q_len, q.shape[-1]).reshape(n, 1, q_len, q.shape[-1])
        k3 = k.expand(*batch, k_len, k.shape[-1]).reshape(n, k_len, k.shape[-1])
        v3 = v.expand(*batch, k_len, v.shape[-1]).reshape(n, k_len, v.shape[-1])
    seed = 0
    if dropout_p > 0.0:
        if dropout_seed is None:
            seed = int(torch.randint(0, 2**62, (), device="cpu"))
        else:
            seed = int(dropout_seed)
    mask_src = mask = attn_mask
    if attn_mask is not None:
        # any mask check_mask accepts, e.g. (Tk,) or (B, 1, 1, Tk): as a stride-0 view (..., Tq, Tk)
        # so that every block can be sliced from it; nothing is materialised
        mask_src = attn_mask.reshape((1,) * max(0, 2 - attn_mask.dim()) + tuple(attn_mask.shape))
        mask = mask_src.expand(*mask_src.shape[:-2], q_len, k_len)
    plan = _Plan(
        n=q4.shape[0],
        g=g,
        tq=q_len,
        tk=k_len,
        batch=tuple(batch),
        scale=scale,
        is_causal=is_causal,
        window=window,
        q_doc=q_doc,
        k_doc=k_doc,
        mask=mask,
        dropout_p=dropout_p,
        seed=seed,
        device=q4.device,
        mask_src=mask_src,
    )
    plan.blocks = _make_blocks(q_len, k_len, bq, bk, is_causal, window, q_doc, k_doc, attn_mask is not None)
    if attn_mask is not None:
        plan.blocks = _skip_masked(plan, mask.detach())
    return plan, q4, k3, v3, batch, unbatched


def _skip_masked(plan: _Plan, attn_mask: torch.Tensor) -> list:
    """Drop chunks in which a dense mask hides every key from every query."""
    blocks = []
    for i0, i1, chunks in plan.blocks:
        kept = []
        for j0, j1, needs in chunks:
            blk = attn_mask[..., i0:i1, j0:j1]
            keep = blk if blk.dtype == torch.bool else blk != _NEG_INF
            if bool(keep.any()):
                kept.append((j0, j1, needs))
        blocks.append((i0, i1, kept))
    return blocks


def _empty_result(query, key, value, batch, q_len, unbatched):
    out = _empty_context(query, key, value, (*batch, q_len, value.shape[-1]))
    return out[0] if unbatched else out


def tiled_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
    training: bool = True,
    window: int | None = None,
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    dropout_seed: int | None = None,
) -> torch.Tensor:
    """Exact attention in O(T) memory: softmax(Q Kᵀ·scale + mask) V, one block at a time, with autograd.

    Same arguments, shapes, semantics and errors as :func:`selfattention.scaled_dot_product_attention`
    (bool mask True = attend, float mask added, bottom-right causal, zeros and zero gradient for a
    query with no visible key, hidden NaN/inf keys never leak into the output), plus structured masks
    that never need a dense (Tq, Tk) tensor and whose hidden blocks are skipped:

    Args:
        window: sliding window W (implies causal): the query at position p sees keys p−W+1 … p. W = 2,
            Tq = Tk = 4::

                1 0 0 0
                1 1 0 0
                0 1 1 0
                0 0 1 1

        document_ids: integer ids (..., T) when Tq == Tk, or a pair ``(query_ids (..., Tq),
            key_ids (..., Tk))``: a query sees only keys with the same id (packed documents). Leading
            dims broadcast against the batch dims without the heads. Ids [0, 0, 1]::

                1 1 0
                1 1 0
                0 0 1

            All of ``attn_mask``, ``is_causal``, ``window`` and ``document_ids`` combine with AND.
        block_q, block_k: query rows per block and most key columns per chunk (defaults
            ``DEFAULT_BLOCK_Q``, ``DEFAULT_BLOCK_K``); any positive ints, they need not divide T.
        dropout_seed: seed of the per-block dropout masks (drawn from torch's global generator when
            None). The mask of block (i, j) comes from a generator seeded by (seed, i, j), so the
            backward pass regenerates it instead of storing it.

    Returns:
        (..., H, Tq, Dv) in the dtype of ``query``; computation in float32 at least.

    Gradients flow to query, key, value and a float ``attn_mask`` that requires grad (a learned bias
    such as ALiBi/T5: its gradient is dS summed over its broadcast dims). The backward pass keeps only
    the per-row log-sum-exp (Dao 2023, "FlashAttention-2", Algorithm 2). First-order gradients only:
    the backward is ``once_differentiable``, so double backward (``create_graph=True``, gradgradcheck)
    raises RuntimeError; use ``backend="reference"`` for higher-order derivatives.

    >>> q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> tiled_attention(q, q, 2 * q, block_q=1, block_k=1)   # lecture 003: (1.340, 0.660), (0.660, 1.340)
    tensor([[1.3395, 0.6605],
            [0.6605, 1.3395]])
    """
    plan, q4, k3, v3, batch, unbatched = _prepare(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        training,
        window,
        document_ids,
        block_q,
        block_k,
        dropout_seed,
    )
    if plan.tq == 0 or plan.tk == 0 or plan.n == 0:
        return _empty_result(query, key, value, batch, plan.tq, unbatched)
    out, _ = _TiledAttention.apply(q4, k3, v3, plan.mask_src, plan)
    out = out.reshape(*batch, plan.tq, v3.shape[-1]).to(query.dtype)
    return out[0] if unbatched else out


def tiled_attention_with_stats(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
    window: int | None = None,
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    top_k: int = 1,
    column_sums: bool = True,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[torch.Tensor, AttentionStats]:
    """Attention output plus :class:`AttentionStats` (log-sum-exp, entropy, top-k keys, column sums).

    Arguments as in :func:`tiled_attention` (no dropout: statistics describe the weights themselves).
    Nothing of size Tq × Tk is formed; the column sums cost one more sweep over the scores
    (``column_sums=False`` skips it). The output is differentiable; the statistics are not (if a
    gradient is needed, the output comes from a second, autograd-tracked pass).

    >>> q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> out, st = tiled_attention_with_stats(q, q, 2 * q, top_k=1)
    >>> st.topk_indices.squeeze(-1), st.topk_weights.squeeze(-1)   # each query looks most at itself
    (tensor([0, 1]), tensor([0.6698, 0.6698]))
    >>> st.column_sums                                         # the two keys share the attention
    tensor([1., 1.])
    """
    top_k = check_positive_int("top_k", top_k)
    plan, q4, k3, v3, batch, unbatched = _prepare(
        query,
        key,
        value,
        attn_mask,
        0.0,
        is_causal,
        scale,
        enable_gqa,
        False,
        window,
        document_ids,
        block_q,
        block_k,
        None,
    )
    acc_dtype = q4.dtype
    stats = _StatsAcc(plan, top_k, column_sums, acc_dtype, q4.device)
    with torch.no_grad():
        if plan.tq == 0 or plan.tk == 0 or plan.n == 0:
            out4 = q4.new_zeros((plan.n, plan.g, plan.tq, v3.shape[-1]))
            lse = q4.new_full((plan.n, plan.g, plan.tq), _NEG_INF)
        else:
            out4, lse = _forward(plan, q4, k3, v3, stats)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, attn_mask)
    )
    if needs_grad:
        out = tiled_attention(
            query,
            key,
            value,
            attn_mask,
            0.0,
            is_causal,
            scale,
            enable_gqa=enable_gqa,
            window=window,
            document_ids=document_ids,
            block_q=block_q,
            block_k=block_k,
        )
    else:
        out = out4.reshape(*batch, plan.tq, v3.shape[-1]).to(query.dtype)
        out = out[0] if unbatched else out

    def shaped(t: torch.Tensor | None, tail: tuple[int, ...]) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.reshape(*batch, *tail)
        return t[0] if unbatched else t

    ks = (plan.tq, top_k)
    result = AttentionStats(
        lse=shaped(lse, (plan.tq,)),
        entropy=shaped(stats.entropy, (plan.tq,)),
        topk_indices=shaped(stats.top_idx, ks),
        topk_weights=shaped(stats.top_val, ks),
        column_sums=shaped(_columns_out(stats, plan), (plan.tk,)) if column_sums else None,
    )
    return out, result


def _columns_out(stats: _StatsAcc, plan: _Plan) -> torch.Tensor:
    """(N, G, Tk) → (N·G, Tk) in output head order (head h = kv_head · G + g)."""
    return stats.column_sums.reshape(plan.n * plan.g, plan.tk)


def _backend(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    *,
    enable_gqa=False,
    training=True,
):
    """The ``"tiled"`` backend: :func:`tiled_attention` with the registry's signature."""
    return tiled_attention(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa=enable_gqa,
        training=training,
    )


def _register() -> None:
    from . import backends

    if "tiled" not in backends._REGISTRY:
        backends.register_backend("tiled", _backend)


_register()
