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
causal agree (the engine plans so). Every (device, dtype) — the device with its index: two GPUs are two
checks — is checked once against float64 math on a small problem (mask, causal, grouped heads, Dv ≠ D)
before it is trusted; a failure is a reason, not a crash. The check runs no autograd (the float64
gradients are written out), never inside graph capture, ``torch.compile``, tracing or a ``torch.func``
transform (the kernel is trusted there and checked at the next ordinary call), and a check that *raised* (an out-of-memory, a
driver hiccup) is retried after :data:`RETRY_SECONDS`; each failure warns with its reason.
"""

from __future__ import annotations

import math
import time
import warnings

import torch
import torch.nn.functional as tnf

__all__ = ["forward", "backward", "unavailable", "compute_dtype", "RETRY_SECONDS"]

#: A self-check that raised (rather than disagreed) is tried again after this many seconds.
RETRY_SECONDS = 60.0

# (device type, device index, dtype) -> (reason or None, retry at: time.monotonic() value, or None = final)
_CHECKED: dict[tuple[str, int | None, torch.dtype], tuple[str | None, float | None]] = {}


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the vendor kernel computes in for inputs of ``dtype`` on ``device``."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def _cpu_op():
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _device_key(device: torch.device) -> tuple[str, int | None]:
    index = device.index
    if index is None and device.type == "cuda" and torch.cuda.is_available():
        index = torch.cuda.current_device()
    return device.type, index


def _capturing() -> bool:
    """Inside torch.compile / export tracing, torch.jit tracing, a torch.func transform or a CUDA graph
    capture."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    if torch._C._are_functorch_transforms_active():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the vendor kernel serves ``dtype`` on ``device``, else the reason it does not."""
    key = (*_device_key(device), dtype)
    hit = _CHECKED.get(key)
    if hit is not None and (hit[1] is None or time.monotonic() < hit[1]):
        return hit[0]
    static = _static_reason(device, dtype)
    if static is not None:
        _CHECKED[key] = (static, None)
        return static
    if _capturing():  # no check inside a capture: trusted now, checked at the next ordinary call
        return None
    try:
        with torch.no_grad():
            err = _self_check(device, compute_dtype(device, dtype))
    except Exception as e:  # a missing feature of this build, or a transient failure: retried later
        why = f"the fused kernel failed its self-check on {device}/{dtype}: {type(e).__name__}: {e}"
        _CHECKED[key] = (why, time.monotonic() + RETRY_SECONDS)
        warnings.warn(
            f"{why}; the exact kernel serves these calls, the check is retried in {RETRY_SECONDS:g} s",
            RuntimeWarning,
            stacklevel=2,
        )
        return why
    why = None
    if err is not None:
        why = f"the fused kernel disagreed with float64 math on {device}/{dtype} ({err})"
        warnings.warn(f"{why}; the exact kernel serves these calls", RuntimeWarning, stacklevel=2)
    _CHECKED[key] = (why, None)
    return why


def _static_reason(device: torch.device, dtype: torch.dtype) -> str | None:
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
    return None


def _reference(q, k, v, do, bias, causal, scale, group):
    """float64 output, log-sum-exp and gradients of softmax(q kᵀ·scale + bias) v, written out (no autograd):
    dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O)), dQ = scale · dS K, dK = scale · dSᵀ Q (Dao 2023, Alg. 2)."""
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ kr.transpose(-1, -2)) * scale + bias
    if causal:
        t = s.shape[-1]
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    out = p @ vr
    ds = p * (do @ vr.transpose(-1, -2) - (do * out).sum(-1, keepdim=True))
    dq = (ds @ kr) * scale
    dk = ((ds.transpose(-1, -2) @ q) * scale).unflatten(1, (k.shape[1], group)).sum(2)
    dv = (p.transpose(-1, -2) @ do).unflatten(1, (k.shape[1], group)).sum(2)
    return out, lse, dq, dk, dv


def _self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Forward and backward of a small problem (float mask, causal, 4 query heads on 2 key/value heads,
    Dv ≠ D) against float64 math; returns a description of the first disagreement, or None."""
    gen = torch.Generator().manual_seed(1234)
    b, h, hk, t, d, dv = 2, 4, 2, 37, 16, 8
    q, k, v, do = (
        torch.randn(b, x, t, y, generator=gen, dtype=torch.float64)
        for x, y in ((h, d), (hk, d), (hk, dv), (h, dv))
    )
    bias = torch.randn(b, 1, 1, t, generator=gen, dtype=torch.float64)
    bias[0, ..., 5] = -math.inf
    scale = 0.3
    tol = {torch.float64: 1e-9, torch.float32: 2e-4}.get(dtype, 3e-2)
    for causal in (False, True):
        ins = [x.to(device=device, dtype=dtype) for x in (q, k, v)]
        bi = bias.to(device=device, dtype=dtype)
        out, lse = forward(*ins, bi, causal, scale)
        dq, dk, dv_ = backward(do.to(device=device, dtype=dtype), *ins, out, lse, bi, causal, scale)
        want = _reference(q, k, v, do, bias, causal, scale, h // hk)
        names = ("output", "log-sum-exp", "query gradient", "key gradient", "value gradient")
        for name, got, ref in zip(names, (out, lse, dq, dk, dv_), want, strict=True):
            err = (got.double().cpu() - ref).abs().max().item()
            if not err <= tol * (1 + ref.abs().max().item()):
                return f"{name}{' (causal)' if causal else ''}: max error {err:.3g}"
    return None


def _pad_last(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` with its last dim zero-padded to ``n``, and with unit stride there: torch 2.13's fused CPU
    kernels read a row of q, k, v, dout or out as contiguous and give wrong numbers (forward and backward,
    no error) for a view whose last dim has another stride (keys made as (B, H, D, T).transpose(-1, -2))."""
    if t.shape[-1] != n:
        return tnf.pad(t, (0, n - t.shape[-1]))
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


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
    lse = lse.nan_to_num(nan=math.nan, posinf=math.inf, neginf=math.inf)  # (one op: −inf → +inf)
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
