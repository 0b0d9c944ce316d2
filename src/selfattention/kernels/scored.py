"""The score-mod kernel: attention whose scores pass through an arbitrary ``score_mod`` before the softmax.

For flex_attention's ``score_mod(score, b, h, q_idx, kv_idx)`` when it is not an additive bias the fused
kernel could take (tanh softcap, anything non-linear) or when it closes over tensors that require grad (a
learned ALiBi slope, a T5 relative-position table): each block of query rows is computed over its span of
keys (from the block plan: key blocks nobody in the row block sees are not computed) with torch ops —
scores, ``score_mod``, the predicate's tile (:meth:`~selfattention.visibility.Visibility.tile`), a safe
softmax — under ``torch.utils.checkpoint`` (non-reentrant), so that the backward recomputes each block
instead of storing it: memory O(block_q × span) per block, gradients by autograd to query, key, value, the
log-sum-exp's users and every tensor the mod captured.

A row that sees no key: output 0, log-sum-exp −inf, max score −inf, zero gradient. A NaN/inf in a hidden
key or value reaches nothing (the mod sees 0 there, and the values are guarded).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from .._validation import all_finite
from ..functional import guarded_pv
from ..visibility import Visibility, evaluate_mod, index_tiles
from . import fast_exp
from .plan import row_spans

__all__ = ["attention"]


def _block(vis: Visibility, scale: float, score_mod: Callable, i0: int, c0: int, q, k, v):
    """(out (B, H, R, Dv), lse (B, H, R), max (B, H, R)) of rows i0 … over keys c0 … (q/k/v sliced)."""
    b, h, rows, _ = q.shape
    hkv, cols = k.shape[1], k.shape[2]
    g = h // hkv
    q, bad_q = _clean(q)  # NaN/inf rows enter the scores as NaN, never the products of the backward
    k, bad_k = _clean(k)
    s = (q.unflatten(1, (hkv, g)) @ k[:, :, None].transpose(-1, -2)).flatten(1, 2) * scale  # (B, H, R, C)
    if bad_q is not None or bad_k is not None:
        bad = torch.zeros((), dtype=torch.bool, device=s.device)
        if bad_q is not None:
            bad = bad | bad_q[..., :, None]
        if bad_k is not None:
            bad = bad | bad_k.repeat_interleave(g, 1)[..., None, :]
        s = s + torch.where(bad, math.nan, 0.0).to(s.dtype)
    tile = vis.tile(i0, i0 + rows, c0, c0 + cols, s.dtype, s.device)
    hidden = None if tile is None else tile == -math.inf
    if hidden is not None and (bad_q is not None or bad_k is not None):
        # the mod sees 0 where hidden: a NaN there has no gradient path back
        s = torch.where(hidden, torch.zeros((), dtype=s.dtype, device=s.device), s)
    elif hidden is not None and s.requires_grad:  # a mod NaN/inf at hidden entries (sqrt, log of q − kv)
        s = _HideGrad.apply(s, hidden)  # must not turn the backward NaN through 0 · NaN (torch's flex)
    raw = s
    s = evaluate_mod(score_mod, *index_tiles(b, h, i0, i0 + rows, c0, c0 + cols, s.device), score=s)
    if raw.requires_grad and not (isinstance(s, torch.Tensor) and s.requires_grad):
        # a mod that ignores the score: keep query/key in the graph with zero gradient, as torch's flex
        # (autograd.grad(out, query) must not raise); where() passes 0, never 0 · NaN
        s = s + torch.where(torch.zeros((), dtype=torch.bool, device=raw.device), raw, 0.0)
    s = s.to(q.dtype).expand(b, h, rows, cols)
    if hidden is not None:
        s = torch.where(hidden, torch.full((), -math.inf, dtype=s.dtype, device=s.device), s)
    m = s.detach().amax(dim=-1, keepdim=True)
    m_ref = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=m.dtype, device=m.device))
    e = fast_exp.exp_(s - m_ref)  # in place on the difference (autograd keeps exp2's output)
    total = e.sum(dim=-1, keepdim=True)
    blind = total == 0
    one = torch.ones((), dtype=total.dtype, device=total.device)
    e5 = e.unflatten(1, (hkv, g))
    v5 = v[:, :, None]
    if all_finite(v):
        out = e5 @ v5  # normalised after the product: (R, Dv) divisions instead of (R, C)
    else:
        seen = torch.ones_like(s, dtype=torch.bool) if hidden is None else ~hidden.expand_as(s)
        out = guarded_pv(e5, v5, seen.unflatten(1, (hkv, g)))
    out = out / torch.where(blind, one, total).unflatten(1, (hkv, g))
    lse = torch.where(
        blind,
        torch.full((), -math.inf, dtype=m.dtype, device=m.device),
        m_ref + torch.log(torch.where(blind, one, total)),
    )
    return out.flatten(1, 2), lse.squeeze(-1), m.squeeze(-1)


def _joined(vis: Visibility, scale: float, score_mod: Callable, i0: int, c0: int, n: int, q, *kv):
    """:func:`_block` over the key pieces ``kv`` (n key pieces, then n value pieces), joined inside (so
    that a checkpoint keeps views, not the joined copies)."""
    k = kv[0] if n == 1 else torch.cat(kv[:n], dim=2)
    v = kv[n] if n == 1 else torch.cat(kv[n:], dim=2)
    return _block(vis, scale, score_mod, i0, c0, q, k, v)


class _HideGrad(torch.autograd.Function):
    """Identity forward; the backward zeroes the gradient of hidden entries (free in the forward)."""

    @staticmethod
    def forward(ctx, s, hidden):
        ctx.save_for_backward(hidden)
        return s.view_as(s)

    @staticmethod
    def backward(ctx, grad):
        (hidden,) = ctx.saved_tensors
        return torch.where(hidden, torch.zeros((), dtype=grad.dtype, device=grad.device), grad), None


def _clean(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(t with NaN/inf set to 0, bool (…, T) of the rows that held one) — or (t, None) when finite."""
    if all_finite(t):
        return t, None
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0), ~torch.isfinite(t).all(dim=-1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    vis: Visibility,
    scale: float,
    score_mod: Callable,
    *,
    block_q: int = 128,
    block_k: int = 128,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (B, H, Tq, Dv) in q's dtype, lse (B, H, Tq), max scores (B, H, Tq)) — the statistics in
    float32 at least — for canonical q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv)."""
    b, h, tq, _ = q.shape
    dv = v.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qa, ka, va = (t.to(acc) for t in (q, k, v))
    # checkpointed where autograd may be needed (a tensor the mod closes over can require grad even when
    # q, k, v do not); never for inference tensors (torch.inference_mode), which cannot be saved for it
    grad = torch.is_grad_enabled() and not any(t.is_inference() for t in (qa, ka, va))
    outs, lses, maxes = [], [], []
    done = 0

    def gap(n: int) -> None:
        if n > 0:
            outs.append(qa.new_zeros((b, h, n, dv)))
            lses.append(qa.new_full((b, h, n), -math.inf))
            maxes.append(qa.new_full((b, h, n), -math.inf))

    # Blocks are pieces of one split (not slices): the backward of a split concatenates every piece's
    # gradient once, where a slice's backward would write a zero-filled (B, H, T, D) gradient per block.
    q_parts = qa.split(block_q, dim=2)
    k_parts, v_parts = ka.split(block_k, dim=2), va.split(block_k, dim=2)
    for i0, i1, c0, c1 in row_spans(vis, block_q, block_k):  # i0, c0 on the grid; c1 ends a key block
        gap(i0 - done)
        a, z = c0 // block_k, -(-c1 // block_k)
        fn = partial(_joined, vis, scale, score_mod, i0, c0, z - a)
        args = (q_parts[i0 // block_q], *k_parts[a:z], *v_parts[a:z])
        o, l, m = checkpoint(fn, *args, use_reentrant=False) if grad else fn(*args)
        outs.append(o)
        lses.append(l)
        maxes.append(m)
        done = i1
    gap(tq - done)
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    lse = torch.cat(lses, dim=2) if len(lses) > 1 else lses[0]
    mx = torch.cat(maxes, dim=2) if len(maxes) > 1 else maxes[0]
    if done == 0 and grad and any(t.requires_grad for t in (qa, ka, va)):
        # no row sees a key: zeros that stay in the graph (zero gradients), as on every other route
        out, lse = _Blind.apply(out, lse, qa, ka, va)
    return out.to(q.dtype), lse, mx.detach()


class _Blind(torch.autograd.Function):
    """(out, lse) of a call where no row sees a key, joined to q, k, v with zero gradients."""

    @staticmethod
    def forward(ctx, out, lse, q, k, v):
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        return out.clone(), lse.clone()

    @staticmethod
    def backward(ctx, gout, glse):
        zeros = [torch.zeros(sh, dtype=dt, device=dev) for sh, dt, dev in ctx.shapes]
        return None, None, *zeros
