"""The stacked window band on the fused CPU kernel: its backward in large matrix products, and its forward
in single-threaded pieces (:func:`forward_pieces`, so that a core kept busy by another process delays one
piece, not the whole call). The engine calls :func:`backward_calls` and :func:`pooled`.

torch's fused CPU backward runs a window band (``count`` calls of a few query rows against the W − 1 +
rows keys they see, stacked as strided views) at a third of its rate on one long causal call: it splits a
short call's rows into blocks of 32, and every block pays five small matrix products, and it returns a key
gradient per band — (W − 1 + rows) / rows times the size of dK, zero-filled, then folded back. Measured
(1 thread, T = 16384, W = 512, docs/performance.md): 0.20–0.32 of the matmul rate (five products per
visible pair) against 0.64 for its causal backward on the same number of pairs; this module ≈ 0.4.

Here the band's rows are regrouped into chunks of :data:`CHUNK` rows; chunk j sees the L = cols − rows +
CHUNK keys from c0 + j·CHUNK, with the same relative mask for every chunk (a window's structure does not
change along the diagonal). The chunks are taken in ``m = ⌈L / CHUNK⌉`` phases: chunks j ≡ φ (mod m) see
disjoint key ranges, so a group of them is one batched product and its key gradients are added into dK by
one strided add — no per-band copy, no fold. FlashAttention-2's backward (Dao 2023, Algorithm 2) given the
final output and log-sum-exp of the rows (the rows' totals over every call)::

    P = exp(S·scale + tile − ℓ)      dV += Pᵀ dO      dS = P ∘ (dO Vᵀ − δ)      dQ += scale·dS K
    dK += scale·dSᵀ Q                (δ = rowsum(dO ∘ O))

Each (batch, key/value head) is one job (its query heads share dK and dV, one after the other), run on
single-threaded workers (:mod:`.pool`) when there are at least as many jobs as threads, so that a busy core
delays one job rather than every product.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from . import pool
from .fast_exp import exp_
from .plan import Call

__all__ = [
    "CHUNK",
    "GROUP",
    "MIN_CHUNKS",
    "chunks",
    "split",
    "usable",
    "backward",
    "backward_calls",
    "pooled",
    "forward_pieces",
]

CHUNK = 128
"""Query rows per chunk (a multiple of the band's rows)."""

GROUP = 2
"""Chunks per batched product: score tiles of 2 × 128 × (W − 1 + 128) floats stay in a core's L2 cache."""

MIN_CHUNKS = 16
"""Fewer whole chunks than this (a short sequence: T = 1000, W = 512 has 3) are left to the kernel's own
backward, which is faster there than this module's Python loop (measured: 30 vs 37 ms at T = 1000)."""


def _chunk(call: Call) -> int:
    return call.rows * max(1, CHUNK // call.rows)


def split(call: Call) -> tuple[Call, Call | None]:
    """(the whole chunks of a stacked band, the sub-calls left over — or None); the first is computed
    here, the second by the kernel's own backward. ``call.count * call.rows`` must reach one chunk."""
    c = _chunk(call)
    per = c // call.rows
    n = call.count // per
    head = Call(call.r0, c, call.c0, call.cols - call.rows + c, tile=True, count=n, step=c)
    left = call.count - n * per
    if left == 0:
        return head, None
    r0, c0 = call.r0 + n * c, call.c0 + n * c
    return head, Call(r0, call.rows, c0, call.cols, tile=True, count=left, step=call.step if left > 1 else 0)


def chunks(call: Call) -> int:
    """Whole chunks of a stacked band call (0 for any other call)."""
    if not (call.count > 1 and call.tile and call.step == call.rows):
        return 0
    return call.count * call.rows // _chunk(call)


def usable(call: Call) -> bool:
    """Whether :func:`backward` serves this plan call (a stacked band of at least :data:`MIN_CHUNKS`)."""
    return chunks(call) >= MIN_CHUNKS


def backward(
    head: Call,
    tile: torch.Tensor | None,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
) -> None:
    """Add the gradients of the chunks of ``head`` (from :func:`split`) into dq, dk, dv (contiguous
    (B, H, Tq, D) / (B, Hkv, Tk, D) / (B, Hkv, Tk, Dv)). ``tile``: the bias of the first chunk, broadcastable
    to (rows, cols) (−inf hides), the same for every chunk; None when every key of a chunk is visible."""
    b, h, _, _ = q.shape
    hkv = k.shape[1]
    dout = dout.contiguous()
    g = h // hkv
    rows = slice(head.r0, head.r1)
    # ℓ = −inf (a row that sees nothing) becomes +inf: P = exp(s − inf) = 0 there, as in vendor.backward
    delta = (dout[:, :, rows] * out[:, :, rows]).sum(-1)
    lse = lse[:, :, rows].nan_to_num(nan=math.nan, posinf=math.inf, neginf=math.inf)
    bias = None if tile is None else tile.reshape(tile.shape[-2], tile.shape[-1]).to(q.dtype)
    m = -(-head.cols // head.rows)  # phases: chunks j ≡ φ (mod m) see disjoint keys

    def job(bh: tuple[int, int]) -> None:
        bi, hk = bh
        for hq in range(hk * g, hk * g + g):
            _one_head(head, m, bias, scale, dout[bi, hq], q[bi, hq], k[bi, hk], v[bi, hk],
                      lse[bi, hq], delta[bi, hq], dq[bi, hq], dk[bi, hk], dv[bi, hk])  # fmt: skip

    jobs = [(bi, hk) for bi in range(b) for hk in range(hkv)]
    if len(jobs) >= torch.get_num_threads():
        list(pool.run(job, jobs))
    else:
        for j in jobs:
            job(j)


def _strided(t: torch.Tensor, start: int, count: int, step: int, width: int) -> torch.Tensor:
    """Rows [start + i·step, start + i·step + width) of a contiguous (T, X) tensor as (count, width, X)."""
    x = t.shape[-1]
    return t.as_strided((count, width, x), (step * x, x, 1), t.storage_offset() + start * x)


def _one_head(head, m, bias, scale, do, q, k, v, lse, delta, dq, dk, dv) -> None:
    c, cols, n = head.rows, head.cols, head.count
    for phase in range(min(m, n)):
        idx = list(range(phase, n, m))
        for at in range(0, len(idx), GROUP):
            j0, cnt = idx[at], len(idx[at : at + GROUP])
            r = j0 * c  # rows relative to head.r0; keys relative to head.c0
            qg = _strided(q, head.r0 + r, cnt, m * c, c)
            dog = _strided(do, head.r0 + r, cnt, m * c, c)
            kg = _strided(k, head.c0 + r, cnt, m * c, cols)
            vg = _strided(v, head.c0 + r, cnt, m * c, cols)
            lg = lse.as_strided((cnt, c, 1), (m * c, 1, 1), lse.storage_offset() + r)
            dg = delta.as_strided((cnt, c, 1), (m * c, 1, 1), delta.storage_offset() + r)
            kt = kg.transpose(1, 2)
            s = torch.bmm(qg, kt) if bias is None else torch.baddbmm(bias, qg, kt, alpha=scale)
            if bias is None:
                s.mul_(scale)
            p = exp_(s.sub_(lg))
            _strided(dv, head.c0 + r, cnt, m * c, cols).add_(torch.bmm(p.transpose(1, 2), dog))
            ds = torch.bmm(dog, vg.transpose(1, 2)).sub_(dg).mul_(p)
            _strided(dq, head.r0 + r, cnt, m * c, c).add_(torch.bmm(ds, kg), alpha=scale)
            _strided(dk, head.c0 + r, cnt, m * c, cols).add_(torch.bmm(ds.transpose(1, 2), qg), alpha=scale)


# ---------------------------------------------------------------------------------------------------------
# The engine's entry points: the backward's calls, and the forward of a long band in pieces
# ---------------------------------------------------------------------------------------------------------


def backward_calls(prob, dout, q, k, v, out, lse, dq, dk, dv) -> list[Call]:
    """The plan's calls for the per-call backward loop, after the stacked window bands that
    this module serves (vendor kernel on CPU, no mask of any kind, no dropout) have been added into
    dq, dk, dv; what is left of a band (rows short of a whole chunk) stays in the list, and a band too
    short for that module is regrouped into bands of a chunk's rows."""
    vis = prob.vis
    if not (
        prob.kernel == "vendor"
        and q.device.type == "cpu"
        and prob.dropout is None
        and not prob.mask_grad
        and vis.window is not None
        and vis.attn_mask is None
        and vis.mod is None
        and vis.q_doc is None
        and q.is_contiguous()
        and k.is_contiguous()
        and v.is_contiguous()
    ):
        return prob.plan.calls
    calls: list[Call] = []
    for call in prob.plan.calls:
        if not chunks(call):
            calls.append(call)
            continue
        head, rest = split(call)
        if not usable(call):
            # a short band: the kernel's own backward, on bands of a chunk's rows (its backward of 32-row
            # bands returns a key gradient 17× the size of dK at W = 512, and runs 1.6× longer)
            calls += [head] if rest is None else [head, rest]
            continue
        tile = prob.vis.tile(
            head.r0, head.r0 + head.rows, head.c0, head.c0 + head.cols, prob.compute, q.device
        )
        backward(head, tile, dout, q, k, v, out, lse, prob.scale, dq, dk, dv)
        if rest is not None:
            calls.append(rest)
    return calls


POOL_PIECES = 4  # pieces per thread of a stacked call run on the pool's single-threaded workers
POOL_MIN_ENTRIES = 1 << 24  # score entries below which one multi-threaded call costs less (T = 1000)


def pooled(prob, call: Call, q: torch.Tensor) -> bool:
    """Whether a stacked call is split into pieces on :mod:`.pool`'s workers: the vendor kernel on CPU
    splits its rows statically among the threads, so a core kept busy by another process doubles the
    call's time (measured: 2.4× quiet for the window forward, against 1.5× for SDPA's causal kernel);
    single-threaded pieces taken from a queue let the free core do more of them."""
    threads = torch.get_num_threads()
    return (
        prob.kernel == "vendor"
        and q.device.type == "cpu"
        and threads > 1
        and call.count >= POOL_PIECES * threads
        and call.entries() * q.shape[0] * q.shape[1] >= POOL_MIN_ENTRIES
        and not torch.is_grad_enabled()
    )


def forward_pieces(fn, call: Call, qv, kv, vv, out, lse, b: int) -> None:
    """``fn(sub_call, q, k, v) -> (out, lse)`` (the engine's kernel forward) of a stacked call (views
    (B·Hx, count, ...)) in pieces of its sub-calls on the pool, each written into its rows of ``out``
    (B, Hx, Tq, Dv) / ``lse`` (B, Hx, Tq)."""
    n = POOL_PIECES * torch.get_num_threads()
    bounds = [call.count * i // n for i in range(n + 1)]

    def piece(i: int) -> None:
        s0, s1 = bounds[i], bounds[i + 1]
        sub = replace(call, r0=call.r0 + s0 * call.rows, c0=call.c0 + s0 * call.step, count=s1 - s0)
        o, l = fn(sub, qv[:, s0:s1], kv[:, s0:s1], vv[:, s0:s1])
        rows = slice(sub.r0, sub.r1)
        out[:, :, rows] = o.unflatten(0, (b, -1)).flatten(2, 3)
        lse[:, :, rows] = l.unflatten(0, (b, -1)).flatten(2, 3)

    list(pool.run(piece, [i for i in range(n) if bounds[i + 1] > bounds[i]]))
