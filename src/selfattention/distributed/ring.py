"""The ring: key/value blocks travel rank to rank, each block computed by the engine and merged by log-sum-exp;
the backward runs the ring again."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .._validation import all_finite, check_positive_int, parse_attention
from ..kernels import engine
from ..kernels.merge import merge_into
from ..visibility import PARTIAL, SKIP, Visibility, classify
from .layout import LAYOUTS, check_layout, segments

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------------------------------
# Statistics and the ring transport
# ----------------------------------------------------------------------------------------------------


@dataclass
class RingStats:
    """Counters one rank accumulates over :func:`ring_attention` calls (forward and backward).

    Attributes:
        bytes_sent: payload bytes this rank sent (bytes received are the same up to the split).
        messages: point-to-point sends.
        tiles_computed, tiles_skipped: (query tile × key tile) blocks computed, and skipped because the
            causal mask hides all of them.
        compute_s: seconds spent computing blocks; wait_s: seconds spent waiting for messages after the
            computation they overlapped with was done (0 = communication fully hidden).
    """

    bytes_sent: int = 0
    messages: int = 0
    tiles_computed: int = 0
    tiles_skipped: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class _Pending:
    def __init__(self, works: list, recv: torch.Tensor, stats: RingStats | None):
        self.works, self.recv, self.stats = works, recv, stats

    def wait(self) -> torch.Tensor:
        """Wait once (gloo's send work must not be waited on twice), then return the received buffer."""
        if not self.works:
            return self.recv
        t0 = time.perf_counter()
        for w in self.works:
            w.wait()
        self.works = []
        if self.stats is not None:
            self.stats.wait_s += time.perf_counter() - t0
        return self.recv


class _Ring:
    def __init__(self, group: dist.ProcessGroup | None, stats: RingStats | None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.stats = stats

    def shift(self, send: torch.Tensor, recv_numel: int, tag: int) -> _Pending:
        """Post: send ``send`` to rank+1 and receive ``recv_numel`` elements from rank-1."""
        recv = torch.empty(recv_numel, dtype=send.dtype, device=send.device)
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        ops = [
            dist.P2POp(dist.isend, send, group=self.group, tag=tag, group_peer=nxt),
            dist.P2POp(dist.irecv, recv, group=self.group, tag=tag, group_peer=prv),
        ]
        works = dist.batch_isend_irecv(ops)
        if self.stats is not None:
            self.stats.bytes_sent += send.numel() * send.element_size()
            self.stats.messages += 1
        return _Pending(works, recv, self.stats)


# ----------------------------------------------------------------------------------------------------
# Blocks: this rank's query runs against one source rank's key runs, computed by the block engine
# ----------------------------------------------------------------------------------------------------


def _count_tiles(plan: _Plan, qs: tuple[int, int, int], ks: tuple[int, int, int]) -> None:
    """Count the (block × block) tiles of a query run × key run as computed or skipped (forward and
    backward), with the same predicate the engine plans with."""
    if plan.stats is None:
        return
    for a in range(0, qs[2], plan.block):
        q_first, q_last = qs[1] + a, qs[1] + min(qs[2], a + plan.block) - 1
        for c in range(0, ks[2], plan.block):
            k_first, k_last = ks[1] + c, ks[1] + min(ks[2], c + plan.block) - 1
            kind = classify(q_first, q_last, k_first, k_last, causal=plan.causal, window=None)
            plan.stats.tiles_computed += kind != SKIP
            plan.stats.tiles_skipped += kind == SKIP


def _blocks(plan: _Plan, src: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """(query rows, key rows, Problem) for every pair of this rank's query runs and the source rank's key
    runs that has a visible key: a causal pair becomes "causal at offset" (the queries' first global
    position minus the keys'), planned by the engine like any other problem."""
    for qs in plan.q_segs:
        for ks in plan.k_segs[src]:
            _count_tiles(plan, qs, ks)
            kind = classify(
                qs[1], qs[1] + qs[2] - 1, ks[1], ks[1] + ks[2] - 1, causal=plan.causal, window=None
            )
            if kind == SKIP:
                continue
            rows, cols = slice(qs[0], qs[0] + qs[2]), slice(ks[0], ks[0] + ks[2])
            vis = Visibility(qs[2], ks[2], is_causal=kind == PARTIAL, q_offset=qs[1] - ks[1])
            prob = engine.make_problem(
                q[:, :, rows],
                k[:, :, cols],
                v[:, :, cols],
                vis,
                plan.scale,
                block_q=plan.block,
                block_k=plan.block,
                kernel=plan.kernel,
            )
            yield rows, cols, prob


# ----------------------------------------------------------------------------------------------------
# The plan shared by forward and backward
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Plan:
    ring: _Ring
    scale: float
    causal: bool
    q_lens: list[int]
    k_lens: list[int]
    q_segs: list[tuple[int, int, int]]  # this rank's query runs (local start, global position, length)
    k_segs: list[list[tuple[int, int, int]]]  # per source rank: its key runs
    k_batch: tuple[int, ...]  # (B, Hkv): key/value in the engine's 4-D layout
    d: int
    dv: int
    acc: torch.dtype
    block: int
    overlap: bool
    stats: RingStats | None
    kernel: str | None = None

    def kv_numel(self, src: int) -> int:
        return math.prod(self.k_batch) * self.k_lens[src] * (self.d + self.dv)

    def unpack(self, flat: torch.Tensor, src: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv)) of a packed buffer."""
        n = math.prod(self.k_batch) * self.k_lens[src]
        k = flat[: n * self.d].view(*self.k_batch, self.k_lens[src], self.d)
        v = flat[n * self.d :].view(*self.k_batch, self.k_lens[src], self.dv)
        return k, v


def _pack(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([a.reshape(-1).to(dtype), b.reshape(-1).to(dtype)])


def _ring_forward(plan: _Plan, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """query (B, H, Tq_local, D), key/value (B, Hkv, Tk_local, ·) → out (B, H, Tq_local, Dv), lse."""
    ring, n, me = plan.ring, plan.ring.world, plan.ring.rank
    out = query.new_zeros((*query.shape[:-1], plan.dv), dtype=plan.acc)
    lse = query.new_full(query.shape[:-1], -math.inf, dtype=plan.acc)
    kv = _pack(key, value, key.dtype)  # travels in the input dtype
    for step in range(n):
        src = (me - step) % n
        pending = None
        if step < n - 1:
            pending = ring.shift(kv, plan.kv_numel((src - 1) % n), tag=step)
            if not plan.overlap:
                pending.wait()
        t0 = time.perf_counter()
        k, v = plan.unpack(kv, src)
        for rows, cols, prob in _blocks(plan, src, query, k, v):
            c = prob.compute
            o, l = engine.forward(query[:, :, rows].to(c), k[:, :, cols].to(c), v[:, :, cols].to(c), prob)
            merge_into(out[:, :, rows], lse[:, :, rows], o, l)
        if plan.stats is not None:
            plan.stats.compute_s += time.perf_counter() - t0
        if pending is not None:
            kv = pending.wait()
    return out, lse


def _ring_backward(plan: _Plan, query, key, value, out, lse, grad_out):
    ring, n, me = plan.ring, plan.ring.world, plan.ring.rank
    dq = torch.zeros(query.shape, dtype=plan.acc, device=query.device)
    kv = _pack(key, value, key.dtype)
    incoming: _Pending | None = None  # the dK/dV accumulator of the block we hold, on its way to us
    for step in range(n):
        src = (me - step) % n
        pending_kv = None
        if step < n - 1:
            pending_kv = ring.shift(kv, plan.kv_numel((src - 1) % n), tag=2 * step)
            if not plan.overlap:
                pending_kv.wait()
        t0 = time.perf_counter()
        k, v = plan.unpack(kv, src)
        dkv = torch.zeros(plan.kv_numel(src), dtype=plan.acc, device=query.device)
        dk, dv = plan.unpack(dkv, src)  # views into dkv, (B, Hkv, Tk, D) and (B, Hkv, Tk, Dv)
        for rows, cols, prob in _blocks(plan, src, query, k, v):
            c = prob.compute
            gq, gk, gv, _ = engine.backward(
                grad_out[:, :, rows].to(c), query[:, :, rows].to(c), k[:, :, cols].to(c), v[:, :, cols].to(c),
                out[:, :, rows].to(c), lse[:, :, rows], prob,
            )  # fmt: skip
            dq[:, :, rows] += gq
            dk[:, :, cols] += gk
            dv[:, :, cols] += gv
        if plan.stats is not None:
            plan.stats.compute_s += time.perf_counter() - t0
        if incoming is not None:
            dkv += incoming.wait()
        if n > 1:  # pass the accumulator on; after the last step it reaches its owner
            incoming = ring.shift(dkv, plan.kv_numel((src - 1) % n), tag=2 * step + 1)
            if not plan.overlap:
                incoming.wait()
        if pending_kv is not None:
            kv = pending_kv.wait()
    own = incoming.wait() if incoming is not None else dkv
    dk, dv = plan.unpack(own, me)
    return dq, dk, dv


def _as4(t: torch.Tensor) -> torch.Tensor:
    """(..., H, T, X) → (B, H, T, X); (T, X) → (1, 1, T, X)."""
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, plan):
        q4, k4, v4 = (_as4(t) for t in (query, key, value))  # (B, H, T, ·)
        out, lse = _ring_forward(plan, q4, k4, v4)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan = plan
        return out.reshape(*query.shape[:-1], plan.dv).to(query.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        plan = ctx.plan
        q4, k4, v4, do = (_as4(t) for t in (query, key, value, grad_out))
        dq, dk, dv = _ring_backward(plan, q4, k4, v4, out, lse, do)
        return (
            dq.reshape(query.shape).to(query.dtype),
            dk.reshape(key.shape).to(key.dtype),
            dv.reshape(value.shape).to(value.dtype),
            None,
        )


# ----------------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------------


def _exchange_meta(meta: list[float], group, device) -> list[list[float]]:
    world = dist.get_world_size(group)
    mine = torch.tensor(meta, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return [t.tolist() for t in every]


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    layout: str = "contiguous",
    enable_gqa: bool = False,
    block_size: int | None = 512,
    overlap: bool = True,
    stats: RingStats | None = None,
) -> torch.Tensor:
    """Attention over a sequence split across the ranks of ``group``; returns this rank's context rows.

    A collective: every rank of ``group`` must call it with its own slice (same batch, heads, head_dim,
    dtype, ``is_causal``, ``scale`` and ``layout``), and — if a gradient is needed — call backward on a
    loss that uses the result (the backward is a ring too). The result equals
    ``selfattention.scaled_dot_product_attention`` on the full sequence, restricted to this rank's rows.

    Args:
        query: (..., H, Tq_local, D), this rank's query rows.
        key: (..., Hkv, Tk_local, D), this rank's key rows; Hkv = H unless ``enable_gqa``.
        value: (..., Hkv, Tk_local, Dv).
        group: the process group (default: the world). gloo on CPU tensors, NCCL on CUDA tensors.
        is_causal: hide future keys over the *global* positions, aligned bottom-right (query i of the
            full sequence sits at key position Tk - Tq + i), as in the single-process spec. Tiles that
            are entirely in the future are skipped, locally and across ranks.
        scale: multiplies Q Kᵀ; ``None`` means 1/√D; ``0.0`` is honoured.
        layout: ``"contiguous"`` (any split: ranks exchange their lengths and hold consecutive slices
            in rank order) or ``"zigzag"`` (rank r holds chunks r and 2N-1-r of 2N, as
            :func:`shard_sequence` makes them; balances causal work).
        enable_gqa: grouped-query attention (query head h uses key/value head h // (H // Hkv)); only
            the Hkv key/value heads travel.
        block_size: block size of the engine's plan inside a rank (and of the exact kernel's tiles, which
            bound the scores held at once to block_size² per head); ``stats`` counts tiles of this size.
            ``None``: one tile per rank's block. The fused kernel's memory is O(T) whatever it is.
        overlap: post the next block's send/receive before computing the current block (default). False
            waits for the transfer first — for measuring what the overlap buys.
        stats: a :class:`RingStats` to which this call (and its backward) adds bytes sent, tiles
            computed/skipped, compute and wait time.

    Returns:
        (..., H, Tq_local, Dv) in the dtype of ``query``. Rows with no visible key are zero (zero
        gradient). Computation and the merge are in float32 at least; keys and values travel in their
        own dtype, the dK/dV accumulators in float32 at least.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError, ValueError: bad local input (as the spec), an unknown layout, or ranks that disagree
            on shapes, dtype, causal flag, scale or layout (naming the rank and the field) — checked on
            every call with one small all-gather, so that a mismatch is an error, not a hang.

    Communication per rank and call: forward N-1 sends of its current key/value block; backward N-1
    key/value sends plus N dK/dV sends (float32 at least).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: start with torchrun and call "
            "selfattention.distributed.init_distributed() (or torch.distributed.init_process_group) first"
        )
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError("ring_attention: this process is not a member of the given group")
    args = parse_attention(query, key, value, None, 0.0, is_causal, scale, enable_gqa=enable_gqa)
    batch, scale = args.batch, args.scale
    check_layout(layout)
    if block_size is not None:
        check_positive_int("block_size", block_size)
    if stats is not None and not isinstance(stats, RingStats):
        raise TypeError(f"stats must be a RingStats or None, got {type(stats).__name__}")
    gqa = 1
    if enable_gqa and query.dim() >= 3:
        gqa = query.shape[-3] // key.shape[-3]
    expect_k = (*query.shape[:-3], query.shape[-3] // gqa) if query.dim() >= 3 else query.shape[:-2]
    if tuple(key.shape[:-2]) != tuple(expect_k):
        raise ValueError(
            f"ring_attention needs key/value batch dims equal to the query's (no broadcasting): query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}"
        )
    d, dv = query.shape[-1], value.shape[-1]

    meta = [
        query.shape[-2],
        key.shape[-2],
        d,
        dv,
        float(hash(tuple(batch)) % (2**50)),
        float(hash(tuple(key.shape[:-2])) % (2**50)),
        float(is_causal),
        float(LAYOUTS.index(layout)),
        float(_DTYPES.index(query.dtype)),
        scale,
        float(gqa),
        float(all(all_finite(t) for t in (query, key, value))),
    ]
    names = ["", "", "head_dim D", "value head_dim Dv", "batch/head dims", "key/value batch/head dims"]
    names += ["is_causal", "layout", "dtype", "scale", "enable_gqa heads ratio"]
    checked = len(meta) - 1  # the last entry (inputs finite) may differ between ranks
    every = _exchange_meta(meta, group, query.device)
    rank = dist.get_rank(group)
    for r, theirs in enumerate(every):
        for i in range(2, checked):
            if theirs[i] != meta[i]:
                raise ValueError(
                    f"ring_attention: rank {r} and rank {rank} disagree on {names[i]} "
                    f"(local query {tuple(query.shape)}, is_causal={is_causal}, layout={layout!r}, "
                    f"dtype={query.dtype}, scale={scale:g} on rank {rank}); every rank must pass its "
                    "slice of the same attention problem"
                )
    q_lens = [int(m[0]) for m in every]
    k_lens = [int(m[1]) for m in every]
    q_total, k_total = sum(q_lens), sum(k_lens)

    block = block_size or max(1, max(q_lens + k_lens))
    off = k_total - q_total  # bottom-right: query i of the full sequence at key position Tk - Tq + i
    q_segs = [(local, glob + off, n) for local, glob, n in segments(q_lens, rank, layout)]
    plan = _Plan(
        ring=_Ring(group, stats),
        scale=scale,
        causal=is_causal,
        q_lens=q_lens,
        k_lens=k_lens,
        q_segs=q_segs,
        k_segs=[segments(k_lens, r, layout) for r in range(len(k_lens))],
        k_batch=tuple(_as4(key[..., :0, :0]).shape[:2]),
        d=d,
        dv=dv,
        acc=torch.promote_types(query.dtype, torch.float32),
        block=block,
        overlap=overlap,
        stats=stats,
        # one kernel for every block of every rank: a NaN/inf anywhere sends all of them to the exact kernel
        # (a fused block's backward would meet the NaN output rows of another block and leak NaN)
        kernel=None if all(m[-1] == 1.0 for m in every) else "exact",
    )
    return _RingAttention.apply(query, key, value, plan)
