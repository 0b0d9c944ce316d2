"""Dispatch: one registry of attention backends, one signature, no silent fallback.

Every backend is a callable with the signature of :func:`selfattention.functional.scaled_dot_product_attention`
(the spec) and the same semantics (bool mask True = attend, bottom-right causal, zeros and zero gradient
for a query with no visible key, hidden NaN/inf never leaks). Each is tested against the float64 spec.

=============  ==============================================================================================
name           what it runs
=============  ==============================================================================================
reference      :func:`selfattention.functional.attention_steps`: materialises the scores (the spec)
torch          ``torch.nn.functional.scaled_dot_product_attention``, with this library's semantics bridged
tiled          :func:`selfattention.tiled.tiled_attention`: the block engine on torch's fused kernels
=============  ==============================================================================================

Choosing: pass ``backend="name"`` to :func:`scaled_dot_product_attention` or to a module. An unknown name
raises ``ValueError`` listing the registered ones. This module owns the registry; other modules register
through :func:`register_backend`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from . import functional as F
from . import ops
from ._validation import all_finite, autocast_cast, autocast_dtype, check_bool, parse_attention, symbolic
from .kernels import vendor
from .tiled import tiled_attention
from .visibility import Visibility

__all__ = [
    "register_backend",
    "get_backend",
    "available_backends",
    "scaled_dot_product_attention",
    "torch_sdpa",
]

Backend = Callable[..., torch.Tensor]
_REGISTRY: dict[str, Backend] = {}


def register_backend(name: str, fn: Backend, *, overwrite: bool = False) -> None:
    """Register ``fn`` under ``name``. Raises ``ValueError`` if taken (unless ``overwrite``)."""
    if not isinstance(name, str) or not name:
        raise ValueError("backend name must be a non-empty string")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"backend {name!r} is already registered")
    _REGISTRY[name] = fn


def available_backends() -> list[str]:
    """Names of the registered backends, sorted.

    >>> available_backends()
    ['reference', 'tiled', 'torch']
    """
    return sorted(_REGISTRY)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ``ValueError`` naming the choices if there is none."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_REGISTRY)}") from None


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | Visibility | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
    training: bool = True,
    backend: str | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q Kᵀ · scale + mask) V on the chosen ``backend`` — lecture 003's Attention(Q, K, V).

    Arguments, shapes, mask meaning, semantics and errors are those of the spec,
    :func:`selfattention.functional.scaled_dot_product_attention` (a drop-in for
    ``torch.nn.functional.scaled_dot_product_attention`` with bottom-right causal masks, zeros for a query
    that sees no key, and hidden NaN that never leaks). ``backend``: ``None`` or ``"reference"`` for the
    spec's materialising math, ``"torch"`` for torch SDPA, ``"tiled"`` for the block engine, or any name
    registered with :func:`register_backend`. An unknown name raises ``ValueError``.

    ``return_lse=True`` returns ``(out, lse)`` on every backend: lse (..., H, Tq), the natural log of
    Σ_j exp(score_ij) over the keys each row sees (scaled scores plus a float mask, before dropout),
    float32 at least, ``-inf`` for a row that sees nothing; differentiable. Two states over disjoint keys
    merge exactly with :func:`selfattention.merge_states` (a backend registered by others gets
    ``return_lse=True`` passed only when asked, and must then return the pair).

    Under ``torch.autocast`` the floating-point inputs (query, key, value, a float ``attn_mask``) are cast
    to its dtype and the attention runs without it, as torch's SDPA does (bfloat16 out on CPU).

    >>> q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> scaled_dot_product_attention(q, q, 2 * q, backend="tiled")   # lecture 003: (1.340, 0.660), ...
    tensor([[1.3395, 0.6605],
            [0.6605, 1.3395]])

    A long context split in two halves and merged equals the whole (lecture 003's softmax is over all keys;
    each half returns its own normalised output and log-sum-exp):

    >>> from selfattention import merge_states
    >>> q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 100, 8), torch.randn(1, 2, 100, 8)
    >>> whole = scaled_dot_product_attention(q, k, v, backend="tiled")
    >>> a = scaled_dot_product_attention(q, k[:, :, :60], v[:, :, :60], backend="tiled", return_lse=True)
    >>> b = scaled_dot_product_attention(q, k[:, :, 60:], v[:, :, 60:], backend="tiled", return_lse=True)
    >>> out, lse = merge_states(*a, *b)
    >>> torch.allclose(out, whole, atol=1e-6)
    True
    """
    check_bool("return_lse", return_lse)
    cast = autocast_dtype(query)
    if cast is not None:  # as torch's SDPA under autocast: inputs in its dtype, the math without it
        query, key, value, attn_mask = autocast_cast(cast, query, key, value, attn_mask)
        with torch.autocast(query.device.type, enabled=False):
            return scaled_dot_product_attention(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa,
                training=training, backend=backend, return_lse=return_lse,
            )  # fmt: skip
    fn = _reference if backend is None else get_backend(backend)
    if symbolic():  # torch.compile / export / vmap / jit.trace: one registered op (selfattention.ops)
        if return_lse:
            raise NotImplementedError(
                "return_lse=True under torch.compile/export/vmap/trace is not supported yet: call it eagerly"
            )
        return ops.attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa,
            training=training, backend="reference" if backend is None else backend,
        )  # fmt: skip
    extra = {"return_lse": True} if return_lse else {}
    return fn(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        training=training,
        **extra,
    )


def _reference(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    *,
    enable_gqa=False,
    training=True,
    return_lse=False,
):
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa, training=training,
        return_lse=return_lse,
    )  # fmt: skip


def _tiled(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    *,
    enable_gqa=False,
    training=True,
    return_lse=False,
):
    return tiled_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa, training=training,
        return_lse=return_lse,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------- torch


class _SpecForCreateGraph(torch.autograd.Function):
    """Runs ``fn`` (torch SDPA) and keeps its own graph for the first-order backward; a backward with
    ``create_graph=True`` (gradient penalties) recomputes through the spec instead, whose math is twice
    differentiable (torch's fused CPU kernel has no derivative of its backward)."""

    @staticmethod
    def forward(ctx, fn, spec, query, key, value, mask):  # type: ignore[override]
        ins = [
            None if t is None else t.detach().requires_grad_(t.requires_grad)
            for t in (query, key, value, mask)
        ]
        with torch.enable_grad():
            out = fn(*ins)
        ctx.inner = (ins, out)
        ctx.spec = spec
        ctx.save_for_backward(query, key, value, mask)
        return out.detach()

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        ins, out = ctx.inner
        if torch.is_grad_enabled():  # create_graph=True: the spec's differentiable math
            ins = list(ctx.saved_tensors)
            with torch.enable_grad():
                out = ctx.spec(*ins)
        wanted = [t for t in ins if t is not None and t.requires_grad]
        grads = iter(
            # retain_graph: the outer graph may be run backward again (``retain_graph=True`` there);
            # the inner graph dies with this context, so nothing outlives the outer one
            torch.autograd.grad(
                out, wanted, dout, create_graph=torch.is_grad_enabled(), retain_graph=True, allow_unused=True
            )
        )
        return (None, None, *[next(grads) if t is not None and t.requires_grad else None for t in ins])


def torch_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | Visibility | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
    training: bool = True,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``torch.nn.functional.scaled_dot_product_attention`` with this library's semantics.

    Differences bridged: bottom-right causal when Tq != Tk (an explicit mask is passed), rows with no
    visible key return zeros and zero gradient (torch gives NaN), inputs holding NaN/inf are computed by
    the spec (torch's fused kernels turn a NaN query row into zeros and let hidden NaN keys leak through
    0 · NaN), Tk = 0 gives zeros, ``training=False`` disables dropout, a float mask of another dtype is
    cast to the query's, bfloat16/float16 on CPU are computed in float32 (torch's fused CPU kernel in
    bfloat16 is 2–3× further from float64 than naive bfloat16 math), and ``create_graph=True`` (double
    backward) works through the spec. Shapes and errors as in the reference.

    ``return_lse=True``: torch SDPA returns no log-sum-exp, so the lse comes from the spec's scores
    (:func:`selfattention.functional.row_logsumexp`, O(Tq·Tk) memory); use ``backend="tiled"`` for an
    O(T) one.
    """
    check_bool("return_lse", return_lse)
    if symbolic():
        if return_lse:
            raise NotImplementedError(
                "return_lse=True under torch.compile/export/vmap/trace is not supported yet: call it eagerly"
            )
        return ops.attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa,
            training=training, backend="torch",
        )  # fmt: skip
    if return_lse:
        out = torch_sdpa(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa=enable_gqa,
            training=training,
        )
        steps = F.attention_steps(
            query, key, value[..., :0], attn_mask, 0.0, is_causal, scale, enable_gqa=enable_gqa
        )
        return out, F.row_logsumexp(steps.masked_scores)
    args = parse_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa, training=training
    )
    batch, q_len, k_len, vis = args.batch, args.q_len, args.k_len, args.vis
    if vis.mod is not None or vis.doc_offset is not None:  # programmable parts: torch SDPA gets them dense
        vis = Visibility(q_len, k_len, attn_mask=vis.dense_bias(query.dtype, query.device))
    dropout_p, scale = args.dropout_p, args.scale
    if args.empty:  # (a batch dim of 0 broadcast against 1 is 0, not 1)
        return F.empty_context(query, key, value, (*batch, q_len, value.shape[-1]))
    if not (all_finite(query) and all_finite(key) and all_finite(value)):
        # torch SDPA's fused kernels turn a NaN query row into zeros and let a hidden NaN/inf key or value
        # reach other rows through 0 · NaN; inputs holding NaN/inf are rare, so the spec computes them
        return F.attention_steps(
            query, key, value, vis, dropout_p, False, scale, enable_gqa=enable_gqa, training=training
        ).context
    mask_in = vis.attn_mask
    # Causal with query 0 at key 0 (Tq = Tk bottom-right, or an explicit top-left offset) and nothing else:
    # torch SDPA's own is_causal means exactly that, and its fused kernel skips the hidden blocks.
    # (scale > 0 only: SDPA scales the hidden scores' −inf too, and 0 · −inf is NaN)
    plain_causal = (
        vis.is_causal
        and vis.offset == 0
        and vis.window is None
        and vis.q_doc is None
        and mask_in is None
        and scale > 0.0
    )
    visible = None if plain_causal else F.visible_keys(vis, (*batch, q_len, k_len), query.device)
    compute = vendor.compute_dtype(query.device, query.dtype)
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, mask_in)
    )
    if wants_grad and F.mask_outruns_lse(vis, torch.promote_types(compute, torch.float32)):
        # torch's fused backward recomputes the weights from a log-sum-exp that cannot resolve this mask's
        # rows (F.mask_outruns_lse): the spec's math, whose gradients are those of its forward
        return F.attention_steps(
            query, key, value, vis, dropout_p, False, scale, enable_gqa=enable_gqa, training=training
        ).context

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
            group = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
        mask_arg = m
        if mask_arg is not None and mask_arg.is_floating_point():
            mask_arg = mask_arg.to(compute)  # -inf stays -inf, finite biases round
        if (vis.structural and not plain_causal) or vis.q_doc is not None:  # our structure as a mask
            mask_arg = (
                visible
                if mask_arg is None or mask_arg.dtype == torch.bool
                else torch.where(visible, mask_arg, torch.full((), float("-inf"), dtype=compute))
            )
        if mask_arg is not None and mask_arg.dim() < 2:
            mask_arg = mask_arg.expand(q_len, k_len)  # torch SDPA's fused kernels index dim -2 of the mask
        seen_any = None
        if visible is not None:
            # a row with no visible key would be softmax over all -inf (NaN in torch): let it see every key
            # for the call, then return zeros (the output is replaced, so its gradient is zero too)
            seen_any = visible.any(dim=-1, keepdim=True)  # (..., Tq, 1)
            if bool(seen_any.all()):
                seen_any = None
            elif mask_arg.dtype == torch.bool:
                mask_arg = visible | ~seen_any
            else:
                mask_arg = torch.where(seen_any, mask_arg, torch.zeros((), dtype=mask_arg.dtype))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask_arg, dropout_p=dropout_p, is_causal=plain_causal, scale=scale
        )
        if seen_any is not None:
            out = torch.where(seen_any, out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out.to(query.dtype)

    def spec(q, k, v, m):
        return F.attention_steps(q, k, v, vis.with_mask(None) if m is None else replace(vis, attn_mask=m), 0.0, False, scale,
                                 enable_gqa=enable_gqa).context  # fmt: skip

    if dropout_p == 0.0 and wants_grad:
        return _SpecForCreateGraph.apply(run, spec, query, key, value, mask_in)
    return run(query, key, value, mask_in)


register_backend("reference", _reference)
register_backend("torch", torch_sdpa)
register_backend("tiled", _tiled)
