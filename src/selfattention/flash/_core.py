"""The computation behind :mod:`selfattention.flash`: a :class:`~._args.Problem` on the block engine.

The visibility is one of :mod:`selfattention.mods`' ready structures — ``packed_sequences`` (flash-attn's
varlen: each sequence's queries bottom-right on its own keys, its window (left, right)) or
``sliding_window(left, right, offset=seqlen_k − seqlen_q)`` — turned into the engine's
:class:`~selfattention.visibility.Visibility` without evaluating a mask: packed sequences are planned one
kernel call per sequence (document ids, per-document offset), windows as causal-at-an-offset bands. No
padding, no Python loop over sequences here, O(T) memory.

* no softcap, no ALiBi: the engine on torch's fused kernels (:mod:`selfattention.kernels.engine`);
* softcap and/or ALiBi: the engine's score-mod kernel (:mod:`selfattention.kernels.scored`, per query
  block, checkpointed) with flash-attn's score ``cap · tanh(s / cap) − slope · |i + sk − sq − j|``;
* dropout: dense torch ops (O(Tq·Tk) memory, autograd keeps the mask): the keep-mask is drawn from a
  generator seeded by one int drawn from torch's global generator, so ``torch.manual_seed`` reproduces it.
"""

from __future__ import annotations

import math

import torch

from .. import mods
from .._validation import all_finite
from ..functional import guarded_pv, row_logsumexp
from ..kernels import engine, scored
from ..visibility import Visibility
from ._args import Problem

__all__ = ["attend", "positions", "visibility"]


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


def visibility(p: Problem) -> Visibility:
    """The engine's Visibility of the problem (flash-attn's rules, already normalised in ``p``)."""
    tq, tk = p.q.shape[2], p.k.shape[2]
    if p.varlen:
        mod = mods.packed_sequences(p.cu_q, p.cu_k, False, (p.left, p.right))
    elif p.windowed:
        mod = mods.sliding_window(p.left, p.right, offset=tk - tq)
    else:
        return Visibility(tq, tk)
    fields = mods.visibility_fields(mod, tq, tk)
    if fields is None:  # both sides bounded or neither: always a structure (see _args._normalise)
        raise AssertionError(f"no structure for window ({p.left}, {p.right})")
    return Visibility(tq, tk, **fields)


class _Scores:
    """flash-attn's score mod: cap · tanh(s / cap), then − slope · |i + sk − sq − j| (positions per
    sequence), on flex's broadcast index tensors b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (…, R, 1), kv_idx."""

    def __init__(self, p: Problem) -> None:
        self.cap = p.softcap
        self.slopes = None
        if p.alibi is not None:
            qd, _, qp, kp = positions(p)
            self.qp, self.kp = qp, kp
            sl = p.alibi.to(torch.promote_types(p.q.dtype, torch.float32))
            if qd is not None:  # (Tq, H): each query's own sequence's slopes
                sl = sl.expand(int(p.cu_q.numel() - 1), -1) if sl.shape[0] == 1 else sl
                self.slopes, self.per_query = sl[qd], True
            else:
                self.slopes, self.per_query = sl, False

    def __call__(self, score, b, h, q_idx, kv_idx):
        s = score
        if self.cap > 0:
            s = self.cap * torch.tanh(s / self.cap)
        if self.slopes is not None:
            rel = (self.qp[q_idx] - self.kp[kv_idx]).abs().to(s.dtype)
            if self.per_query:
                slope = self.slopes[q_idx, h]
            else:
                slope = self.slopes[b if self.slopes.shape[0] > 1 else 0, h]
            s = s - slope * rel
        return s


def attend(p: Problem, *, return_probs: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out (B, H, Tq, D) in q's dtype, lse (B, H, Tq) float32 at least, S_dmask or None)."""
    if p.dropout_p > 0:
        return _dense(p, return_probs)
    b, h, tq, d = p.q.shape
    tk = p.k.shape[2]
    acc = torch.promote_types(p.q.dtype, torch.float32)
    if tq == 0 or tk == 0 or b == 0 or h == 0 or d == 0:
        zero = p.q[..., :0].sum() + p.k[..., :0].sum() + p.v[..., :0].sum()  # zeros tied to the graph
        out = zero.expand(b, h, tq, p.v.shape[-1]).to(p.q.dtype).clone()
        if d == 0 and tk > 0:  # headdim 0: every score is 0, uniform weights over the visible keys
            return _dense(p, return_probs)
        return out, torch.full((b, h, tq), -math.inf, dtype=acc, device=p.q.device), None
    vis = visibility(p)
    # (B, H, T, D) copies for one batch of long rows: the fused kernel runs ~8% slower on the transposed
    # views of flash-attn's (B, T, H, D) layout (B = 2, T = 4096, causal: 164 vs 152 ms, the copies 4 ms).
    # Packed sequences are cut into one short call per sequence, where the views run as fast as copies
    # (8 causal sequences of 100 … 4000, H = 8, D = 64: 247 ms on the views vs 254 ms copies included)
    q, k, v = (p.q, p.k, p.v) if p.varlen else (t.contiguous() for t in (p.q, p.k, p.v))
    if p.softcap > 0 or p.alibi is not None:
        out, lse, _ = scored.attention(q, k, v, vis, p.scale, _Scores(p), block_q=128, block_k=512)
        return out, lse, None
    no_grad = not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
    prob = engine.make_problem(q, k, v, vis, p.scale, defer_kv=no_grad)
    out, lse = engine.attention(q, k, v, prob)
    return out, lse.to(acc), None


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
