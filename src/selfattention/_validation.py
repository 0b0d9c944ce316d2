"""Argument checks shared by every attention path.

Every public function validates its input here, so that bad input gets one clear ``ValueError`` or
``TypeError`` naming the argument, the expected and the actual shape/dtype/device, instead of a
stack trace from deep inside torch or a silent NaN.
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

from .visibility import Visibility, as_visibility

__all__ = [
    "AttentionArgs",
    "parse_attention",
    "check_qkv",
    "check_mask",
    "resolve_scale",
    "check_dropout",
    "check_positive_int",
    "check_bool",
    "from_causal_bias",
    "FloatMaskWarning",
    "ArgumentTypeError",
    "ArgumentValueError",
    "symbolic",
    "batched",
    "direct",
]


class FloatMaskWarning(UserWarning):
    """A float ``attn_mask`` made only of 0s and 1s: probably meant as a keep-mask (use bool)."""


class ArgumentTypeError(TypeError, RuntimeError):
    """A query/key/value/attn_mask/dropout_p of the wrong type or dtype. A ``TypeError``, and also the
    ``RuntimeError`` that ``torch.nn.functional.scaled_dot_product_attention`` raises for the same input,
    so that code (and tests) written against torch catch it unchanged."""


class ArgumentValueError(ValueError, RuntimeError):
    """A query/key/value/attn_mask/dropout_p of the wrong shape, size, device or value. A ``ValueError``,
    and also torch SDPA's ``RuntimeError`` for the same input (see :class:`ArgumentTypeError`)."""


_direct = threading.local()


def symbolic() -> bool:
    """True while a transform records or traces the call: ``torch.compile``/``torch.export``, ``torch.jit.trace``
    or a ``torch.func`` transform (vmap, grad, jacrev …). Data-dependent decisions (``bool(tensor)``) are
    impossible there; the entry points then call the registered custom ops of :mod:`selfattention.ops`,
    whose real implementations run eagerly (inside them this is False again: :func:`direct`)."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():  # (first: not a threading.local)
        return True
    if getattr(_direct, "depth", 0):
        return False
    if torch.jit.is_tracing():
        return True
    return bool(torch._C._are_functorch_transforms_active())


def batched(t: torch.Tensor) -> bool:
    """``t`` is a vmap-batched tensor (torch.func's, or the one of ``autograd.grad(is_grads_batched=True)``)."""
    f = torch._C._functorch
    return bool(f.is_batchedtensor(t) or f.is_legacy_batchedtensor(t))


@contextmanager
def direct() -> Iterator[None]:
    """Inside this block :func:`symbolic` is False: a custom op's real implementation, on real tensors."""
    _direct.depth = getattr(_direct, "depth", 0) + 1
    try:
        yield
    finally:
        _direct.depth -= 1


def autocast_dtype(query: object) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts attention's floating-point inputs to on ``query``'s device, or
    None where it is off (torch's SDPA and flex_attention are on its lower-precision list: under CPU
    bfloat16 autocast float32 inputs come back bfloat16)."""
    if not isinstance(query, torch.Tensor):
        return None
    dev = query.device.type
    try:
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    except RuntimeError:  # a device autocast does not know (meta)
        return None


def autocast_cast(dtype: torch.dtype, *ts: object) -> tuple:
    """``ts`` with every tensor autocast would cast in ``dtype``: floating point but not float64, as
    torch's rule (float64 stays float64; bool masks, ids, None and others as given)."""
    return tuple(
        t.to(dtype)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        else t
        for t in ts
    )


def all_finite(t: torch.Tensor | None) -> bool:
    """True if ``t`` (None counts as finite) holds no NaN or ±inf. One vectorised sum first (a NaN or inf
    anywhere makes it non-finite); only if the sum is not finite — or overflows — the elementwise check."""
    if t is None or t.numel() == 0 or bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def broadcast_shapes(*shapes: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """``torch.broadcast_shapes`` in plain Python (a tenth of its cost on the per-call path); raises
    ``RuntimeError`` like it when the shapes do not broadcast."""
    n = max([0, *(len(s) for s in shapes)])  # (no max(default=): torch.compile traces this)
    out = [1] * n
    for shape in shapes:
        for i, size in enumerate(shape, start=n - len(shape)):
            if size != 1:
                if out[i] not in (1, size):
                    raise RuntimeError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
                out[i] = size
    return tuple(out)


def _fmt(shape: torch.Size | tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ArgumentTypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or float64), got dtype {t.dtype}"
        )
    if t.layout != torch.strided:
        raise ArgumentTypeError(
            f"{name} must be a dense (strided) tensor, got layout {t.layout}; use .to_dense()"
        )
    return t


def check_qkv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    enable_gqa: bool = False,
) -> tuple[torch.Size, int, int]:
    """Validate (..., H, Tq, D), (..., Hkv, Tk, D), (..., Hkv, Tk, Dv).

    Returns the broadcast batch shape (everything before the last two dims, heads included) of the
    output, ``Tq`` and ``Tk``. Raises ``TypeError`` for non-tensors and non-float or mixed dtypes,
    ``ValueError`` for rank, size, head-count and device mismatches.
    """
    _check_tensor("query", query)
    _check_tensor("key", key)
    _check_tensor("value", value)
    check_bool("enable_gqa", enable_gqa)
    if not (query.dtype == key.dtype == value.dtype):
        raise ArgumentTypeError(
            "query, key and value must have the same dtype, got "
            f"query {query.dtype}, key {key.dtype}, value {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ArgumentValueError(
            "query, key and value must be on the same device, got "
            f"query on {query.device}, key on {key.device}, value on {value.device}"
        )
    if query.device.type == "meta":
        raise ArgumentValueError(
            "query, key and value are on the meta device, which holds shapes but no values; attention "
            "looks at the values (masks, NaN checks), so move them to a real device"
        )
    # the rest is a pure function of the three shapes and enable_gqa: computed once per shape triple
    # (a model calls the same shapes in every layer); not while torch.compile traces (the dict would become
    # a guard) nor under torch.jit.trace (sizes may be tensors)
    tracing = torch.compiler.is_compiling() or torch.jit.is_tracing()
    shapes = (query.shape, key.shape, value.shape, enable_gqa)
    hit = None if tracing else _SHAPES.get(shapes)
    if hit is not None:
        return hit
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 2:
            raise ArgumentValueError(
                f"{name} must have at least 2 dims (..., T, D), got shape {_fmt(t.shape)}"
            )
    if not (query.dim() == key.dim() == value.dim()):
        raise ArgumentValueError(
            "query, key and value must have the same number of dims, got "
            f"query {_fmt(query.shape)}, key {_fmt(key.shape)}, value {_fmt(value.shape)}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ArgumentValueError(
            f"query and key must have the same head_dim (last dim), got query {_fmt(query.shape)} "
            f"(D={query.shape[-1]}) and key {_fmt(key.shape)} (D={key.shape[-1]})"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ArgumentValueError(
            f"key and value must have the same sequence length (dim -2), got key {_fmt(key.shape)} "
            f"(Tk={key.shape[-2]}) and value {_fmt(value.shape)} (Tk={value.shape[-2]})"
        )
    if key.shape[:-2] != value.shape[:-2]:
        raise ArgumentValueError(
            f"key and value must have the same batch/head dims, got key {_fmt(key.shape)} and value "
            f"{_fmt(value.shape)}"
        )
    q_batch, k_batch = query.shape[:-2], key.shape[:-2]
    if enable_gqa and query.dim() >= 3:
        hq, hkv = query.shape[-3], key.shape[-3]
        if hkv == 0 or hq % hkv != 0:
            raise ArgumentValueError(
                f"grouped-query attention needs the query heads to be a multiple of the key/value heads, "
                f"got query heads {hq} (query {_fmt(query.shape)}) and key/value heads {hkv} "
                f"(key {_fmt(key.shape)})"
            )
        q_batch, k_batch = q_batch[:-1], k_batch[:-1]
    try:
        batch = broadcast_shapes(q_batch, k_batch)
    except RuntimeError:
        hint = ""
        if query.dim() >= 3 and query.shape[-3] != key.shape[-3] and not enable_gqa:
            hint = " (different head counts: pass enable_gqa=True for grouped-query attention)"
        raise ArgumentValueError(
            f"query {_fmt(query.shape)} and key {_fmt(key.shape)} have batch/head dims that do not "
            f"broadcast{hint}"
        ) from None
    if enable_gqa and query.dim() >= 3:
        batch = torch.Size((*batch, query.shape[-3]))
    # plain ints: torch.jit.trace hands sizes over as 0-dim tensors (the trace is then for these lengths)
    q_len, k_len = query.shape[-2], key.shape[-2]
    if isinstance(q_len, torch.Tensor) or isinstance(k_len, torch.Tensor):
        q_len, k_len = int(q_len), int(k_len)
    elif not tracing:
        if len(_SHAPES) >= _SHAPES_MAX:
            _SHAPES.clear()
        _SHAPES[shapes] = (batch, q_len, k_len)
    return batch, q_len, k_len


#: check_qkv's verdict by (query shape, key shape, value shape, enable_gqa): shapes that passed (an
#: invalid triple raises and is never stored). Bounded; cleared when full.
_SHAPES: dict[tuple, tuple[torch.Size, int, int]] = {}
_SHAPES_MAX = 256


def check_mask(
    attn_mask: torch.Tensor | None,
    out_batch: torch.Size,
    q_len: int,
    k_len: int,
    device: torch.device,
) -> None:
    """A mask must be bool (True = attend) or floating (added to the scores) and broadcast to
    ``(*out_batch, Tq, Tk)``. Warns with :class:`FloatMaskWarning` for a float mask of only 0s and 1s."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise ArgumentTypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ArgumentTypeError(
            f"attn_mask must be bool (True = attend) or floating (added to the scores), got dtype "
            f"{attn_mask.dtype}; for a 0/1 integer keep-mask use attn_mask.bool()"
        )
    if attn_mask.device != device:
        raise ArgumentValueError(f"attn_mask is on {attn_mask.device} but query is on {device}")
    target = (*out_batch, q_len, k_len)
    try:
        full = broadcast_shapes(attn_mask.shape, target)
    except RuntimeError:
        full = None
    if full is None or tuple(full) != target:
        raise ArgumentValueError(
            f"attn_mask of shape {_fmt(attn_mask.shape)} does not broadcast to the scores' shape "
            f"{_fmt(target)} (batch..., Tq, Tk)"
        )
    if attn_mask.is_floating_point() and attn_mask.numel() > 0:
        if bool(torch.isnan(attn_mask).any()):
            raise ArgumentValueError("attn_mask contains NaN; use -inf to hide a key, 0 to keep it")
        if bool((attn_mask == math.inf).any()):
            raise ArgumentValueError(
                "attn_mask contains +inf: softmax of a +inf score is NaN; use -inf to hide a key, 0 to keep "
                "it (a large finite value to favour one)"
            )
        ones = attn_mask == 1
        if bool(ones.any()) and bool((ones | (attn_mask == 0)).all()):
            warnings.warn(
                "attn_mask is a float tensor of only 0s and 1s; a float mask is ADDED to the scores, so 1 "
                "does not hide anything. If you meant 1 = attend, pass attn_mask.bool()",
                FloatMaskWarning,
                stacklevel=3,
            )


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``None`` means 1/sqrt(head_dim); any finite number, 0.0 included, is used as given."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be a number, got a tensor of shape {_fmt(scale.shape)}")
        if scale.requires_grad:
            raise ValueError(
                "scale is a tensor that requires grad; it is used as a plain number and would get no "
                "gradient. Multiply the query by a learnable scale instead"
            )
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def check_dropout(dropout_p: float) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, int | float):
        raise ArgumentTypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not (0.0 <= dropout_p < 1.0):
        raise ArgumentValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_bool(name: str, value: object) -> bool:
    """``value`` must be a real ``bool`` or numpy's (not 1, not a tensor): flags like ``is_causal`` change the
    math. Returns a Python bool."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    where = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
    shown = f" ({value!r})" if isinstance(value, (int, float)) else ""  # short, one line
    raise TypeError(f"{name} must be a bool, got {where}{kind.__qualname__}{shown}")


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


def check_count(name: str, value: object) -> int:
    """A non-negative int (a count that may be 0), else TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a non-negative int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value}")
    return value


def from_causal_bias(attn_mask: object, query: object, key: object, is_causal: object) -> object:
    """torch's ``CausalBias`` (``torch.nn.attention.bias.causal_upper_left`` / ``causal_lower_right``) as
    the :class:`~selfattention.visibility.Visibility` it stands for; any other ``attn_mask`` unchanged.

    A ``CausalBias`` is a tensor subclass whose storage holds no mask (torch's SDPA reads its variant), so
    treating it as a dense mask would be silently wrong. Upper-left puts query 0 at key 0
    (``q_offset=0``, torch's ``is_causal``), lower-right puts the last query on the last key (this library's
    ``is_causal``). Raises ``ValueError`` (as torch does) when ``is_causal=True`` is passed too, or when
    the bias was made for other lengths than the query/key have.
    """
    if not isinstance(attn_mask, CausalBias):
        return attn_mask
    if is_causal is True:
        raise ValueError(
            "attn_mask is a CausalBias (causal_upper_left/causal_lower_right) and is_causal=True: pass one "
            "of them, not both"
        )
    q_len, k_len = attn_mask.seq_len_q, attn_mask.seq_len_kv
    for name, t, n in (("query", query, q_len), ("key", key, k_len)):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2] != n:
            raise ValueError(
                f"attn_mask is a CausalBias for seq_len_q={q_len}, seq_len_kv={k_len} but {name} has "
                f"length {t.shape[-2]} (shape {_fmt(t.shape)})"
            )
    upper_left = attn_mask.variant == CausalVariant.UPPER_LEFT
    return Visibility(q_len, k_len, is_causal=True, q_offset=0 if upper_left else None)


@dataclass(frozen=True)
class AttentionArgs:
    """The arguments of one attention call, validated: what every entry point computes from.

    Attributes:
        batch: the output's batch dims, heads included (``(..., H)``).
        q_len, k_len: Tq and Tk.
        vis: the visibility of ``attn_mask`` and ``is_causal`` together (its ``attn_mask`` is the checked
            tensor mask, or None).
        dropout_p: the dropout probability in force (0.0 when not ``training``).
        scale: the factor on Q Kᵀ (1/√D when ``None`` was given).
        enable_gqa: grouped-query heads allowed.
    """

    batch: tuple[int, ...]
    q_len: int
    k_len: int
    vis: Visibility
    dropout_p: float
    scale: float
    enable_gqa: bool

    @property
    def empty(self) -> bool:
        """Nothing to compute: no query, no key, or a batch dim of 0 (zeros of the output's shape)."""
        return self.q_len == 0 or self.k_len == 0 or 0 in self.batch


def parse_attention(
    query: object,
    key: object,
    value: object,
    attn_mask: object = None,
    dropout_p: object = 0.0,
    is_causal: object = False,
    scale: object = None,
    *,
    enable_gqa: object = False,
    training: object = True,
) -> AttentionArgs:
    """Validate the arguments of ``scaled_dot_product_attention`` (torch SDPA's signature plus
    ``training``) once, in one order, for every entry point (the spec, the backends, the tiled engine,
    the ring): tensors (:func:`check_qkv`), ``is_causal``/``training`` (real bools), ``attn_mask`` (a
    tensor or a :class:`~selfattention.visibility.Visibility`: :func:`check_mask`), ``dropout_p``
    (checked even when not training: a bad value is a bug either way), ``scale`` (:func:`resolve_scale`).

    Raises ``TypeError``/``ValueError`` naming the argument, as the functions above.
    """
    batch, q_len, k_len = check_qkv(query, key, value, enable_gqa=enable_gqa)  # type: ignore[arg-type]
    check_bool("is_causal", is_causal)
    check_bool("training", training)
    attn_mask = from_causal_bias(attn_mask, query, key, is_causal)
    vis = as_visibility(attn_mask, is_causal, q_len, k_len)  # type: ignore[arg-type]
    check_mask(vis.attn_mask, batch, q_len, k_len, query.device)  # type: ignore[union-attr]
    p = check_dropout(dropout_p)  # type: ignore[arg-type]
    scale = resolve_scale(scale, query.shape[-1])  # type: ignore[union-attr, arg-type]
    return AttentionArgs(tuple(batch), q_len, k_len, vis, p if training else 0.0, scale, bool(enable_gqa))
