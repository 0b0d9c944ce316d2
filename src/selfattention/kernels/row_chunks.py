"""A plan of many calls (blocks classified by a mask_mod or a dense mask) in chunks of query rows: the
forward's calls one after another with the log-sum-exp merge, and, on CPU with several threads, the chunks
as independent jobs on :mod:`.pool`'s single-threaded workers, forward and backward.

Why chunks on the pool: on CPU every torch op is a parallel region that ends when its last thread does. A
plan of a mask_mod at T = 4096 makes ~100 kernel calls, tiles and merges per forward; when another process
keeps one of the two cores busy, each of those regions waits for a time slice of that core (measured: a
sliding window given as a plain ``mask_mod`` at T = 4096 took 2.2× SDPA's time with the same dense mask on
a loaded machine, every op a stall), where SDPA is one region. A chunk of rows is independent of the
others in the forward (its calls see the same rows: their merge stays inside the chunk), so a worker
computes its chunk alone and a busy core delays one chunk while the other worker takes the next. In the
backward a chunk's query gradient is its own; key and value gradients are summed over the chunks, into one
accumulator per worker (FlashAttention-2's backward, Dao 2023, Algorithm 2: each call's share comes from
the final output and log-sum-exp of its rows).

Only the vendor kernel's calls are chunked (the exact kernel's dropout is replayed per call origin), and
only calls that can be cut at any row (no kernel-causal squares, no stacked bands): the generic plan.
"""

from __future__ import annotations

import math
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from . import band, call_ops, pool, vendor
from .merge import merge_into
from .plan import Call

if TYPE_CHECKING:
    from .engine import Problem

__all__ = ["run_calls", "chunked", "forward_chunks", "backward_chunks", "MIN_ENTRIES", "PIECES"]

PIECES = 4
"""Row chunks per thread: enough for the free worker to take over a busy one's share."""

MIN_ENTRIES = 1 << 22
"""Score entries (times B·H) below which one multi-threaded call per block costs less than the pool."""


def runs_of(flags: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of the runs of True in a 1-D bool tensor."""
    if not bool(flags.any()):
        return []
    f = flags.to(torch.int8)
    edges = torch.diff(f, prepend=f.new_zeros(1), append=f.new_zeros(1)).nonzero().flatten().tolist()
    return list(zip(edges[::2], edges[1::2], strict=True))


def run_calls(
    prob: Problem,
    calls: list[Call],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    lo: int,
    hi: int,
) -> None:
    """The forward of ``calls`` (all inside query rows [lo, hi)) into ``out`` (B, H, Tq, Dv) and ``lse``
    (B, H, Tq): each row written by its first call and merged by log-sum-exp with the later ones; rows of
    [lo, hi) that no call covers see no key (0 and −inf)."""
    b = q.shape[0]
    touched = torch.zeros(hi - lo, dtype=torch.bool)
    for call in calls:
        bias = call_ops.tile(prob, call, q.device)
        rows = slice(call.r0, call.r1)
        local = touched[call.r0 - lo : call.r1 - lo]
        merge = bool(local.any())
        if merge and not bool(local.all()):  # rows no earlier call wrote start as "sees nothing"
            for r0, r1 in runs_of(~local):
                out[:, :, call.r0 + r0 : call.r0 + r1] = 0
                lse[:, :, call.r0 + r0 : call.r0 + r1] = -math.inf
        for qv, kv, vv, heads in call_ops.call_views(call, q, k, v):
            if not merge and band.pooled(prob, call, q):
                fn = lambda sub, *views, bias=bias: call_ops.kernel_forward(prob, sub, *views, bias)  # noqa: E731
                band.forward_pieces(fn, call, qv, kv, vv, out[:, heads], lse[:, heads], b)
                continue
            o, l = call_ops.kernel_forward(prob, call, qv, kv, vv, bias)
            o, l = call_ops.unstack(call, o, b), call_ops.unstack(call, l, b)
            if merge:
                merge_into(out[:, heads, rows], lse[:, heads, rows], o, l)
            else:
                out[:, heads, rows] = o
                lse[:, heads, rows] = l
        local[:] = True
    for r0, r1 in runs_of(~touched):  # rows that see no key: 0 and −inf
        out[:, :, lo + r0 : lo + r1] = 0
        lse[:, :, lo + r0 : lo + r1] = -math.inf


def chunked(prob: Problem, q: torch.Tensor) -> list[tuple[int, int]] | None:
    """The row chunks [lo, hi) of the plan's calls on the pool, or None where it runs in one thread's
    order: not CPU, one thread, under ``torch.compile``, a kernel other than the vendor's, calls that cannot
    be cut at any row, too little work, or too few row blocks."""
    threads = torch.get_num_threads()
    calls = prob.plan.calls
    if (
        threads <= 1
        or prob.kernel != "vendor"
        or q.device.type != "cpu"
        or torch.compiler.is_compiling()
        or len(calls) < 2
        or any(c.count != 1 or c.causal for c in calls)
        or prob.plan.entries() * q.shape[0] * q.shape[1] < MIN_ENTRIES
    ):
        return None
    tq, bq = q.shape[2], prob.plan.block_q
    blocks = -(-tq // bq)
    n = min(blocks, PIECES * threads)
    if n < 2 * threads:
        return None
    # cut at row blocks into chunks of about equal work (a causal-like plan's last rows see the most keys:
    # equal row counts left one worker 10 of 16 parts of the work), heaviest first so that the workers
    # finish together
    work = [0] * blocks
    for c in calls:
        for blk in range(c.r0 // bq, -(-c.r1 // bq)):
            work[blk] += (min(c.r1, (blk + 1) * bq) - max(c.r0, blk * bq)) * c.cols
    total, bounds, acc = sum(work), [0], 0
    for blk, w in enumerate(work[:-1]):
        acc += w
        if acc * n >= total * len(bounds) and len(bounds) < n:
            bounds.append((blk + 1) * bq)
    bounds.append(tq)
    chunks = [(a, z) for a, z in zip(bounds, bounds[1:], strict=False) if z > a]
    weight = {ch: sum(work[ch[0] // bq : -(-ch[1] // bq)]) for ch in chunks}
    return sorted(chunks, key=lambda ch: -weight[ch])


def _pieces(calls: list[Call], lo: int, hi: int) -> list[Call]:
    """The calls' parts on query rows [lo, hi) (a call of the generic plan can be cut at any row)."""
    out = []
    for c in calls:
        r0, r1 = max(c.r0, lo), min(c.r1, hi)
        if r1 > r0:
            out.append(replace(c, r0=r0, rows=r1 - r0))
    return out


def forward_chunks(
    prob: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`run_calls` for every chunk of :func:`chunked`, one job per chunk on the pool."""
    b, h, tq, _ = q.shape
    out = q.new_empty((b, h, tq, v.shape[-1]))
    lse = q.new_empty((b, h, tq))
    calls = prob.plan.calls

    def job(chunk: tuple[int, int]) -> None:
        lo, hi = chunk
        run_calls(prob, _pieces(calls, lo, hi), q, k, v, out, lse, lo, hi)

    list(pool.run(job, chunks))
    return out, lse


def backward_chunks(
    prob: Problem,
    calls: list[Call],
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    chunks: list[tuple[int, int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the vendor kernel's ``calls`` (count 1, no kernel-causal squares), one job per row
    chunk on the pool; dk and dv are summed from one accumulator per worker."""
    dq = torch.zeros_like(q)
    acc: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    lock = threading.Lock()

    def job(chunk: tuple[int, int]) -> None:
        me = threading.get_ident()
        with lock:
            if me not in acc:
                acc[me] = (torch.zeros_like(k), torch.zeros_like(v))
        dk, dv = acc[me]
        lo, hi = chunk
        for call in _pieces(calls, lo, hi):
            bias = call_ops.tile(prob, call, q.device)
            rows, cols = slice(call.r0, call.r1), slice(call.c0, call.c1)
            gq, gk, gv = vendor.backward(
                dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows],
                lse[:, :, rows], bias, False, prob.scale,
            )  # fmt: skip
            dq[:, :, rows] += gq
            dk[:, :, cols] += gk
            dv[:, :, cols] += gv

    list(pool.run(job, chunks))
    parts = list(acc.values())
    dk, dv = parts[0]
    for pk, pv in parts[1:]:
        dk += pk
        dv += pv
    return dq, dk, dv
