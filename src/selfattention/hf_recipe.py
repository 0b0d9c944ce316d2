"""The mask function of :mod:`selfattention.hf` (transformers' mask recipe read, not evaluated): transformers' mask recipe as a lazy predicate, never a dense
(B, 1, Tq, Tk) tensor.

transformers builds every model's mask from small index predicates (``masking_utils``): ``causal_mask_function``,
``sliding_window_overlay(W)``, ``chunked_overlay(C, left_padding)``, ``padding_mask_function`` (from the 2-D
``attention_mask``), ``packed_sequence_mask_function``, combined with ``and_masks`` / ``or_masks`` and shifted by
``q_offset`` / ``kv_offset`` (the cache). Its ``sdpa_mask`` evaluates them on every (query, key) pair; its
``flex_attention_mask`` hands them to ``create_block_mask``. :func:`mask_function` (registered under the same
``AttentionMaskInterface`` signature) reads the recipe instead and returns a :class:`LazyMask` around a
:class:`~selfattention.visibility.Visibility`:

=====================================  ====================================================================
transformers' predicate                what the engine gets (all combined with AND)
=====================================  ====================================================================
``causal_mask_function``               causal, query i at key position i + q_offset − kv_offset
``sliding_window_overlay(W)`` & causal  window W at that offset (stacked bands, hidden blocks skipped)
``chunked_overlay(C, left_padding)``    documents: id ⌊(position − left_padding[b]) / C⌋ per query and key
``packed_sequence_mask_function``       documents: the packed sequence ids (positions remapped inside each)
2-D ``attention_mask`` (padding)        a key-only bool mask (B, 1, 1, Tk) — O(B·Tk), never (Tq, Tk)
``bidirectional_mask_function``         nothing (every key)
anything else (or_masks, your own)      a generic mask_mod :class:`~selfattention.visibility.Predicate`:
                                        blocks classified, tiles evaluated per block, never all at once
=====================================  ====================================================================

Tq = Tk = 4, sliding window 2, the first key padded — what ``sdpa_mask`` would materialise, and what the
LazyMask holds instead (a window and one key-only row)::

    0 0 0 0        window 2 (causal, offset 0)      key padding (1, 1, 1, 4)
    0 1 0 0        1 0 0 0                          0 1 1 1
    0 1 1 0        1 1 0 0
    0 0 1 1        0 1 1 0
                   0 0 1 1

Source: transformers 5.x ``masking_utils.py`` (the predicates and their composition).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .hf_maskview import MaskView, additive
from .visibility import Predicate, Visibility

__all__ = ["LazyMask", "RecipeParts", "mask_function", "recognise"]

_MODULE = "transformers.masking_utils"


@dataclass(frozen=True, eq=False)
class LazyMask:
    """What :func:`mask_function` returns: the model's mask for (B, 1, Tq, Tk) as a
    :class:`~selfattention.visibility.Visibility` (no (Tq, Tk) tensor), and how it was recognised.

    ``kinds``: the recognised parts (``"causal"``, ``"window"``, ``"chunks"``, ``"documents"``, ``"padding"``,
    ``"predicate"``). ``shape``, ``dtype`` and ``device`` describe the dense mask it stands for;
    :meth:`to_dense` builds it (the weights path does, as transformers' ``sdpa_mask`` would).
    """

    visibility: Visibility
    batch_size: int
    kinds: tuple[str, ...]
    device: torch.device
    cache: dict = field(default_factory=dict, repr=False)  # the dense bias of small calls, once per forward

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.batch_size, 1, self.visibility.q_len, self.visibility.k_len))

    @property
    def ndim(self) -> int:
        return 4

    def dim(self) -> int:
        return 4

    @property
    def dtype(self) -> torch.dtype:
        return torch.bool

    def to_dense(self) -> torch.Tensor:
        """Bool (B, 1, Tq, Tk), True = attend: what transformers' ``sdpa_mask`` returns for this recipe."""
        m = self.visibility.to_mask(self.device)
        while m.dim() < 4:
            m = m.unsqueeze(0)
        v = self.visibility
        return m.expand(self.batch_size, 1, v.q_len, v.k_len).clone()

    def __repr__(self) -> str:
        v = self.visibility
        return (
            f"LazyMask({'+'.join(self.kinds) or 'all keys'}, B={self.batch_size}, Tq={v.q_len}, Tk={v.k_len})"
        )

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """Float (B, 1, Tq, Tk) of ``dtype``: 0 = attend, ``finfo(dtype).min`` = hidden — transformers'
        ``eager_mask`` of this recipe."""
        return additive(self.to_dense(), dtype)

    def tensor_view(self) -> MaskView:
        """:meth:`to_dense` as a :class:`~selfattention.hf_maskview.MaskView`: what a model's own code
        computes with (see below)."""
        return self.to_dense().as_subclass(MaskView)

    # A model whose own code computes with the 4-D mask before the attention call (Doge's dynamic mask:
    # torch.where on it, a slice, a comparison) gets the dense mask it stands for at that point — exactly
    # transformers' sdpa_mask — through torch functions, Tensor methods, indexing and operators alike, as a
    # MaskView: added to floating-point scores, directly or after a slice or expand (a model running its own
    # eager attention on the mask built for ours: Git, BigBird-Pegasus), it is eager's additive mask.
    # Never a silent wrong answer; only the lazy savings are lost.
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return func(*_viewed(args), **_viewed(kwargs or {}))

    def __getitem__(self, index):
        return self.tensor_view()[index]

    def __getattr__(self, name: str):
        if name.startswith("__") or not hasattr(torch.Tensor, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.tensor_view(), name)

    __hash__ = object.__hash__


def _dense_operator(name: str):
    def op(self: LazyMask, *args):
        return getattr(self.tensor_view(), name)(*_viewed(args))

    op.__name__ = name
    return op


for _op in (
    "eq ne lt le gt ge add radd sub rsub mul rmul truediv rtruediv and rand or ror xor rxor invert neg"
).split():
    setattr(LazyMask, f"__{_op}__", _dense_operator(f"__{_op}__"))


def _viewed(x: Any) -> Any:
    """``x`` with every :class:`LazyMask` in it (also inside tuples, lists and dicts) as its MaskView."""
    if isinstance(x, LazyMask):
        return x.tensor_view()
    if isinstance(x, tuple | list):
        return type(x)(_viewed(v) for v in x)
    if isinstance(x, dict):
        return {k: _viewed(v) for k, v in x.items()}
    return x


def _free(fn: Callable) -> dict[str, Any]:
    """The closure variables of a transformers predicate (its arguments: window, chunk size, tensors)."""
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells), strict=False))


def _name(fn: Callable) -> str:
    if getattr(fn, "__module__", None) != _MODULE:
        return ""
    return getattr(fn, "__qualname__", "")


def _leaves(fn: Callable) -> list[Callable]:
    """The predicates an ``and_masks`` tree ANDs together (a non-and predicate is one leaf)."""
    if _name(fn) == "and_masks.<locals>.and_mask":
        return [leaf for f in _free(fn)["mask_functions"] for leaf in _leaves(f)]
    return [fn]


@dataclass
class RecipeParts:
    causal: bool = False
    window: int | None = None
    chunks: list | None = None  # [(chunk_size, left_padding)]
    packed: list | None = None  # [ids (B, T)]
    padding: list | None = None  # [(B, T) bool]
    generic: list | None = None  # predicates left to evaluate per block
    remapped: bool = False


def _add(parts: RecipeParts, name: str, value) -> None:
    cur = getattr(parts, name)
    setattr(parts, name, [value] if cur is None else [*cur, value])


def recognise(fn: Callable) -> RecipeParts:
    """Split transformers' ``mask_function`` into the engine's structural parts and a generic rest."""
    parts = RecipeParts()
    for leaf in _leaves(fn):
        name = _name(leaf)
        free = _free(leaf) if name else {}
        if name == "causal_mask_function":
            parts.causal = True
        elif name == "bidirectional_mask_function":
            pass
        elif name == "sliding_window_overlay.<locals>.inner_mask" and isinstance(free["sliding_window"], int):
            w = free["sliding_window"]
            parts.window = w if parts.window is None else min(parts.window, w)
        elif name == "chunked_overlay.<locals>.inner_mask":
            _add(parts, "chunks", (int(free["chunk_size"]), free["left_padding"]))
        elif name == "padding_mask_function.<locals>.inner_mask":
            _add(parts, "padding", free["padding_mask"])
        elif name == "packed_sequence_mask_function.<locals>.inner_mask":
            _add(parts, "packed", free["packed_sequence_mask"])
        elif name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
            inner = recognise(free["mask_function"])
            if inner.chunks or inner.packed or inner.padding or inner.generic or inner.remapped:
                _add(parts, "generic", leaf)
                continue
            # positions remapped inside each packed sequence: within one sequence (the packed ids are ANDed
            # as well) position differences equal index differences, so causal/window keep their meaning
            parts.remapped = True
            parts.causal = parts.causal or inner.causal
            if inner.window is not None:
                parts.window = inner.window if parts.window is None else min(parts.window, inner.window)
        else:
            _add(parts, "generic", leaf)
    return parts


class _Shifted:
    """A transformers predicate on absolute positions, called with the engine's 0-based indices."""

    def __init__(self, fns: list[Callable], q_offset: int, kv_offset: int) -> None:
        self.fns, self.q_offset, self.kv_offset = fns, q_offset, kv_offset

    def __call__(self, b, h, q_idx, kv_idx):
        out = None
        for fn in self.fns:
            m = fn(b, h, q_idx + self.q_offset, kv_idx + self.kv_offset)
            m = torch.as_tensor(m, dtype=torch.bool, device=q_idx.device)
            out = m if out is None else out & m
        return out


def _doc_ids(parts: RecipeParts, b: int, q_pos: torch.Tensor, k_pos: torch.Tensor):
    """(q_doc (B, Tq), k_doc (B, Tk)) of the one chunk / packed constraint, or None; raises _Generic if two."""
    given = [("chunks", x) for x in parts.chunks or []] + [("packed", x) for x in parts.packed or []]
    if not given:
        return None
    if len(given) > 1:
        raise _Generic
    kind, x = given[0]
    if kind == "chunks":
        size, left = x
        left = torch.as_tensor(left, device=q_pos.device).reshape(-1, 1)
        q_doc = torch.div(q_pos[None] - left, size, rounding_mode="floor")
        k_doc = torch.div(k_pos[None] - left, size, rounding_mode="floor")
    else:
        ids = x
        if ids.shape[-1] <= int(max(q_pos.max(), k_pos.max())):
            raise _Generic
        q_doc, k_doc = ids[:, q_pos], ids[:, k_pos]
    return q_doc.expand(b, -1).contiguous(), k_doc.expand(b, -1).contiguous()


_PLAIN = {"causal_mask_function": True, "bidirectional_mask_function": False}  # name → is_causal


class _Generic(Exception):
    """A combination without a structural form: the whole recipe becomes one generic predicate."""


#: Models whose own code edits the 4-D mask only when it is a ``torch.Tensor``, in eager's additive form
#: (DeepSeek V4's compressed layers append keys and concatenate their float bias to the mask): they get
#: :meth:`LazyMask.additive` — dense, as transformers' ``eager_mask`` — instead of a lazy mask.
TENSOR_MASK_MODELS = frozenset({"deepseek_v4"})


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> LazyMask | torch.Tensor | None:
    """transformers' ``AttentionMaskInterface`` signature (as ``sdpa_mask``): the mask of ``mask_function``
    (default causal) for queries at positions q_offset … q_offset + q_length − 1 and keys at kv_offset … ,
    ANDed with the 2-D padding ``attention_mask`` (B, ≥ kv_offset + kv_length; 1 = token, shorter: the
    missing keys are hidden), as a :class:`LazyMask` (never ``None``: the call needs no is_causal rules).
    ``local_size``, ``allow_is_causal_skip``, ``use_vmap`` … are accepted and unused. For a ``config``
    whose ``model_type`` is in :data:`TENSOR_MASK_MODELS` it returns the additive float mask of ``dtype``
    (default float32) instead. Under ``torch.compile`` / export it returns transformers' own ``sdpa_mask``
    (dense, or None).

    >>> from transformers.masking_utils import sliding_window_causal_mask_function      # doctest: +SKIP
    >>> mask_function(2, 8, 8, mask_function=sliding_window_causal_mask_function(3))    # doctest: +SKIP
    LazyMask(causal+window, B=2, Tq=8, Tk=8)
    """
    mask = _lazy_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, device, **kwargs
    )
    model_type = getattr(kwargs.get("config"), "model_type", None)
    if isinstance(mask, LazyMask) and model_type in TENSOR_MASK_MODELS:
        return mask.additive(kwargs.get("dtype") or torch.float32)
    return mask


def _lazy_mask(
    batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, device, **kwargs
):
    from transformers.masking_utils import causal_mask_function

    if isinstance(attention_mask, LazyMask):
        return attention_mask  # already prepared (transformers returns a prepared 4-D mask as it is)
    if torch.compiler.is_compiling():  # a traced graph gets transformers' own dense mask (no data-dependent
        from transformers.masking_utils import sdpa_mask  # branches while the recipe is read)

        return sdpa_mask(
            batch_size, q_length, kv_length, q_offset, kv_offset, mask_function=mask_function or causal_mask_function,
            attention_mask=attention_mask, device=device, **kwargs,
        )  # fmt: skip
    fn = causal_mask_function if mask_function is None else mask_function
    q_off, kv_off = int(q_offset), int(kv_offset)
    device = torch.device(device)
    if attention_mask is None and _name(fn) in _PLAIN:  # the common call of an unpadded batch: no recipe
        causal = _PLAIN[_name(fn)]
        vis = Visibility(q_length, kv_length, is_causal=causal, q_offset=q_off - kv_off)
        return LazyMask(vis, batch_size, ("causal",) if causal else (), device)
    parts = recognise(fn)
    key_mask, kinds = None, []
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask for a mask function must be the 2-D padding mask (B, Tk), 1 = token; got "
                f"shape {tuple(attention_mask.shape)} (a prepared 4-D mask is passed to the model as it is)"
            )
        if attention_mask.shape[0] not in (1, batch_size):
            # (eager and sdpa index the first rows and run on: a mask of another batch is a caller's slip)
            raise ValueError(
                f"attention_mask has {attention_mask.shape[0]} rows (shape {tuple(attention_mask.shape)}) "
                f"but the batch has {batch_size} sequences: pass one row per sequence"
            )
        pad = attention_mask.to(device=device, dtype=torch.bool)
        if pad.shape[-1] < kv_off + kv_length:
            pad = torch.nn.functional.pad(pad, (0, kv_off + kv_length - pad.shape[-1]))
        _add(parts, "padding", pad)
    for pad in parts.padding or []:
        # a copy: the lazy mask must not follow later edits of the caller's tensor (sdpa's dense mask is
        # made here, once; a bool mask's .to(bool) would be the caller's tensor itself)
        cut = pad[:, kv_off : kv_off + kv_length].to(device=device, dtype=torch.bool, copy=True)
        key_mask = cut if key_mask is None else key_mask & cut
    if key_mask is not None:
        if bool(key_mask.all()):
            key_mask = None
        else:
            key_mask = key_mask.reshape(key_mask.shape[0], 1, 1, kv_length)  # (B, 1, 1, Tk)
            kinds.append("padding")
    try:
        if parts.window is not None and (not parts.causal or parts.window <= 0):
            # an overlay without causal: not the engine's window; a window of 0 or less (Qwen2-MoE's
            # config sets sliding_window = 0 when use_sliding_window is False, and still builds the
            # sliding mask nobody reads): nothing visible, as transformers' own predicate says
            raise _Generic
        if parts.remapped and (q_off, kv_off) != (0, 0):
            raise _Generic
        docs = None
        if parts.chunks or parts.packed:  # (positions only for documents: two ops fewer per forward)
            q_pos = torch.arange(q_length, device=device) + q_off
            k_pos = torch.arange(kv_length, device=device) + kv_off
            docs = _doc_ids(parts, batch_size, q_pos, k_pos)
        mod = None
        if parts.generic:
            mod = Predicate(_Shifted(parts.generic, q_off, kv_off), batch=batch_size, heads=1)
        vis = Visibility(
            q_length, kv_length, is_causal=parts.causal, window=parts.window if parts.causal else None,
            q_offset=q_off - kv_off, q_doc=None if docs is None else docs[0],
            k_doc=None if docs is None else docs[1], attn_mask=key_mask, mod=mod,
        )  # fmt: skip
        kinds = (
            (["causal"] if parts.causal else [])
            + (["window"] if parts.window is not None else [])
            + (["chunks"] if parts.chunks else [])
            + (["documents"] if parts.packed else [])
            + kinds
            + (["predicate"] if mod is not None else [])
        )
    except _Generic:
        mod = Predicate(_Shifted([fn], q_off, kv_off), batch=batch_size, heads=1)
        vis = Visibility(q_length, kv_length, attn_mask=key_mask, mod=mod)
        kinds = [*kinds, "predicate"]
    return LazyMask(vis, batch_size, tuple(kinds), device)
