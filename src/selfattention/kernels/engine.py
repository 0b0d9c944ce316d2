"""The block engine: a :class:`~selfattention.kernels.plan.Plan` executed by one block kernel, forward and
backward, with the log-sum-exp merge, and an autograd function around it.

Everything here works on the canonical layout: query (B, H, Tq, D), key (B, Hkv, Tk, D), value
(B, Hkv, Tk, Dv) with H a multiple of Hkv (grouped-query heads: query head h uses key/value head h // G),
and a :class:`~selfattention.visibility.Visibility` whose mask is 4-D. :mod:`selfattention.tiled` turns the
public arguments into this form.

Kernel choice (:func:`choose_kernel`): the vendor kernel (:mod:`.vendor`) unless the problem needs what
only the exact kernel (:mod:`.exact`) offers — the reason is returned, shown by ``selfattention bench``,
never a silent change of results.

Backward: every call's share of the gradient comes from the final output and log-sum-exp of its rows, so
the calls are independent (FlashAttention-2, Algorithm 2; ring-flash-attention does the same per ring
step). The log-sum-exp is differentiable too (a loss that uses it, attention sinks): dS = P ∘ (dO Vᵀ − δ +
dℓ), passed to both kernels as one more value column. Double backward (``create_graph=True``) recomputes
through the spec: exact, O(T²) memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .._validation import all_finite as _finite
from .._validation import batched, symbolic
from ..visibility import Visibility
from . import band, call_ops, exact, row_chunks, vendor
from .exact import Dropout
from .plan import Plan, band_options, make_plan

__all__ = ["Problem", "choose_kernel", "make_problem", "forward", "backward", "attention", "KERNELS"]

KERNELS = ("vendor", "exact")


@dataclass
class Problem:
    """One attention problem, planned: what the forward and the backward both need."""

    vis: Visibility
    scale: float
    plan: Plan
    kernel: str
    reason: str
    compute: torch.dtype  # dtype the kernel computes in
    dropout: Dropout | None = None
    mask_grad: bool = False
    exact_block_q: int = 256
    exact_block_k: int = 1024
    # the inputs were not scanned (no autograd): a call that met NaN/inf is redone on the exact kernel
    verify: bool = False


NON_FINITE = "inputs hold NaN/inf (a fused kernel lets a hidden NaN leak through 0 · NaN)"


def choose_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    vis: Visibility,
    *,
    dropout_p: float = 0.0,
    mask_grad: bool = False,
    kernel: str | None = None,
    defer_kv: bool = False,
) -> tuple[str, str]:
    """(kernel name, why). ``kernel=None`` picks the vendor kernel whenever it can serve the problem;
    ``"vendor"`` raises ``ValueError`` with the reason when it cannot; ``"exact"`` is always possible.

    ``defer_kv`` (only with ``kernel=None``, for calls without autograd): query, keys and values are not
    scanned for NaN/inf here — an O(T) pass per call, which costs more than the kernel at small T and per
    decode step — because a fused result that touched one is either not finite (NaN · 0 = NaN, +inf scores
    give NaN) or a row that comes back as "sees nothing" although it may see keys (the fused kernel drops
    NaN scores: a NaN query row); the engine checks every call's result for both and recomputes on the
    exact kernel."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS} or None, got {kernel!r}")
    if kernel == "exact":
        return "exact", "asked for"
    why = None
    mask = vis.attn_mask
    if not (defer_kv and kernel is None or (_finite(query) and _finite(key) and _finite(value))):
        why = NON_FINITE
    elif mask is not None and mask.is_floating_point() and bool((mask == math.inf).any()):
        why = "the float mask holds +inf"
    elif dropout_p > 0.0:
        why = "dropout (its mask is replayed tile by tile in the backward)"
    elif mask_grad:
        why = "the float mask requires grad (fused backwards return no dS)"
    elif query.shape[-1] == 0 or value.shape[-1] == 0:
        why = "an empty head_dim"
    else:
        why = vendor.unavailable(query.device, query.dtype)
    if why is None:
        return "vendor", "fused kernel"
    if kernel == "vendor":
        raise ValueError(f"kernel='vendor' cannot serve this problem: {why}")
    return "exact", why


def make_problem(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    vis: Visibility,
    scale: float,
    *,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    mask_grad: bool = False,
    kernel: str | None = None,
    block_q: int = 128,
    block_k: int = 512,
    defer_kv: bool = False,
) -> Problem:
    """Choose the kernel and plan the calls (canonical 4-D inputs, see the module docstring).
    ``defer_kv``: see :func:`choose_kernel` (never with dropout or a mask gradient)."""
    defer_kv = defer_kv and kernel is None and dropout_p == 0.0 and not mask_grad
    name, reason = choose_kernel(
        query, key, value, vis, dropout_p=dropout_p, mask_grad=mask_grad, kernel=kernel, defer_kv=defer_kv
    )
    compute = torch.promote_types(query.dtype, torch.float32)
    if name == "vendor":
        compute = vendor.compute_dtype(query.device, query.dtype)
    dropout = None
    if dropout_p > 0.0:
        seed = int(torch.randint(0, 2**62, (), device="cpu")) if dropout_seed is None else int(dropout_seed)
        dropout = Dropout(dropout_p, seed)
    plan = make_plan(
        vis, block_q, block_k, every_tile=mask_grad, **band_options(query.device.type, name, block_q)
    )
    return Problem(
        vis=vis,
        scale=scale,
        plan=plan,
        kernel=name,
        reason=reason,
        compute=compute,
        dropout=dropout,
        mask_grad=mask_grad,
        exact_block_q=max(block_q, 64),
        exact_block_k=max(block_k, 256),
        verify=defer_kv and name == "vendor",
    )


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prob: Problem
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Tq, Dv), lse (B, H, Tq)) in the compute dtype; rows that see no key: 0 and −inf."""
    b, h, tq, _ = q.shape
    calls = prob.plan.calls
    if len(calls) == 1 and calls[0].count == 1 and (calls[0].r0, calls[0].rows) == (0, tq):
        # one call over every row (dense, plain causal, a mask that skips nothing): its result is the result
        call = calls[0]
        ((qv, kv, vv, _),) = call_ops.call_views(call, q, k, v)
        o, l = call_ops.kernel_forward(
            prob, call, qv, kv, vv, call_ops.tile(prob, call, q.device) if call.tile else None
        )
        return o, (l if l.dtype == q.dtype else l.to(q.dtype))
    if all(c.count == 1 and not c.tile for c in calls) and all(
        a.r1 <= c.r0 for a, c in zip(calls, calls[1:], strict=False)
    ):
        return _concatenated(prob, q, k, v)
    chunks = row_chunks.chunked(prob, q)
    if chunks is not None:  # many calls on CPU: chunks of rows on single-threaded workers
        return row_chunks.forward_chunks(prob, q, k, v, chunks)
    # not zero-filled: every row is written by its first call, and the rows of no call are filled there
    out = q.new_empty((b, h, tq, v.shape[-1]))
    lse = q.new_empty((b, h, tq))
    row_chunks.run_calls(prob, calls, q, k, v, out, lse, 0, tq)
    return out, lse


def _concatenated(
    prob: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward` for calls on disjoint row ranges in order, none with a bias tile (one call per
    document): the results are concatenated along the rows (rows of no call: 0 and −inf) in one copy,
    and the fused results' NaN/inf check (``prob.verify``) runs once over every covered row — each torch
    op costs a parallel region, and a zero fill, a write per call and a check per call cost more than
    the short calls' own work on a busy machine. Without a bias every row of a call sees a key."""
    b, h, tq, _ = q.shape
    dv = v.shape[-1]
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    at, gaps = 0, False
    for call in prob.plan.calls:
        if call.r0 > at:
            gaps = True
            outs.append(q.new_zeros((b, h, call.r0 - at, dv)))
            lses.append(q.new_full((b, h, call.r0 - at), -math.inf))
        ((qv, kv, vv, _),) = call_ops.call_views(call, q, k, v)
        o, l = call_ops.kernel_forward(prob, call, qv, kv, vv, None, check=False)
        outs.append(o)
        lses.append(l.to(q.dtype))
        at = call.r1
    if tq > at:
        gaps = True
        outs.append(q.new_zeros((b, h, tq - at, dv)))
        lses.append(q.new_full((b, h, tq - at), -math.inf))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
    if prob.kernel == "vendor" and prob.verify:
        if gaps:
            covered = torch.zeros(tq, dtype=torch.bool, device=q.device)
            for call in prob.plan.calls:
                covered[call.r0 : call.r1] = True
            call_ops.verify(out[:, :, covered], lse[:, :, covered], None)
        else:
            call_ops.verify(out, lse, None)
    return out, lse


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    prob: Problem,
    mask: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq, dk, dv, dmask) in the compute dtype; ``dmask`` (the shape of ``mask``, the canonical 4-D float
    mask) only when the problem has ``mask_grad``. ``dlse`` (B, H, Tq): the gradient reaching the
    log-sum-exp as well (then dS = P ∘ (dO Vᵀ − δ + dℓ))."""
    b = q.shape[0]
    blind = lse == -math.inf
    if bool(blind.any()):
        dout = torch.where(blind[..., None], torch.zeros((), dtype=dout.dtype, device=dout.device), dout)
    if dlse is not None:
        # both kernels take δ = rowsum(dO ∘ O): one more value column (0) with dO = 1 and O = −dℓ turns
        # it into δ − dℓ, which is the gradient through ℓ (∂ℓᵢ/∂sᵢⱼ = Pᵢⱼ); that column's dV is dropped
        dv_width = v.shape[-1]
        dl = torch.where(blind, torch.zeros((), dtype=dlse.dtype, device=dlse.device), dlse)
        v = torch.cat([v, v.new_zeros((*v.shape[:-1], 1))], dim=-1)
        out = torch.cat([out, -dl.to(out.dtype)[..., None]], dim=-1)
        dout = torch.cat([dout, (~blind).to(dout.dtype)[..., None]], dim=-1)
        dq, dk, dv, dmask = backward(dout, q, k, v, out, lse, prob, mask)
        return dq, dk, dv[..., :dv_width], dmask
    calls = prob.plan.calls
    if (
        prob.kernel == "vendor"
        and len(calls) == 1
        and calls[0].count == 1
        and (calls[0].r0, calls[0].rows, calls[0].c0, calls[0].cols) == (0, q.shape[2], 0, k.shape[2])
    ):  # one call over everything: its gradients are the gradients (no zero-filled copies to add into)
        call = calls[0]
        gq, gk, gv = vendor.backward(
            dout, q, k, v, out, lse, call_ops.tile(prob, call, q.device), call.causal, prob.scale
        )
        return gq, gk, gv, None
    chunks = None if prob.mask_grad else row_chunks.chunked(prob, q)
    if chunks is not None:  # many calls on CPU: chunks of rows on single-threaded workers
        return (*row_chunks.backward_chunks(prob, calls, dout, q, k, v, out, lse, chunks), None)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dmask = None
    if prob.mask_grad and mask is not None:
        dmask = torch.zeros(mask.shape, dtype=prob.compute, device=q.device)
    for call in band.backward_calls(prob, dout, q, k, v, out, lse, dq, dk, dv):
        bias = call_ops.tile(prob, call, q.device)
        rows = slice(call.r0, call.r1)
        dbias = None if dmask is None or bias is None else torch.zeros_like(bias)
        for qv, kv, vv, heads in call_ops.call_views(call, q, k, v):
            sub = call_ops.stack_rows(call, dout[:, heads, rows], out[:, heads, rows], lse[:, heads, rows])
            if prob.kernel == "vendor":
                gq, gk, gv = vendor.backward(*sub[:1], qv, kv, vv, *sub[1:], bias, call.causal, prob.scale)
            else:
                drop = None if prob.dropout is None else prob.dropout.at(call.r0, call.c0)
                gq, gk, gv = exact.backward(
                    sub[0], qv, kv, vv, sub[1], sub[2], bias, call.causal, prob.scale, dropout=drop, dbias=dbias,
                    block_q=prob.exact_block_q, block_k=prob.exact_block_k,
                )  # fmt: skip
            dq[:, heads, rows] += call_ops.unstack(call, gq, b)
            call_ops.fold(call, gk, b, dk)
            call_ops.fold(call, gv, b, dv)
        if dbias is not None:
            ms = dmask[..., rows if dmask.shape[-2] != 1 else slice(None), call_ops.cols_of(call, dmask)]
            ms += dbias.sum_to_size(ms.shape)
    return dq, dk, dv, dmask


# ---------------------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------------------


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when each row (last dim) is dense and nothing is broadcast (a (B, T, H, D) view seen as
    (B, H, T, D), a slice of a KV cache), else a contiguous copy: the fused kernels take such strides as
    they are, and copying a cache's keys on every decode step costs more than the attention."""
    if t.is_contiguous():
        return t
    dense = t.stride(-1) == 1 and all(st > 0 for st, n in zip(t.stride(), t.shape, strict=True) if n > 1)
    return t if dense else t.contiguous()


def _checked_forward(q, k, v, prob: Problem) -> tuple[torch.Tensor, torch.Tensor, Problem]:
    """:func:`forward` in the compute dtype, with the deferred NaN/inf check of ``prob.verify``; returns the
    problem that produced the result (the exact kernel's when the fused result had to be recomputed)."""
    c = prob.compute
    try:  # with prob.verify, call_ops.kernel_forward checks every call's result and raises call_ops.NotFinite
        qc, kc, vc = (t if t.dtype == c else t.to(c) for t in (q, k, v))
        out, lse = forward(_dense_rows(qc), _dense_rows(kc), _dense_rows(vc), prob)
    except call_ops.NotFinite:
        # the inputs held NaN/inf (see choose_kernel): recompute on the exact kernel
        c = torch.promote_types(q.dtype, torch.float32)
        prob = replace(prob, kernel="exact", reason=NON_FINITE, compute=c, verify=False)
        out, lse = forward(q.to(c).contiguous(), k.to(c).contiguous(), v.to(c).contiguous(), prob)
    return out, lse, prob


class _Attention(torch.autograd.Function):
    """Forward and backward through the engine; saves q, k, v, the output and the log-sum-exp only."""

    @staticmethod
    def forward(ctx, q, k, v, mask, prob):  # type: ignore[override]
        out, lse, prob = _checked_forward(q, k, v, prob)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.prob = prob
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        q, k, v, mask, out, lse = ctx.saved_tensors
        prob: Problem = ctx.prob
        if dout is None:  # only the log-sum-exp reaches the loss
            dout = out.new_zeros(out.shape)
        # create_graph=True, or a batched backward (is_grads_batched, torch.func): the spec's differentiable
        # math, exact (the fused kernels have neither a derivative nor a batching rule)
        if torch.is_grad_enabled() or symbolic() or batched(dout):
            if dlse is not None and (batched(dlse) or bool(dlse.any())):
                raise RuntimeError(
                    "double or batched backward through the log-sum-exp of the block engine is not supported"
                )
            return (*_spec_grads(ctx, q, k, v, mask, dout), None)
        if dlse is not None and not bool(dlse.any()):
            dlse = None
        c = prob.compute
        dq, dk, dv, dmask = backward(
            dout.to(c).contiguous(), q.to(c).contiguous(), k.to(c).contiguous(), v.to(c).contiguous(),
            out, lse, prob, mask, None if dlse is None else dlse.to(lse.dtype),
        )  # fmt: skip
        if dmask is not None and mask is not None:
            dmask = dmask.to(mask.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask, None


def _spec_grads(ctx, q, k, v, mask, dout):
    from ..functional import attention_steps

    prob: Problem = ctx.prob
    if prob.dropout is not None:
        raise RuntimeError(
            "double backward (create_graph=True) through attention with dropout is not supported: the "
            "dropout mask of the first backward cannot be replayed by the spec; use dropout_p=0"
        )
    vis = prob.vis if mask is None else replace(prob.vis, attn_mask=mask)
    if vis.mod is not None or vis.doc_offset is not None:  # programmable parts: the spec gets them dense
        vis = Visibility(vis.q_len, vis.k_len, attn_mask=vis.dense_bias(q.dtype, q.device))
    inputs = [t for t in (q, k, v, mask) if t is not None]
    with torch.enable_grad():
        out = attention_steps(q, k, v, attn_mask=vis, scale=prob.scale, enable_gqa=True).context
        needed = [t for t in inputs if t.requires_grad]
        grads = torch.autograd.grad(out, needed, dout, create_graph=True, allow_unused=True)
    it = iter(grads)
    res = [next(it) if t.requires_grad else None for t in inputs]
    if mask is None:
        res.append(None)
    return res


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prob: Problem,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Tq, Dv) in query's dtype, lse (B, H, Tq)) with autograd. ``mask`` is the canonical
    float mask when its gradient is wanted (it must be ``prob.vis.attn_mask``), else None."""
    if not (
        torch.is_grad_enabled()
        and (
            query.requires_grad
            or key.requires_grad
            or value.requires_grad
            or (mask is not None and mask.requires_grad)
        )
    ):
        out, lse, _ = _checked_forward(query, key, value, prob)  # no graph to record: no autograd.Function
        return (out if out.dtype == query.dtype else out.to(query.dtype)), lse
    return _Attention.apply(query, key, value, mask, prob)
