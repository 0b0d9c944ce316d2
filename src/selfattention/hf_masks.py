"""The engine route of :mod:`selfattention.hf`: one attention call of a transformers model under a
:class:`~selfattention.visibility.Visibility` (from the lazy mask of :mod:`selfattention.hf_recipe`) on the
block engine — no dense (B, H, Tq, Tk) mask, no sink column.

:func:`engine_attention` picks the cheapest exact route: one fused vendor call for plain and small calls,
the biased large-op problem for a position bias that wants its gradient, the score-mod kernel for
soft-capping, the block plan otherwise. The mask function and :class:`LazyMask` live in
:mod:`selfattention.hf_recipe` and are re-exported here.
"""

from __future__ import annotations

import math

import torch

from ._validation import all_finite
from .hf_recipe import LazyMask, mask_function, recognise
from .visibility import Visibility

__all__ = ["SMALL", "LazyMask", "engine_attention", "mask_function", "recognise", "vendor_dtype"]


def engine_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    vis: Visibility,
    scale: float | None,
    *,
    dropout_p: float = 0.0,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    cache: dict | None = None,
) -> torch.Tensor:
    """(B, H, Tq, Dv) attention of canonical query (B, H, Tq, D), key/value (B, Hkv, Tk, ·) under ``vis``,
    on the block engine (:mod:`selfattention.kernels.engine`), with autograd:

    * ``softcap``: :func:`selfattention.mods.softcap` as a score mod (:mod:`selfattention.kernels.scored`,
      per query block), no (Tq, Tk) score tensor;
    * ``position_bias`` (broadcastable (B, H, Tq, Tk), given dense by the model): with no gradient wanted,
      the bias (with the mask's −inf) goes to the vendor kernel in one call, as transformers' sdpa does;
      otherwise a float bias of the engine, which returns its gradient when it requires one
      (``mask_grad``);
    * ``sinks``: sink logits per head (H,) (gpt-oss' ``s_aux``) or per query (B or 1, H, Tq or 1, 1):
      out · σ(lse − sink) (:func:`selfattention.mods.attention_sink`), no mask column, no (Tq, Tk + 1)
      tensor; gradients reach the sinks through the log-sum-exp.
    """
    from .kernels import engine, scored
    from .mods import attention_sink
    from .mods import softcap as softcap_mod

    s = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    if (
        softcap is None
        and position_bias is None
        and sinks is None
        and (not vis.restricts or _plain_causal(vis))
    ):
        # nothing hidden, or causal on the diagonal: without autograd one fused call, checked once (the
        # per-call cost of a layer at small T); else the backend's plain call (validated plans reused)
        if dropout_p == 0.0 and not _wants_grad(query, key, value):
            out = _plain_call(query, key, value, vis.is_causal, s)
            if out is not None:
                return out
        from .backends import scaled_dot_product_attention

        gqa = key.shape[-3] != query.shape[-3]
        return scaled_dot_product_attention(
            query, key, value, dropout_p=dropout_p, is_causal=vis.is_causal, scale=s, enable_gqa=gqa,
            backend="tiled",
        )  # fmt: skip
    fused = softcap is None and dropout_p == 0.0 and not _wants_grad(query, key, value, position_bias)
    small = vis.q_len * vis.k_len <= SMALL and vis.restricts and not _plain_causal(vis)
    if fused and (position_bias is not None or small):
        out, lse = _dense_bias_call(query, key, value, vis, position_bias, s, cache)
        return out if sinks is None else attention_sink(out, lse, sinks)
    if (
        position_bias is not None
        and softcap is None
        and dropout_p == 0.0
        and _dense_finite(position_bias, query, key, value)
    ):
        # a dense bias with a gradient wanted: O(Tq · Tk) memory anyway, so one problem of large ops
        # (kernels.biased: the bias's gradient is dS itself) or one fused call, not a block plan
        from .kernels import biased

        hidden, seen = _cached_hidden(vis, vendor_dtype(query), query.device, cache)
        out, lse = biased.attention(
            query, key, value, position_bias, hidden, s, seen=seen, lse_grad=sinks is not None
        )
        return out if sinks is None else attention_sink(out, lse, sinks)
    if position_bias is not None:
        bias = position_bias
        while bias.dim() < 4:
            bias = bias.unsqueeze(0)
        vis = vis.with_mask(bias)
    mask = vis.attn_mask
    if mask is not None and mask.dim() == 4 and mask.shape[0] not in (1, query.shape[0]):
        raise ValueError(
            f"attention_mask batch {mask.shape[0]} is neither 1 nor the query's {query.shape[0]}"
        )
    mask_grad = (
        mask is not None and mask.is_floating_point() and mask.requires_grad and torch.is_grad_enabled()
    )
    if softcap is not None:
        out, lse, _ = scored.attention(query, key, value, vis, s, softcap_mod(softcap))
    else:
        prob = engine.make_problem(query, key, value, vis, s, dropout_p=dropout_p, mask_grad=mask_grad)
        out, lse = engine.attention(query, key, value, prob, mask if mask_grad else None)
    if sinks is not None:
        out = attention_sink(out, lse, sinks)
    return out


SMALL = 1 << 18
"""Tq · Tk up to which a masked call without gradients is one vendor call with its dense bias (512²: at
most 1 MiB of float32 per batch entry and head group), which beats a plan of several calls there."""


def _plain_causal(vis: Visibility) -> bool:
    """Causal on the diagonal only (the engine's single fused causal call)."""
    return (
        vis.is_causal and vis.window is None and vis.attn_mask is None and vis.q_doc is None and vis.mod is None
        and vis.offset == 0 and vis.q_len == vis.k_len
    )  # fmt: skip


def _plain_call(query, key, value, causal: bool, scale: float) -> torch.Tensor | None:
    """One vendor-kernel call without a mask (``causal``: on the diagonal, Tq == Tk), or None when the
    kernel does not serve these inputs or one of them holds a NaN/inf — then the engine, which handles
    them exactly, computes the call."""
    from .kernels import pool, vendor

    c = vendor.compute_dtype(query.device, query.dtype)
    if vendor.unavailable(query.device, c) is not None or query.numel() == 0 or key.numel() == 0:
        return None
    if torch.compiler.is_compiling():
        return None
    # finite inputs: the fused kernel is exact (a NaN/inf query row would come back as out 0, a non-finite
    # key or value may leak through 0 · NaN). Checked before the call, while the inputs are in the
    # caches and the kernel has not yet streamed them out (each op right after it costs several times more);
    # on this thread alone: three parallel sums would each wait for a core another process keeps busy
    with pool.serial():
        finite = math.isfinite(query.sum().add_(key.sum()).add_(value.sum()).item())
    if not finite:
        return None
    out, _ = vendor.forward(
        *(t if t.dtype == c else t.to(c) for t in (query, key, value)), None, causal, scale
    )
    return out if out.dtype == query.dtype else out.to(query.dtype)


def _wants_grad(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _dense_bias_call(
    query, key, value, vis: Visibility, position_bias, scale: float, cache: dict | None = None
):
    """One vendor-kernel call with the whole dense bias (the model's position bias plus the mask's −inf, one
    (B, H, Tq, Tk) sum, as transformers' sdpa forms): (out, lse). Rows that see no key get out 0 and lse
    −inf; a non-finite result (NaN/inf inputs, which the fused kernel may leak) is recomputed on the
    engine, which handles them exactly."""
    from .kernels import engine, vendor

    c = vendor.compute_dtype(query.device, query.dtype)
    hidden, seen = _cached_hidden(vis, c, query.device, cache)
    bias = hidden if position_bias is None else _summed_bias(position_bias, hidden, c)
    while bias is not None and bias.dim() < 4:
        bias = bias.unsqueeze(0)
    if vendor.unavailable(query.device, c) is None:
        out, lse = vendor.forward(*(t.to(c) for t in (query, key, value)), bias, False, scale)
        if seen is not None:
            out, lse = torch.where(seen[..., None], out, 0.0), torch.where(seen, lse, -math.inf)
        # one synchronisation: a finite output and no NaN lse (−inf marks a row that sees nothing; the
        # clamp keeps it finite and a NaN NaN, and a +inf lse counts as not finite, as a NaN)
        if math.isfinite(out.sum().add_(lse.clamp(min=-1e20).sum()).item()):
            return out.to(query.dtype), lse
    full = vis if bias is None else vis.with_mask(bias)
    return engine.attention(query, key, value, engine.make_problem(query, key, value, full, scale))


def _summed_bias(position_bias: torch.Tensor, hidden: torch.Tensor | None, c: torch.dtype) -> torch.Tensor:
    """The position bias plus the mask's −inf as one contiguous tensor in ``c``.

    T5 hands every layer a permuted view of its (Tq, Tk, H) embedding lookup; the fused CPU kernel copies
    a bias that is not contiguous on every call, at twice the cost of a plain copy (measured at H = 4,
    T = 256: 474 µs a call against 314 with a contiguous bias; the copy alone 83 µs), and an element-wise
    sum keeps the permuted layout, so the sum is written into a contiguous tensor. Made on every call:
    a sum kept for the stack's later layers would go stale when user code edits the shared bias in ways
    no version counter sees (through ``.data``, or under ``torch.inference_mode``)."""
    if hidden is None:
        return position_bias.to(c).contiguous()
    shape = torch.broadcast_shapes(position_bias.shape, hidden.shape)
    return torch.add(position_bias, hidden, out=hidden.new_empty(shape))


def vendor_dtype(query: torch.Tensor) -> torch.dtype:
    from .kernels import vendor

    return vendor.compute_dtype(query.device, query.dtype)


def _dense_finite(bias: torch.Tensor, query, key, value) -> bool:
    """A float bias given for every (query, key) pair — (…, Tq, Tk), not a key-only or per-head
    broadcast — with finite query, key and value (the engine guards non-finite ones)."""
    return (
        bias.is_floating_point()
        and bias.dim() == 4
        and bias.shape[-2:] == (query.shape[-2], key.shape[-2])
        and all_finite(query)
        and all_finite(key)
        and all_finite(value)
    )


def _cached_hidden(vis: Visibility, c: torch.dtype, device: torch.device, cache: dict | None):
    """:func:`_hidden`, once per LazyMask (the layers of one forward share it)."""
    got = None if cache is None else cache.get((c, device))
    if got is None:
        got = _hidden(vis, c, device)
        if cache is not None:
            cache[(c, device)] = got
    return got


def _hidden(vis: Visibility, c: torch.dtype, device: torch.device):
    """(the mask as a dense bias: 0 visible, −inf hidden, key-only stays (b, 1, 1, Tk); or None) and (the
    rows that see a key, bool broadcastable to (B, H, Tq); None = all)."""
    hidden = vis.dense_bias(c, device)
    if hidden is None:
        return None, None
    if vis.attn_mask is None and vis.q_doc is None and vis.mod is None:  # causal/window: from the structure
        lo, hi = vis.rows_seen()
        rows = torch.arange(vis.q_len, device=device)
        return hidden, None if (lo, hi) == (0, vis.q_len) else ((rows >= lo) & (rows < hi)).view(1, 1, -1)
    return hidden, torch.isfinite(hidden).any(dim=-1)  # (b, h, Tq): rows with at least one visible key
