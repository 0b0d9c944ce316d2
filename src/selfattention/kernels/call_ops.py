"""One call of a block plan: its views of q, k and v, its bias tile, the block kernel's forward with the
deferred NaN/inf check, and the folds of its gradients — the pieces :mod:`.engine` (a plan in order) and
:mod:`.row_chunks` (a plan in row chunks on the pool) and :mod:`.stats` share.

Shapes as in :mod:`.engine`: canonical query (B, H, Tq, D), key (B, Hkv, Tk, D), value (B, Hkv, Tk, Dv).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from . import exact, pool, vendor
from .plan import Call

if TYPE_CHECKING:
    from .engine import Problem

__all__ = [
    "call_views",
    "unstack",
    "fold",
    "tile",
    "row_seen",
    "common_case",
    "verify",
    "kernel_forward",
    "cols_of",
    "stack_rows",
    "NotFinite",
]


# ---------------------------------------------------------------------------------------------------------
# Views of one call
# ---------------------------------------------------------------------------------------------------------


def call_views(call: Call, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(query rows, keys, values, head slice) per kernel call: one for a plain call; for ``count`` stacked
    calls, strided views (B·H, count, rows, D) / (B·Hkv, count, cols, D) — one per query-head group with
    grouped heads, so that each view has as many query as key/value heads. Nothing is copied."""
    r0, r1 = call.r0, call.r1
    if call.count == 1:
        if (r0, r1, call.c0, call.c1) == (0, q.shape[2], 0, k.shape[2]):  # the whole problem: no slicing
            yield q, k, v, slice(None)
        else:
            yield q[:, :, r0:r1], k[:, :, call.c0 : call.c1], v[:, :, call.c0 : call.c1], slice(None)
        return
    h, hkv = q.shape[1], k.shape[1]
    g = h // hkv

    def band(t: torch.Tensor) -> torch.Tensor:  # (B, Hk, C, X) → (B·Hk, count, cols, X)
        t = t[:, :, call.c0 : call.c1].unfold(2, call.cols, call.step)  # (B, Hk, count, X, cols)
        return t.transpose(-1, -2).flatten(0, 1)

    kb, vb = band(k), band(v)
    for gi in range(g):
        heads = slice(gi, None, g) if g > 1 else slice(None)
        qg = q[:, heads, r0:r1].unflatten(2, (call.count, call.rows)).flatten(0, 1)  # (B·Hkv, count, rows, D)
        yield qg, kb, vb, heads


def unstack(call: Call, t: torch.Tensor, b: int) -> torch.Tensor:
    """A kernel result (B·Hx, count, rows, ...) of a stacked call back to (B, Hx, count·rows, ...)."""
    if call.count == 1:
        return t
    return t.unflatten(0, (b, -1)).flatten(2, 3)


def fold(call: Call, t: torch.Tensor, b: int, into: torch.Tensor) -> None:
    """Add per-sub-call key gradients (B·Hkv, count, cols, X) into ``into`` (B, Hkv, Tk, X)."""
    if call.count == 1:
        into[:, :, call.c0 : call.c1] += t
        return
    t = t.unflatten(0, (b, -1))  # (B, Hkv, count, cols, X)
    if call.step == call.cols:
        into[:, :, call.c0 : call.c1] += t.flatten(2, 3)
        return
    for n in range(call.count):  # overlapping bands
        c = call.c0 + n * call.step
        into[:, :, c : c + call.cols] += t[:, :, n]


def tile(prob: Problem, call: Call, device: torch.device) -> torch.Tensor | None:
    if not call.tile:
        return None
    tile = prob.vis.tile(
        call.r0,
        call.r0 + call.rows,
        call.c0,
        call.c0 + call.cols,
        prob.compute,
        device,
        structure=not call.causal,
    )
    if tile is None and prob.mask_grad:  # a block of a learned mask that happens to be all 0: dS is still due
        tile = torch.zeros((1, 1, call.rows, call.cols), dtype=prob.compute, device=device)
    return tile


def row_seen(bias: torch.Tensor, causal: bool) -> torch.Tensor:
    """Bool (b, h, rows) of the rows that see at least one key of a bias tile — for a ``causal`` (square,
    diagonal) call only the keys up to the row's own position count: a key the bias shows but the
    kernel's causal rule hides is not seen (a row with none gets lse = 0 from the fused kernel)."""
    shown = bias != -math.inf
    if causal:
        rows, cols = bias.shape[-2], bias.shape[-1]
        if rows == 1:  # a key mask riding along, broadcast over the rows: give it its rows
            rows = cols
            shown = shown.expand(*shown.shape[:-2], rows, cols)
        shown = shown & torch.ones(rows, cols, dtype=torch.bool, device=bias.device).tril()
    return shown.any(dim=-1)


# ---------------------------------------------------------------------------------------------------------
# Forward and backward over the plan
# ---------------------------------------------------------------------------------------------------------


_SMALL = 4096  # elements: below this a CPU result is checked in Python (a decode step's 8 rows of 64)
_NUMPY_DTYPES = (torch.float32, torch.float64)


def common_case(o: torch.Tensor, l: torch.Tensor, values: bool = True) -> bool:
    """Whether sum(o) is finite and no lse is 0, ±inf or NaN (see :func:`kernel_forward`); with
    ``values=False`` only the lse (a call where every query sees every key: a NaN/inf key or query shows in
    the lse, and a NaN/inf value reaches every row through a weight > 0, as in the spec). A small CPU
    result is read in Python (one pass, no torch op: each costs microseconds, more right after a kernel
    that streamed the cache through the CPU caches); else one number, sum(out) + sum(lse + 1/lse): 1/lse is
    inf for lse = 0, and lse + 1/lse is ±inf or NaN for an lse of ±inf or NaN. (Not log|lse|: ``log`` and
    the other transcendental ops open a parallel region even on a few thousand elements, and on a machine
    where another process keeps a core busy each such region waits for a time slice: 8–18 ms per call,
    measured at T = 1024; a reciprocal and sums stay serial at this size.)"""
    if (
        o.device.type == "cpu"
        and o.numel() + l.numel() <= _SMALL
        and o.dtype in _NUMPY_DTYPES
        and l.dtype in _NUMPY_DTYPES
        and not (o.requires_grad or l.requires_grad)
    ):
        return math.isfinite(sum(o.numpy().ravel().tolist())) and all(
            0.0 < abs(x) < math.inf for x in l.numpy().ravel().tolist()
        )
    with pool.serial():
        total = l.reciprocal().add_(l).sum()
        return math.isfinite((total.add_(o.sum()) if values else total).item())


def verify(o: torch.Tensor, l: torch.Tensor, seen: torch.Tensor | None, values: bool = True) -> None:
    """Raise NotFinite when a fused result (o, l) may have touched a NaN/inf input (see kernel_forward);
    ``values``: see :func:`common_case`."""
    if not common_case(o, l, values):
        with pool.serial():
            finite = math.isfinite(o.sum().item())
        if not finite:
            raise NotFinite
        empty = ((l == 0) | ~torch.isfinite(l)) & (o == 0).all(dim=-1)
        if seen is not None:
            empty = empty & seen
        if bool(empty.any()):
            raise NotFinite


def kernel_forward(prob: Problem, call: Call, qv, kv, vv, bias, check: bool = True):
    if prob.kernel == "vendor":
        o, l = vendor.forward(qv, kv, vv, bias, call.causal, prob.scale)
        seen = None
        # a row the bias leaves blind comes back with lse 0 (or not finite): only then is it looked for
        if bias is not None and bool(((l == 0) | ~torch.isfinite(l)).any()):
            seen = row_seen(bias, call.causal)
        if prob.verify:
            # Nothing was scanned for NaN/inf (see choose_kernel). A result that touched one is either not
            # finite (NaN · 0, +inf scores) or, as the fused kernel drops a NaN score like a hidden one, a
            # row that comes back as "sees nothing" (out 0, lse 0 or −inf) although it may see keys (a
            # NaN query row, or every visible key NaN). Either goes to the exact kernel (rare: also an
            # all-zero row of real data). One synchronisation for the common case (per-call cost matters
            # at small T): the output's sum is finite and no |lse| is 0, inf or NaN. (Not the signs of the
            # lse alone: the first rows of a causal problem see few keys, and their lse is often negative.)
            # One number says both: lse + 1/lse is finite unless an lse is 0, ±inf or NaN, so
            # sum(out) + sum(lse + 1/lse) is finite exactly when the common case holds (or a sum overflowed,
            # or an |lse| < 1/finfo.max: then the precise checks below decide).
            if check:
                # every key visible (no bias, not causal): a value's NaN/inf belongs in every row, and only
                # the lse needs the look (T = 1024: 8 K numbers instead of 0.5 M, 0.3 ms of a 14 ms call)
                verify(o, l, seen, values=bias is not None or call.causal)
        if seen is not None and not bool(seen.all()):  # the fused kernel gives a blind row lse = 0: −inf
            l = torch.where(seen, l, torch.full((), -math.inf, dtype=l.dtype, device=l.device))
        return o, l
    drop = None if prob.dropout is None else prob.dropout.at(call.r0, call.c0)
    return exact.forward(
        qv,
        kv,
        vv,
        bias,
        call.causal,
        prob.scale,
        dropout=drop,
        block_q=prob.exact_block_q,
        block_k=prob.exact_block_k,
    )


def cols_of(call: Call, m: torch.Tensor) -> slice:
    return slice(call.c0, call.c1) if m.shape[-1] != 1 else slice(None)


def stack_rows(call: Call, *ts: torch.Tensor) -> list[torch.Tensor]:
    """Row tensors (B, Hx, count·rows, ...) of a stacked call as (B·Hx, count, rows, ...)."""
    if call.count == 1:
        return list(ts)
    return [t.unflatten(2, (call.count, call.rows)).flatten(0, 1) for t in ts]


class NotFinite(Exception):
    """Raised inside a deferred-check forward when a fused call met NaN/inf (see :func:`choose_kernel`)."""
