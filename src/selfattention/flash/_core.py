"""The computation behind :mod:`selfattention.flash`: a :class:`~._args.Problem` on the block engine, or, for
what the engine cannot express yet, on dense torch ops.

Engine (O(T) memory, torch's fused kernels, forward and backward): no softcap, no ALiBi, no dropout, and
a window that is causal-shaped (right = 0; left any) or absent. Packed sequences become document ids of
one (1, H, total, D) problem, planned one kernel call per sequence by the engine's documents strategy
(no padding). The engine aligns causal per document when every sequence has as many queries as keys,
or more generally when cu_seqlens_k[b+1] − cu_seqlens_q[b+1] is the same for every sequence b that has
queries and keys; other packed problems go dense until ``selfattention.flex_attention``'s
``packed_sequences`` lands (then :func:`attend` switches to it).

Dense (O(Tq·Tk) memory, torch ops, autograd): everything else — softcap, ALiBi, two-sided or non-causal
windows, per-sequence alignment the engine cannot take, and dropout (its keep-mask drawn from a generator
seeded by one int drawn from torch's global generator, so ``torch.manual_seed`` reproduces it; autograd
keeps the mask for the backward).
"""

from __future__ import annotations

import math

import torch

from .._validation import all_finite
from ..functional import guarded_pv, row_logsumexp
from ..tiled import tiled_attention
from ..visibility import Visibility
from ._args import Problem

__all__ = ["attend", "engine_can", "positions"]


def positions(p: Problem) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(query sequence ids, key sequence ids, query positions, key positions), int64, per token; ids None
    when not packed. A query's position is on its own sequence's key axis: i + seqlen_k − seqlen_q."""
    dev = p.q.device
    tq, tk = p.q.shape[2], p.k.shape[2]
    if not p.varlen:
        return None, None, torch.arange(tq, device=dev) + (tk - tq), torch.arange(tk, device=dev)
    lq, lk = p.cu_q[1:] - p.cu_q[:-1], p.cu_k[1:] - p.cu_k[:-1]
    seqs = torch.arange(lq.numel(), device=dev)
    qd, kd = torch.repeat_interleave(seqs, lq), torch.repeat_interleave(seqs, lk)
    qp = torch.arange(tq, device=dev) - p.cu_q[qd] + (lk - lq)[qd]
    kp = torch.arange(tk, device=dev) - p.cu_k[kd]
    return qd, kd, qp, kp


def _engine_offset(p: Problem) -> int | None:
    """The engine's q_offset that aligns every sequence bottom-right on its own keys, or None."""
    if not p.varlen:
        return p.k.shape[2] - p.q.shape[2]
    lq, lk = p.cu_q[1:] - p.cu_q[:-1], p.cu_k[1:] - p.cu_k[:-1]
    ends = (p.cu_k[1:] - p.cu_q[1:])[(lq > 0) & (lk > 0)]
    if ends.numel() == 0:
        return 0
    first = int(ends[0])
    return first if bool((ends == first).all()) else None


def engine_can(p: Problem) -> bool:
    """Whether the block engine computes this problem (see the module docstring)."""
    if p.softcap > 0 or p.alibi is not None or p.dropout_p > 0:
        return False
    if not p.windowed:
        return True
    return p.right == 0 and _engine_offset(p) is not None


def _visibility(p: Problem) -> Visibility:
    tq, tk = p.q.shape[2], p.k.shape[2]
    causal = p.windowed
    window = None
    if causal and p.left < max(p.max_k, tk):  # a left window narrower than every sequence's keys
        window = p.left + 1
    qd = kd = None
    if p.varlen:
        qd, kd, _, _ = positions(p)
        qd, kd = qd[None], kd[None]
    off = _engine_offset(p) if causal else None
    return Visibility(tq, tk, is_causal=causal, window=window, q_offset=off, q_doc=qd, k_doc=kd)


def attend(p: Problem, *, return_probs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out (B, H, Tq, D) in q's dtype, lse (B, H, Tq) float32 at least, S_dmask or None)."""
    if engine_can(p) and not (return_probs and p.dropout_p > 0):
        # (B, H, T, D) copies: the fused kernel runs ~13% slower on the transposed views of flash-attn's
        # (B, T, H, D) layout (measured at T = 2000), and the copy is O(T) against O(T²) work
        q, k, v = (t.contiguous() for t in (p.q, p.k, p.v))
        out, lse = tiled_attention(q, k, v, _visibility(p), scale=p.scale, enable_gqa=True, return_lse=True)
        return out, lse, None
    return _dense(p, return_probs)


def _dense(p: Problem, return_probs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    acc = torch.promote_types(p.q.dtype, torch.float32)
    q, k, v = p.q.to(acc), p.k.to(acc), p.v.to(acc)
    g = q.shape[1] // max(1, k.shape[1])
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    qd, kd, qp, kp = positions(p)
    rel = qp[:, None] - kp[None, :]  # (Tq, Tk): query position − key position
    seen = torch.ones(rel.shape, dtype=torch.bool, device=q.device)
    if p.windowed:
        seen = (rel <= p.left) & (-rel <= p.right)
    if qd is not None:
        seen = seen & (qd[:, None] == kd[None, :])
    seen = seen[None, None]  # (1, 1, Tq, Tk)
    if not all_finite(q):  # a query that sees nothing takes no part, even if it holds NaN/inf
        blind = ~seen.any(dim=-1, keepdim=True)
        q = torch.where(blind & ~torch.isfinite(q), torch.zeros((), dtype=acc, device=q.device), q)
    if all_finite(k):
        s = q @ k.transpose(-1, -2)
    else:  # a NaN/inf key reaches only the scores that use it, and no gradient through 0 · NaN
        bad = ~torch.isfinite(k)
        s = q @ torch.where(bad, torch.zeros((), dtype=acc, device=k.device), k).transpose(-1, -2)
        with torch.no_grad():
            honest = q @ k.transpose(-1, -2)
        s = torch.where(torch.isfinite(honest), s, honest)
    s = s * p.scale
    if p.softcap > 0:
        s = p.softcap * torch.tanh(s / p.softcap)
    if p.alibi is not None:
        slopes = p.alibi.to(acc)  # (b, H)
        if qd is not None:  # per sequence: (1, H, Tq, 1) from each query's sequence
            sl = slopes[qd] if slopes.shape[0] > 1 else slopes.expand(int(p.cu_q.numel() - 1), -1)[qd]
            s = s - sl.T[None, :, :, None] * rel.abs().to(acc)
        else:
            s = s - slopes[:, :, None, None] * rel.abs().to(acc)
    s = torch.where(seen, s, torch.full((), -math.inf, dtype=acc, device=s.device))
    lse = row_logsumexp(s)
    inf = torch.full((), math.inf, dtype=acc, device=s.device)
    w = torch.exp(s - torch.where(lse == -math.inf, inf, lse).unsqueeze(-1))  # softmax; 0 for blind rows
    used, keep = w, None
    if p.dropout_p > 0:
        gen = torch.Generator(device=q.device)
        gen.manual_seed(int(torch.randint(0, 2**62, (), device="cpu")))
        keep = torch.rand(w.shape, generator=gen, device=q.device, dtype=acc) >= p.dropout_p
        used = w * keep / (1.0 - p.dropout_p)
    out = guarded_pv(used, v, seen).to(p.q.dtype)
    probs = None
    if return_probs and keep is not None:
        probs = _s_dmask(p, torch.where(keep, w, -w).detach().to(p.q.dtype))
    return out, lse, probs


def _s_dmask(p: Problem, sw: torch.Tensor) -> torch.Tensor:
    """The signed weights (B, H, Tq, Tk) (negative = dropped); for packed sequences gathered per sequence
    into (batch, H, max_seqlen_q, max_seqlen_k), zeros outside each sequence."""
    if not p.varlen:
        return sw
    n = p.cu_q.numel() - 1
    lq, lk = p.cu_q[1:] - p.cu_q[:-1], p.cu_k[1:] - p.cu_k[:-1]
    i = torch.arange(p.max_q, device=sw.device)
    j = torch.arange(p.max_k, device=sw.device)
    ok = (i[None, :, None] < lq[:, None, None]) & (j[None, None, :] < lk[:, None, None])  # (n, mq, mk)
    ri = (p.cu_q[:-1, None] + i[None, :]).clamp(max=max(0, sw.shape[2] - 1))
    ci = (p.cu_k[:-1, None] + j[None, :]).clamp(max=max(0, sw.shape[3] - 1))
    if sw.shape[2] == 0 or sw.shape[3] == 0:
        return sw.new_zeros((n, sw.shape[1], p.max_q, p.max_k))
    got = sw[0][:, ri[:, :, None], ci[:, None, :]]  # (H, n, mq, mk)
    return torch.where(ok[None], got, torch.zeros((), dtype=sw.dtype, device=sw.device)).transpose(0, 1)
