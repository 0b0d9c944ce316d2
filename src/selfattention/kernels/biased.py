"""Attention with a dense additive bias that wants its gradient (T5's relative position bias in training).

When the bias is already a dense (…, Tq, Tk) tensor — T5 hands attention ``position_bias`` (1 or B, H, Tq,
Tk) computed from a learned embedding — its gradient is the gradient of the scores itself,
dS = P ∘ (dO Vᵀ − δ) with δ = rowsum(dO ∘ O), summed over the dimensions the bias broadcasts along. The
memory is O(Tq · Tk) anyway (the bias and its gradient are), so this kernel computes the whole problem
with a few large ops instead of a block plan: S = Q Kᵀ · scale + bias + hidden, P = softmax(S) (kept for
the backward), O = P V; backward dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − δ + dℓ), dQ = dS K · scale,
dK = dSᵀ Q · scale, d(bias) = dS — the same work as torch's math SDPA (which transformers' sdpa falls to
on CPU for a bias that requires grad), in one autograd node.

Grouped-query heads: the query heads of one key/value head are stacked as rows, (B, Hkv, g · Tq, D), so
every product is one batched matmul and dK, dV need no sum over the group.

A row that sees no key (every entry −inf): output 0, log-sum-exp −inf, zero gradient. Inputs must be
finite (the caller checks; hidden NaN/inf keys and values go to the engine, which guards them).

Source: the softmax backward of lecture 003's softmax(Q Kᵀ/√d_k) V; FlashAttention-2 (Dao 2023) §2 for
δ = rowsum(dO ∘ O).
"""

from __future__ import annotations

import math

import torch

from .._validation import all_finite
from . import vendor
from .fast_exp import exp_

__all__ = ["attention"]


def _rows(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, R, ·) → (B, Hkv, g · R, ·): the query heads of one key/value head stacked as rows."""
    b, h, r, d = t.shape
    return t if h == hkv else t.reshape(b, hkv, (h // hkv) * r, d)


class _DenseBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, hidden, scale):
        b, h, tq, _ = q.shape
        hkv, tk = k.shape[1], k.shape[2]
        s = torch.matmul(_rows(q, hkv), k.transpose(-1, -2)).view(b, h, tq, tk)
        s = s.mul_(scale) if scale != 1.0 else s
        s = s.add_(bias.to(s.dtype))
        if hidden is not None:
            s = s.add_(hidden)
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=m.dtype, device=m.device))
        p = exp_(s.sub_(m))
        total = p.sum(dim=-1, keepdim=True)
        blind = total == 0
        total = torch.where(blind, torch.ones((), dtype=total.dtype, device=total.device), total)
        p = p.div_(total)
        out = torch.matmul(p.view(b, hkv, -1, tk), v).view(b, h, tq, v.shape[-1])
        lse = torch.where(blind, torch.full((), -math.inf, dtype=m.dtype, device=m.device), m + total.log())
        ctx.save_for_backward(q, k, v, p, out)
        ctx.scale = scale
        ctx.bias_shape = bias.shape
        ctx.bias_dtype = bias.dtype
        return out, lse.squeeze(-1)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, p, out = ctx.saved_tensors
        b, h, tq, _ = q.shape
        hkv, tk = k.shape[1], k.shape[2]
        dq = dk = dv = dbias = None
        if dout is None:
            dout = torch.zeros_like(out)
        delta = (dout * out).sum(dim=-1, keepdim=True)  # (B, H, Tq, 1)
        if dlse is not None:
            delta = delta - dlse[..., None].to(delta.dtype)
        do_rows = _rows(dout.to(p.dtype), hkv)
        if ctx.needs_input_grad[2]:
            dv = torch.matmul(p.view(b, hkv, -1, tk).transpose(-1, -2), do_rows).to(v.dtype)
        ds = torch.matmul(do_rows, v.transpose(-1, -2)).view(b, h, tq, tk)
        ds = ds.sub_(delta).mul_(p)  # dS = P ∘ (dP − δ + dℓ); 0 where hidden (P = 0) and on blind rows
        ds_rows = ds.view(b, hkv, -1, tk)
        if ctx.needs_input_grad[0]:
            dq = torch.matmul(ds_rows, k).view(q.shape).mul_(ctx.scale).to(q.dtype)
        if ctx.needs_input_grad[1]:
            dk = torch.matmul(ds_rows.transpose(-1, -2), _rows(q, hkv)).mul_(ctx.scale).to(k.dtype)
        if ctx.needs_input_grad[3]:
            dbias = ds.sum_to_size(ctx.bias_shape).to(ctx.bias_dtype)
        return dq, dk, dv, dbias, None, None


class _VendorBias(torch.autograd.Function):
    """A bias without a gradient: torch's fused kernel forward and backward, the bias as its attn_mask."""

    @staticmethod
    def forward(ctx, q, k, v, bias, seen, scale):
        out, lse = vendor.forward(q, k, v, bias, False, scale)
        if seen is not None:
            zero = torch.zeros((), dtype=out.dtype, device=out.device)
            out = torch.where(seen[..., None], out, zero)
            lse = torch.where(seen, lse, torch.full((), -math.inf, dtype=lse.dtype, device=lse.device))
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, bias, out, lse = ctx.saved_tensors
        blind = lse == -math.inf
        dout = torch.where(blind[..., None], torch.zeros((), dtype=dout.dtype, device=dout.device), dout)
        dq, dk, dv = vendor.backward(dout, q, k, v, out, lse, bias, False, ctx.scale)
        return dq, dk, dv, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    hidden: torch.Tensor | None,
    scale: float,
    *,
    seen: torch.Tensor | None = None,
    lse_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Tq, Dv) in q's dtype, lse (B, H, Tq) float32 at least) of canonical q (B, H, Tq, D),
    k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) with scores Q Kᵀ · scale + ``bias`` (float, broadcastable to
    (B, H, Tq, Tk)) + ``hidden`` (0 visible / −inf hidden, broadcastable, no gradient; or None).
    Gradients to q, k, v and — when it requires grad — the bias. Finite q, k, v only.

    A bias that requires no grad (and is finite), with no gradient wanted through the lse
    (``lse_grad=False``), runs on torch's fused kernel forward and backward (``seen``: bool broadcastable
    to (B, H, Tq), the rows ``hidden`` leaves a key, None = all); otherwise the large ops above."""
    if not bias.requires_grad and not lse_grad and all_finite(bias):
        c = vendor.compute_dtype(q.device, q.dtype)
        if vendor.unavailable(q.device, c) is None:
            full = bias.to(c) if hidden is None else bias.to(c) + hidden.to(c)
            qc, kc, vc = (t if t.dtype == c else t.to(c) for t in (q, k, v))
            out, lse = _VendorBias.apply(qc, kc, vc, full, seen, float(scale))
            return out.to(q.dtype), lse
    acc = torch.promote_types(q.dtype, torch.float32)
    qa, ka, va = (t if t.dtype == acc else t.to(acc) for t in (q, k, v))
    hid = None if hidden is None else hidden.to(acc)
    out, lse = _DenseBias.apply(qa, ka, va, bias, hid, float(scale))
    return out.to(q.dtype), lse
