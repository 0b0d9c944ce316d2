"""The vendor kernel: torch's own fused attention ops, which return the log-sum-exp.

On CPU, ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *,
attn_mask, scale) -> (output, logsumexp)`` and its ``..._backward`` are the kernel behind
``torch.nn.functional.scaled_dot_product_attention``: O(T) memory, vectorised, multi-threaded, grouped-query
heads without repeating K/V, an additive float mask, and the log-sum-exp that lets the engine merge calls
exactly (:mod:`selfattention.kernels.merge`). On CUDA the memory-efficient kernel
(``_scaled_dot_product_efficient_attention``) plays the same part.

What the vendor kernel is *not* asked to do (the engine sends those problems to
:mod:`selfattention.kernels.exact`, and :func:`unavailable` says why): inputs holding NaN/inf (a hidden NaN
key or value leaks into other rows through 0 · NaN), dropout (its mask cannot be replayed block by block),
the gradient of a float mask (the backward returns no dS), empty head dims, and dtypes or devices it lacks.
On CPU it computes bfloat16/float16 in float32: torch's fused CPU kernel in bfloat16 gives value gradients
2–3× as far from float64 as a naive bfloat16 computation, float32 is within it (this library's rule: ≤ 2×).

The kernel is used only with ``is_causal`` on square calls on the diagonal, where top-left and bottom-right
causal agree (the engine plans so). Every (device, dtype) is checked once against float64 math on a small
problem (mask, causal, grouped heads, Dv ≠ D) before it is trusted; a failure is a reason, not a crash.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as tnf

__all__ = ["forward", "backward", "unavailable", "compute_dtype"]

_CHECKED: dict[tuple[str, torch.dtype], str | None] = {}


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the vendor kernel computes in for inputs of ``dtype`` on ``device``."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def _cpu_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the vendor kernel serves ``dtype`` on ``device``, else the reason it does not."""
    key = (device.type, dtype)
    if key not in _CHECKED:
        _CHECKED[key] = _probe(device, dtype)
    return _CHECKED[key]


def _probe(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type == "cpu":
        if _cpu_op() is None:
            return f"this torch ({torch.__version__}) has no CPU flash-attention op"
    elif device.type == "cuda":
        if not hasattr(torch.ops.aten, "_scaled_dot_product_efficient_attention"):
            return f"this torch ({torch.__version__}) has no CUDA memory-efficient attention op"
        if dtype == torch.float64:
            return "the CUDA fused kernels have no float64"
    else:
        return f"no fused attention kernel is wired for device type {device.type!r}"
    try:
        # the check differentiates its float64 oracle: it must run with autograd on even when the first
        # call comes under no_grad / inference_mode (else the kernel would be judged broken for good)
        with torch.inference_mode(False), torch.enable_grad():
            err = _self_check(device, compute_dtype(device, dtype))
    except Exception as e:  # a missing feature of this build: a reason, not a crash
        return f"the fused kernel failed its self-check on {device.type}/{dtype}: {type(e).__name__}: {e}"
    if err is not None:
        return f"the fused kernel disagreed with float64 math on {device.type}/{dtype} ({err})"
    return None


def _self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Forward and backward of a small problem (float mask, causal, 4 query heads on 2 key/value heads,
    Dv ≠ D) against float64 math; returns a description of the first disagreement, or None."""
    gen = torch.Generator().manual_seed(1234)
    b, h, hk, t, d, dv = 2, 4, 2, 37, 16, 8
    q, k, v, do = (torch.randn(b, x, t, y, generator=gen) for x, y in ((h, d), (hk, d), (hk, dv), (h, dv)))
    bias = torch.randn(b, 1, 1, t, generator=gen)
    bias[0, ..., 5] = -math.inf
    scale = 0.3
    tol = {torch.float64: 1e-9, torch.float32: 2e-4}.get(dtype, 3e-2)
    for causal in (False, True):
        ins = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
        bi = bias.to(device=device, dtype=dtype)
        out, lse = forward(*ins, bi, causal, scale)
        dq, dk, dv_ = backward(do.to(device=device, dtype=dtype), *ins, out, lse, bi, causal, scale)
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        s = (q64 @ k64.repeat_interleave(2, 1).transpose(-1, -2)) * scale + bias.double()
        if causal:
            s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
        ref = torch.softmax(s, -1) @ v64.repeat_interleave(2, 1)
        ref.backward(do.double())
        checks = {
            "output": (out, ref),
            "log-sum-exp": (lse, torch.logsumexp(s, -1)),
            "query gradient": (dq, q64.grad),
            "key gradient": (dk, k64.grad),
            "value gradient": (dv_, v64.grad),
        }
        for name, (got, want) in checks.items():
            err = (got.detach().double().cpu() - want.detach()).abs().max().item()
            if not err <= tol * (1 + want.detach().abs().max().item()):
                return f"{name}{' (causal)' if causal else ''}: max error {err:.3g}"
    return None


def _pad_last(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[-1] == n else tnf.pad(t, (0, n - t.shape[-1]))


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, H, R, D) over k (B, Hkv, C, D), v (B, Hkv, C, Dv); ``bias`` float broadcastable
    to (B, H, R, C) (−inf hides) or None; ``causal`` only for R == C on the diagonal.

    Returns (out (B, H, R, Dv) in q's dtype, lse (B, H, R) float32 at least). A row whose every key the
    bias hides gets out = 0 and an lse that means nothing (the engine sets it to −inf).
    """
    d, dv = q.shape[-1], v.shape[-1]
    if q.numel() == 0 or k.numel() == 0:  # no heads, rows or keys: the fused op divides by zero (SIGFPE)
        heads = q.shape[:-1]
        return q.new_zeros((*heads, dv)), q.new_full(
            heads, -math.inf, dtype=torch.promote_types(q.dtype, torch.float32)
        )
    width = max(d, dv)
    q, k, v = _pad_last(q, width), _pad_last(k, width), _pad_last(v, width)
    if bias is not None and bias.dtype != q.dtype:
        bias = bias.to(q.dtype)
    if scale <= 0.0:  # the fused kernels scale masked (−inf) scores: 0 · −inf = NaN, −s · −inf = +inf
        q, scale = q * scale, 1.0  # so the scale goes into the query
    if q.device.type == "cpu":
        out, lse = _cpu_op()(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    else:
        out, lse = _cuda_forward(q, k, v, bias, causal, scale)
    return (out if width == dv else out[..., :dv]), lse


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one call given the *final* output and log-sum-exp of its rows (the rows'
    totals over every call: then the call's share of the gradient is exact, FlashAttention-2 Algorithm 2).
    Rows with lse = −inf (no visible key anywhere) must come with dout = 0."""
    d, dv = q.shape[-1], v.shape[-1]
    if q.numel() == 0 or k.numel() == 0:  # see forward
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    width = max(d, dv)
    q, k, v = _pad_last(q, width), _pad_last(k, width), _pad_last(v, width)
    dout, out = _pad_last(dout.to(q.dtype), width), _pad_last(out.to(q.dtype), width)
    if bias is not None and bias.dtype != q.dtype:
        bias = bias.to(q.dtype)
    folded = scale if scale <= 0.0 else None
    if folded is not None:  # as in forward: q' = q · scale, so dq = scale · dq'
        q, scale = q * folded, 1.0
    # a row that sees nothing: P = exp(S − (+inf)) = 0 (its dout is 0 too)
    lse = torch.where(lse == -math.inf, torch.full((), math.inf, dtype=lse.dtype, device=lse.device), lse)
    if q.device.type == "cpu":
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq, dk, dv_ = op(
            dout.contiguous(), q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=bias, scale=scale
        )
    else:
        dq, dk, dv_ = _cuda_backward(dout, q, k, v, out, lse, bias, causal, scale)
    if folded is not None:
        dq = dq * folded
    return dq[..., :d], dk[..., :d], dv_[..., :dv]


# ------------------------------------------------------------------------------------------------- CUDA
# The memory-efficient kernel: attn_bias, log-sum-exp (padded to a multiple of 32 rows), no native
# grouped heads (K/V heads are repeated for the call and their gradients summed back).


def _cuda_inputs(q, k, v, bias):
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if bias is not None:
        b, h, r, c = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        c16 = -(-c // 16) * 16  # the kernel wants the bias rows 16-aligned in memory
        full = bias.new_zeros(b, h, r, c16)[..., :c]
        full.copy_(bias.expand(b, h, r, c))
        bias = full
    return q.contiguous(), k.contiguous(), v.contiguous(), bias, group


def _cuda_forward(q, k, v, bias, causal, scale):
    q, k, v, bias, _ = _cuda_inputs(q, k, v, bias)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q.shape[2]].float()


def _cuda_backward(dout, q, k, v, out, lse, bias, causal, scale):
    hk = k.shape[1]
    q, k, v, bias, group = _cuda_inputs(q, k, v, bias)
    rows = q.shape[2]
    padded = -(-rows // 32) * 32
    lse_p = lse.new_zeros(*lse.shape[:-1], padded)
    lse_p[..., :rows] = lse
    empty = torch.empty((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, k, v, bias, out.contiguous(), lse_p, empty, empty, 0.0,
        [True, True, True, False], causal, scale=scale,
    )  # fmt: skip
    if group > 1:
        dk = dk.unflatten(1, (hk, group)).sum(2)
        dv = dv.unflatten(1, (hk, group)).sum(2)
    return dq, dk, dv
