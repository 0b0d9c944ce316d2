"""The dense face of a :class:`~selfattention.hf_recipe.LazyMask`: what a model's own code gets when it computes
with the mask transformers built for this attention.

A bool (B, 1, Tq, Tk) mask, True = attend — transformers' ``sdpa_mask`` — as :class:`MaskView`, a
``torch.Tensor`` subclass that behaves as that plain bool tensor in every torch function, method, index and
operator, with one exception: **added to floating-point scores** (``scores + mask``, ``+=``, ``torch.add``,
``baddbmm``/``addmm`` with the mask as the added term) it is eager's additive mask, 0 where visible and
``finfo(dtype).min`` where hidden — exactly transformers' ``eager_mask``. Models that run their own eager
attention on the mask (Git, BigBird-Pegasus, remote code) add it to their scores; a bool mask would add 1
to the visible scores and hide nothing. Views and copies that keep the mask's meaning (slices, ``expand``,
``view``, ``reshape``, ``&`` / ``|`` with other masks, ``to(device)``, …) stay :class:`MaskView`; anything
else (a comparison, ``~mask``, ``mask.float()``, a ``where``) is a plain tensor, as it would be from a
plain bool mask.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MaskView", "additive", "plain"]


def additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float ``keep.shape`` of ``dtype``: 0 where ``keep`` (bool, True = attend), ``finfo(dtype).min`` elsewhere."""
    keep = plain(keep)
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain ``torch.Tensor`` (a :class:`MaskView` unwrapped; no copy)."""
    return t.as_subclass(torch.Tensor) if isinstance(t, MaskView) else t


_ADDS = frozenset(
    {torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__, torch.Tensor.__radd__,
     torch.Tensor.__iadd__, torch.baddbmm, torch.Tensor.baddbmm, torch.addmm, torch.Tensor.addmm}
)  # fmt: skip
# ops whose bool result is the same mask (a view, a copy, a combination of masks): it keeps the add rule
_KEEPS = frozenset(
    "__getitem__ expand expand_as broadcast_to view view_as reshape reshape_as unsqueeze squeeze narrow "
    "select contiguous clone to cpu cuda detach transpose permute movedim swapaxes flatten unflatten flip "
    "repeat repeat_interleave tile split chunk unbind cat concat concatenate stack bool __and__ __iand__ "
    "__rand__ logical_and bitwise_and __or__ __ior__ __ror__ logical_or bitwise_or".split()
)


def _float_dtype(values: Any) -> torch.dtype | None:
    for v in values:
        if isinstance(v, torch.Tensor) and not isinstance(v, MaskView) and v.is_floating_point():
            return v.dtype
    return None


def _keep(out: Any) -> Any:
    if isinstance(out, torch.Tensor) and out.dtype == torch.bool:
        return out.as_subclass(MaskView)
    if isinstance(out, tuple | list):
        return type(out)(_keep(o) for o in out)
    return out


class MaskView(torch.Tensor):
    """A bool mask (True = attend) from a LazyMask; see the module doc for the one rule it adds."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ADDS:
            dtype = _float_dtype((*args, *kwargs.values()))
            if dtype is not None:
                args = tuple(additive(a, dtype) if isinstance(a, MaskView) else a for a in args)
                kwargs = {k: additive(v, dtype) if isinstance(v, MaskView) else v for k, v in kwargs.items()}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        return _keep(out) if getattr(func, "__name__", None) in _KEEPS else out
