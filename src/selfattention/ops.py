"""Attention as registered custom ops, for ``torch.compile``, ``torch.export``, ``torch.func`` and ``torch.jit.trace``.

Every backend keeps this library's guarantees (zeros for a query that sees nothing, hidden NaN/inf that
never leaks, the vendor kernel chosen per call) with data-dependent decisions: ``bool(tensor)``, a check
of the inputs for NaN, a plan that depends on the values. A compiler, an exporter or ``vmap`` cannot
follow such decisions. So under those transforms (:func:`selfattention._validation.symbolic`) the entry
points call one op instead, and the compiler sees one node:

``selfattention::attention(query, key, value, attn_mask?, dropout_p, is_causal, scale?, enable_gqa,
visibility, vis_causal, window?, q_offset?, backend, seed?) -> out``

* its real implementation is the eager backend itself, run on real tensors (every check, every guard);
* its fake implementation gives the output's shape, dtype and device (the shape rules of
  :func:`~selfattention._validation.check_qkv`), so compile and export trace through it;
* its autograd formula (``register_autograd`` with ``setup_context``) calls
  ``selfattention::attention_backward``, whose implementation recomputes the backend's forward with
  autograd on and returns the gradients of query, key, value and a float mask (one extra forward: the
  price of keeping the backward opaque too);
* a vmap rule (``register_vmap``) folds the vmapped dimension into the batch dims, which every backend
  takes as they are: one call, no loop. The same rule makes ``jacrev`` and
  ``torch.autograd.grad(..., is_grads_batched=True)`` work.

Dropout draws its masks from a seed passed to both ops (the backward replays the forward's masks).
Not through the ops: a backward of the backward (``create_graph=True``), a
:class:`~selfattention.visibility.Visibility` with document ids or a flex predicate (``mod``), and dropout
under ``vmap`` (see docs/api.md, "Under torch.compile, export, vmap, trace").
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ._validation import check_bool, check_dropout, check_qkv, direct, from_causal_bias
from .visibility import Visibility

__all__ = ["attention"]

_SCHEMA_TAIL = (
    "float dropout_p, bool is_causal, float? scale, bool enable_gqa, bool visibility, bool vis_causal, "
    "int? window, int? q_offset, str backend, Tensor? seed"
)


def attention(
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
    backend: str = "reference",
) -> torch.Tensor:
    """``selfattention.scaled_dot_product_attention(..., backend=backend)`` as one custom op (same
    arguments, semantics and result). The checks that need only shapes and types run here, at trace time;
    the value checks (a NaN in a float mask …) run in the op, on the real tensors."""
    check_qkv(query, key, value, enable_gqa=enable_gqa)
    check_bool("is_causal", is_causal)
    check_bool("training", training)
    attn_mask = from_causal_bias(attn_mask, query, key, is_causal)  # torch's CausalBias: its Visibility
    p = check_dropout(dropout_p) if training else 0.0
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float)):
        raise TypeError(
            f"scale must be a float or None under torch.compile/vmap/trace, got {type(scale).__name__}"
        )
    visibility, vis_causal, window, q_offset = False, False, None, None
    if isinstance(attn_mask, Visibility):
        if attn_mask.q_doc is not None:
            raise NotImplementedError(
                "a Visibility with document ids under torch.compile/export/vmap/trace: pass the dense bool "
                "mask (visibility.to_mask()) instead"
            )
        if attn_mask.mod is not None:  # the op's schema carries no predicate: refused, never dropped
            raise NotImplementedError(
                "a Visibility with a mask_mod/score_mod predicate (flex_attention's) under torch.compile/export/"
                "vmap/trace: pass the dense bool mask (visibility.to_mask()) instead, or call "
                "selfattention.flex.flex_attention"
            )
        visibility, vis_causal = True, attn_mask.is_causal
        window, q_offset, attn_mask = attn_mask.window, attn_mask.q_offset, attn_mask.attn_mask
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(
                f"attn_mask must be bool (True = attend) or floating (added to the scores), got dtype "
                f"{attn_mask.dtype}; for a 0/1 integer keep-mask use attn_mask.bool()"
            )
    seed = None
    if p > 0.0:
        seed = torch.randint(0, 2**62, (), dtype=torch.int64)
    args = (
        p, is_causal, None if scale is None else float(scale), enable_gqa, visibility, vis_causal, window,
        q_offset, backend, seed,
    )  # fmt: skip
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        # torch.func (grad, vjp, jacrev, vmap): the op's own autograd formula has no setup_context for
        # functorch in this torch; the same formula as an autograd.Function that has one
        return _Functorch.apply(query, key, value, attn_mask, *args)
    return torch.ops.selfattention.attention(query, key, value, attn_mask, *args)


# ------------------------------------------------------------------------------------ the real computation


def _rng(seed: torch.Tensor | None, device: torch.device):
    """The dropout masks of the forward, replayed in the backward: the global generator forked and seeded."""
    if seed is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    cuda = device.type == "cuda"
    stack.enter_context(torch.random.fork_rng(devices=[device] if cuda else []))
    if cuda:  # only this device's generator (torch.manual_seed would reseed every device for good)
        with torch.cuda.device(device):
            torch.cuda.manual_seed(int(seed))
    else:
        torch.default_generator.manual_seed(int(seed))
    return stack


def _run(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, visibility, vis_causal, window, q_offset,
         backend, seed):  # fmt: skip
    from .backends import get_backend  # (the registry is the dispatch layer's; this module sits beside it)

    if visibility:
        mask = Visibility(
            q.shape[-2], k.shape[-2], is_causal=vis_causal, window=window, q_offset=q_offset, attn_mask=mask
        )
    with direct(), _rng(seed, q.device):
        return get_backend(backend)(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa, training=dropout_p > 0.0,
        )  # fmt: skip


def _fresh(t: torch.Tensor, inputs: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``t`` contiguous (the strides the fake implementations promise), and a copy if it shares memory with
    an input (an op's outputs may not alias its inputs)."""
    ptr = t.untyped_storage().data_ptr()
    if any(x is not None and x.numel() and x.untyped_storage().data_ptr() == ptr for x in inputs):
        return t.clone()
    return t.contiguous() if not t.is_contiguous() else t


@torch.library.custom_op(
    "selfattention::attention",
    mutates_args=(),
    schema="(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, " + _SCHEMA_TAIL + ") -> Tensor",
)
def _attention_op(query, key, value, attn_mask, *args):
    with torch.no_grad():
        out = _run(query, key, value, attn_mask, *args)
    return _fresh(out, (query, key, value, attn_mask))


def _out_shape(query, key, value, enable_gqa) -> tuple[int, ...]:
    batch, _, _ = check_qkv(query, key, value, enable_gqa=enable_gqa)
    return (*batch, query.shape[-2], value.shape[-1])


@_attention_op.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, *rest):
    return query.new_empty(_out_shape(query, key, value, enable_gqa))


def _autograd_inside():
    """Autograd back on inside an op's implementation (the dispatcher runs it below the autograd keys, so
    a graph would not be recorded): the backward recomputes the backend's forward and differentiates it."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    exclude = exclude.remove(keys.AutogradFunctionality).remove(keys.ADInplaceOrView)
    stack = contextlib.ExitStack()
    stack.enter_context(torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude))
    stack.enter_context(torch.enable_grad())
    return stack


@torch.library.custom_op(
    "selfattention::attention_backward",
    mutates_args=(),
    schema="(Tensor grad, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, "
    + _SCHEMA_TAIL
    + ", bool mask_grad) -> Tensor[]",
)
def _attention_backward_op(grad, query, key, value, attn_mask, *args):
    *args, mask_grad = args
    with _autograd_inside():
        leaves = [t.detach().requires_grad_(True) for t in (query, key, value)]
        mask = attn_mask
        if mask_grad:
            mask = attn_mask.detach().requires_grad_(True)
            leaves.append(mask)
        out = _run(*leaves[:3], mask, *args)
        got = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(got, leaves, strict=True)]
    if not mask_grad:
        grads.append(query.new_empty(0))
    return [_fresh(g, (grad, query, key, value, attn_mask)) for g in grads]


@_attention_backward_op.register_fake
def _(grad, query, key, value, attn_mask, *args):
    mask_grad = args[-1]
    # contiguous, as the real implementation returns them (_fresh): the compiler plans with these strides
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad else query.new_empty(0)
    return [query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dmask]


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, *args = inputs
    ctx.args = args
    ctx.save_for_backward(query, key, value, attn_mask)


def _backward(ctx, grad, functorch: bool = False):
    query, key, value, attn_mask = ctx.saved_tensors
    mask_grad = bool(ctx.needs_input_grad[3]) and attn_mask is not None and attn_mask.is_floating_point()
    backward = _FunctorchBackward.apply if functorch else torch.ops.selfattention.attention_backward
    dq, dk, dv, dmask = backward(grad, query, key, value, attn_mask, *ctx.args, mask_grad)
    return (dq, dk, dv, dmask if mask_grad else None, *([None] * len(ctx.args)))


_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _Functorch(torch.autograd.Function):
    """The op and its autograd formula for torch.func transforms; vmap goes through the ops' vmap rules."""

    generate_vmap_rule = True

    @staticmethod
    def forward(query, key, value, attn_mask, *args):  # type: ignore[override]
        return torch.ops.selfattention.attention(query, key, value, attn_mask, *args)

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _backward(ctx, grad, functorch=True)


class _FunctorchBackward(torch.autograd.Function):
    """The backward op for torch.func transforms. ``torch.func.grad`` hands the backward a cotangent that
    its transform tracks, so the op is called through the autograd layer again, where functorch accepts
    only an autograd.Function with ``setup_context`` (torch.library's generated one has none: a
    RuntimeError). First-order gradients; a second derivative raises ``NotImplementedError``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad, query, key, value, attn_mask, *args):  # type: ignore[override]
        return tuple(torch.ops.selfattention.attention_backward(grad, query, key, value, attn_mask, *args))

    @staticmethod
    def setup_context(ctx, inputs, output):  # type: ignore[override]
        pass

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        raise NotImplementedError(
            "second derivatives of selfattention's attention under torch.func transforms (torch.func.hessian, "
            "grad of grad) are not supported; the spec, selfattention.functional.scaled_dot_product_attention, "
            "is plain torch math and supports them"
        )


# ------------------------------------------------------------------------------------------------ vmap


def _batched(t: torch.Tensor | None, bdim: int | None, n: int, rank: int) -> torch.Tensor | None:
    """``t`` with the vmapped dim first (expanded when ``t`` is not batched) and as many dims after it as the
    query has (``rank``), so that it broadcasts against the other arguments as it did per sample."""
    if t is None:
        return None
    if bdim is None:
        t = t.expand(n, *t.shape)
    else:
        t = t.movedim(bdim, 0)
    return t.reshape(n, *([1] * (rank - (t.dim() - 1))), *t.shape[1:])


def _vmap_forward(info, in_dims, query, key, value, attn_mask, *args):
    n, rank = info.batch_size, query.dim() - (in_dims[0] is not None)
    if in_dims[13] is not None:
        raise NotImplementedError("dropout under torch.func.vmap (vmap's randomness) is not supported")
    q, k, v = (_batched(t, d, n, rank) for t, d in zip((query, key, value), in_dims[:3], strict=True))
    mask = attn_mask if in_dims[3] is None else _batched(attn_mask, in_dims[3], n, rank)
    if mask is not None and in_dims[3] is None:
        mask = mask.reshape(*([1] * (rank + 1 - mask.dim())), *mask.shape)
    return torch.ops.selfattention.attention(q, k, v, mask, *args), 0


def _vmap_backward(info, in_dims, grad, query, key, value, attn_mask, *args):
    n = info.batch_size
    rank = query.dim() - (in_dims[1] is not None)
    ranks = [rank, key.dim() - (in_dims[2] is not None), value.dim() - (in_dims[3] is not None)]
    g = _batched(grad, in_dims[0], n, grad.dim() - (in_dims[0] is not None))
    q, k, v = (_batched(t, d, n, r) for t, d, r in zip((query, key, value), in_dims[1:4], ranks, strict=True))
    mask_shape = None
    mask = attn_mask
    if attn_mask is not None:
        logical = (
            tuple(attn_mask.shape)
            if in_dims[4] is None
            else tuple(attn_mask.movedim(in_dims[4], 0).shape[1:])
        )
        mask_shape = logical
        mask = _batched(attn_mask, in_dims[4], n, rank)  # per-sample masks: per-sample gradients
    dq, dk, dv, dmask = torch.ops.selfattention.attention_backward(g, q, k, v, mask, *args)
    if args[-1] and mask_shape is not None:
        dmask = dmask.reshape(n, *mask_shape)
    else:
        dmask = dmask.new_empty(n, 0)
    return [dq, dk, dv, dmask], [0, 0, 0, 0]


torch.library.register_vmap("selfattention::attention", _vmap_forward)
torch.library.register_vmap("selfattention::attention_backward", _vmap_backward)
