"""Attention backends: one signature, a registry, no silent fallback.

Every backend is a callable with the signature of
:func:`selfattention.functional.scaled_dot_product_attention` (without ``backend``) and the same
semantics (bool mask True = attend, bottom-right causal, zeros for a query with no visible key). Each is
tested against the float64 reference.

=============  ==============================================================================
name           what it runs
=============  ==============================================================================
reference      :func:`selfattention.functional.attention_steps`: materialises the scores (spec)
torch          ``torch.nn.functional.scaled_dot_product_attention``, with our mask semantics
=============  ==============================================================================

Choosing: pass ``backend="name"`` to :func:`selfattention.scaled_dot_product_attention` or to a module.
An unknown name raises ``ValueError`` listing the registered ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import functional as F
from ._validation import check_bool, check_dropout, check_mask, check_qkv, resolve_scale

__all__ = ["register_backend", "get_backend", "available_backends", "torch_sdpa"]

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

    >>> "reference" in available_backends() and "torch" in available_backends()
    True
    """
    _load_optional()
    return sorted(_REGISTRY)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; ``ValueError`` naming the choices if there is none."""
    _load_optional()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_REGISTRY)}") from None


def _load_optional() -> None:
    """Import modules that register further backends (kept lazy to keep import time low)."""
    if "tiled" not in _REGISTRY:
        try:
            from . import tiled  # noqa: F401  (registers "tiled")
        except ImportError:
            pass


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
):
    return F.attention_steps(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa, training=training
    ).context


def torch_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
    training: bool = True,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with this library's semantics.

    Differences bridged: bottom-right causal when Tq != Tk (an explicit mask is passed), rows with no
    visible key return zeros and zero gradient (torch gives NaN), inputs holding NaN/inf are computed by
    the spec (torch's fused kernels turn a NaN query row into zeros and let hidden NaN keys leak through
    0 · NaN), Tk = 0 gives zeros, ``training=False`` disables dropout, a float mask of another dtype is
    cast to the query's. Shapes and errors as in the reference.
    """
    batch, q_len, k_len = check_qkv(query, key, value, enable_gqa=enable_gqa)
    check_mask(attn_mask, batch, q_len, k_len, query.device)
    query_in, key_in, value_in = query, key, value
    dropout_p = check_dropout(dropout_p)  # checked even when not training: a bad value is a bug either way
    if not training:
        dropout_p = 0.0
    check_bool("is_causal", is_causal)
    scale = resolve_scale(scale, query.shape[-1])
    if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)
        value = value.repeat_interleave(group, dim=-3)
    if q_len == 0 or k_len == 0:
        return F._empty_context(query, key, value, (*batch, q_len, value.shape[-1]))

    if not (F._all_finite(query) and F._all_finite(key) and F._all_finite(value)):
        # torch SDPA's fused kernels turn a NaN query row into zeros and let a hidden NaN/inf key or value
        # reach other rows through 0 · NaN; inputs holding NaN/inf are rare, so the spec computes them
        # (NaN in a visible position → NaN out; hidden ones never leak; blind rows → zeros)
        return F.attention_steps(
            query_in,
            key_in,
            value_in,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa=enable_gqa,
            training=training,
        ).context
    visible = F._visible(attn_mask, is_causal, (*batch, q_len, k_len), query.device)
    mask_arg = attn_mask
    if mask_arg is not None and mask_arg.is_floating_point() and mask_arg.dtype != query.dtype:
        # torch SDPA wants a float mask in the query's dtype; -inf stays -inf, finite biases round
        mask_arg = mask_arg.to(query.dtype)
    if is_causal:
        mask_arg = (
            visible
            if attn_mask is None or attn_mask.dtype == torch.bool
            else torch.where(visible, mask_arg, torch.full((), float("-inf"), dtype=mask_arg.dtype))
        )
    if mask_arg is not None and mask_arg.dim() < 2:
        mask_arg = mask_arg.expand(q_len, k_len)  # torch SDPA's fused kernels index dim -2 of the mask
    seen_any = None
    if visible is not None:
        # a row with no visible key would be softmax over all -inf (NaN in torch): let it see every key
        # for the call, then return zeros (the output is replaced, so its gradient is zero too)
        seen_any = visible.any(dim=-1, keepdim=True)  # (..., Tq, 1)
        if not bool(seen_any.all()):
            if mask_arg is None or mask_arg.dtype == torch.bool:
                mask_arg = visible | ~seen_any
            else:
                mask_arg = torch.where(seen_any, mask_arg, torch.zeros((), dtype=mask_arg.dtype))

    def call(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(
            query, k, v, attn_mask=mask_arg, dropout_p=dropout_p, scale=scale
        )

    out = call(key, value)
    if seen_any is not None:
        out = torch.where(seen_any, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


register_backend("reference", _reference)
register_backend("torch", torch_sdpa)
