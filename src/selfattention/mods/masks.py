"""Ready mask mods (see :mod:`selfattention.mods`) and their composition; each knows its structure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = [
    "MaskMod",
    "And",
    "Or",
    "and_masks",
    "or_masks",
    "noop_mask",
    "causal_mask",
    "causal_at",
    "sliding_window",
    "prefix_lm",
    "document_mask",
    "packed_sequences",
    "dilated_sliding_window",
    "natten",
    "sink_tokens",
    "visibility_fields",
]


try:  # torch's own, so that ``mod is noop_mask`` holds for code written against torch
    from torch.nn.attention.flex_attention import noop_mask
except ImportError:  # pragma: no cover - a torch without flex_attention

    def noop_mask(
        b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        """Every key visible (torch's ``noop_mask``)."""
        return b.new_ones((), dtype=torch.bool)


class MaskMod:
    """Base of the ready mask mods: ``__call__(b, h, q_idx, kv_idx)`` and :meth:`structure`."""

    def __call__(self, b, h, q_idx, kv_idx):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def structure(self, q_len: int, k_len: int) -> dict | None:
        """The :class:`~selfattention.visibility.Visibility` fields this mask is, for Tq × Tk, or None
        when it has no structural form (then it is evaluated per block)."""
        return None


def _struct(offset: int, window: int | None = None) -> dict:
    return {"is_causal": True, "q_offset": offset, "window": window}


@dataclass(frozen=True)
class CausalAt(MaskMod):
    """Key kv visible to query q iff kv ≤ q + offset (Vaswani et al. 2017, §3.2.3). offset 0: top-left
    (flex/attention-gym's ``causal_mask``); offset Tk − Tq: bottom-right (a chunk after cached keys)."""

    offset: int = 0

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + self.offset

    def structure(self, q_len, k_len):
        return _struct(self.offset)


causal_mask = CausalAt(0)
"""Top-left causal: query i sees keys 0 … i (``q_idx >= kv_idx``)."""


def causal_at(offset: int) -> CausalAt:
    """Causal with query i at key position i + ``offset`` (``causal_at(Tk - Tq)`` = bottom-right)."""
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"causal_at: offset must be an int, got {type(offset).__name__}")
    return CausalAt(offset)


def _opt_int(name: str, x, lo: int = 0) -> None:
    if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < lo):
        raise ValueError(f"{name} must be an int >= {lo} or None, got {x!r}")


@dataclass(frozen=True)
class SlidingWindow(MaskMod):
    """Query q (at position p = q + offset) sees keys p − left … p + right; None = unbounded on that side
    (Longformer, Beltagy et al. 2020; Mistral 7B: ``left = W − 1, right = 0``)."""

    left: int | None
    right: int | None = 0
    offset: int = 0

    def __call__(self, b, h, q_idx, kv_idx):
        p = q_idx + self.offset
        ok = torch.ones((), dtype=torch.bool, device=q_idx.device)
        if self.left is not None:
            ok = ok & (kv_idx >= p - self.left)
        if self.right is not None:
            ok = ok & (kv_idx <= p + self.right)
        return ok

    def structure(self, q_len, k_len):
        lo, hi = self.left, self.right
        if hi is None:
            return {} if lo is None else None  # keys from p − left onwards: no structural form
        return _struct(self.offset + hi, None if lo is None else lo + hi + 1)


def sliding_window(left: int | None, right: int | None = 0, offset: int = 0) -> SlidingWindow:
    """Sliding window: query q sees keys q + offset − left … q + offset + right. ``sliding_window(W - 1)``
    is the causal window of W keys; attention-gym's ``q_idx - kv_idx <= WINDOW`` (with causal) is
    ``sliding_window(WINDOW)``. W = 2 (left = 1)::

        1 0 0 0
        1 1 0 0
        0 1 1 0
        0 0 1 1
    """
    _opt_int("sliding_window: left", left)
    _opt_int("sliding_window: right", right)
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"sliding_window: offset must be an int, got {type(offset).__name__}")
    return SlidingWindow(left, right, offset)


@dataclass(frozen=True)
class PrefixLM(MaskMod):
    """The first ``prefix_len`` keys are seen by every query (bidirectional prefix), the rest causally
    (UniLM, Dong et al. 2019; T5's prefix-LM, Raffel et al. 2020)."""

    prefix_len: int

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx < self.prefix_len) | (kv_idx <= q_idx)


def prefix_lm(prefix_len: int) -> PrefixLM:
    """Prefix-LM: keys < ``prefix_len`` visible to all, causal after (drawing in the module docstring)."""
    _opt_int("prefix_lm: prefix_len", prefix_len)
    return PrefixLM(prefix_len)


def _ids(name: str, ids) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (T,) or (B, T)")
    if ids.dim() not in (1, 2):
        raise ValueError(f"{name} must have shape (T,) or (B, T), got {tuple(ids.shape)}")
    return ids


def _gather(ids: torch.Tensor, b, idx):
    return ids[idx] if ids.dim() == 1 else ids[b, idx]


@dataclass(frozen=True, eq=False)
class DocumentMask(MaskMod):
    """A query sees only keys of its own document (packed sequences; the ids broadcast over heads)."""

    q_doc: torch.Tensor = field(repr=False)
    k_doc: torch.Tensor = field(repr=False)

    def __call__(self, b, h, q_idx, kv_idx):
        return _gather(self.q_doc, b, q_idx) == _gather(self.k_doc, b, kv_idx)

    def structure(self, q_len, k_len):
        if self.q_doc.shape[-1] != q_len or self.k_doc.shape[-1] != k_len:
            return None
        return {"q_doc": self.q_doc.reshape(-1, q_len), "k_doc": self.k_doc.reshape(-1, k_len)}


def document_mask(q_doc: torch.Tensor, k_doc: torch.Tensor | None = None) -> DocumentMask:
    """Documents: ids (Tq,) or (B, Tq) for the queries and (Tk,) / (B, Tk) for the keys (the same when
    None). Ids [0, 0, 1]::

        1 1 0
        1 1 0
        0 0 1
    """
    q_doc = _ids("document_mask: q_doc", q_doc)
    k_doc = q_doc if k_doc is None else _ids("document_mask: k_doc", k_doc)
    return DocumentMask(q_doc, k_doc)


@dataclass(frozen=True, eq=False)
class PackedSequences(MaskMod):
    """flash-attn's varlen layout: sequence s holds queries cu_q[s] … cu_q[s+1] − 1 and keys
    cu_k[s] … cu_k[s+1] − 1; inside it, local query i sits at key position i + len_k − len_q
    (bottom-right), ``causal`` hides later keys, ``window = (left, right)`` (−1 = unbounded) keeps keys
    p − left … p + right. Rows and keys after the last sequence see / are seen by nothing."""

    cu_q: torch.Tensor = field(repr=False)
    cu_k: torch.Tensor = field(repr=False)
    causal: bool = False
    window: tuple[int, int] = (-1, -1)

    def _local(self, cu: torch.Tensor, idx: torch.Tensor):
        cu = cu.to(idx.device)
        s = torch.searchsorted(cu, idx, right=True) - 1
        inside = (s >= 0) & (idx < cu[-1])
        s = s.clamp(0, cu.numel() - 2)
        return s, idx - cu[s], cu[s + 1] - cu[s], inside

    def __call__(self, b, h, q_idx, kv_idx):
        sq, lq_i, nq, in_q = self._local(self.cu_q, q_idx)
        sk, lk_j, _, in_k = self._local(self.cu_k, kv_idx)
        nk = self.cu_k.to(q_idx.device)[sq + 1] - self.cu_k.to(q_idx.device)[sq]
        p = lq_i + nk - nq  # the query's position among its own sequence's keys
        ok = in_q & in_k & (sq == sk)
        left, right = self.window
        if self.causal:
            right = 0 if right < 0 else min(right, 0)
        if right >= 0:
            ok = ok & (lk_j <= p + right)
        if left >= 0:
            ok = ok & (lk_j >= p - left)
        return ok

    def structure(self, q_len, k_len):
        n = self.cu_q.numel() - 1
        pos_q, pos_k = torch.arange(q_len), torch.arange(k_len)
        q_doc = torch.searchsorted(self.cu_q.cpu(), pos_q, right=True) - 1
        k_doc = torch.searchsorted(self.cu_k.cpu(), pos_k, right=True) - 1
        q_doc = torch.where(pos_q < int(self.cu_q[-1]), q_doc, n)  # rows after the last sequence: id n
        k_doc = torch.where(pos_k < int(self.cu_k[-1]), k_doc, n + 1)  # keys after it: n + 1 (no query)
        dev = self.cu_q.device
        fields = {"q_doc": q_doc[None].to(dev), "k_doc": k_doc[None].to(dev)}
        left, right = self.window
        if self.causal:
            right = 0 if right < 0 else min(right, 0)
        if right < 0:
            return fields if left < 0 else None
        fields.update(is_causal=True, doc_offset=right, window=None if left < 0 else left + right + 1)
        return fields


def packed_sequences(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
) -> PackedSequences:
    """Packed variable-length sequences with flash-attn 2's varlen semantics (``cu_seqlens`` int32/int64,
    (n + 1,), starting at 0, non-decreasing). Planned as one call per sequence. cu_q = cu_k = [0, 2, 4],
    causal::

        1 0 0 0
        1 1 0 0
        0 0 1 0
        0 0 1 1
    """
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.is_floating_point() or cu.numel() < 1:
            raise ValueError(f"packed_sequences: {name} must be a 1-D integer tensor (n + 1,)")
        if int(cu[0]) != 0 or (cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any())):
            raise ValueError(f"packed_sequences: {name} must start at 0 and never decrease")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError("packed_sequences: cu_seqlens_q and cu_seqlens_k must have the same length")
    if not (
        isinstance(window, tuple | list) and len(window) == 2 and all(isinstance(w, int) for w in window)
    ):
        raise ValueError(f"packed_sequences: window must be a pair of ints (-1 = unbounded), got {window!r}")
    return PackedSequences(cu_seqlens_q.long(), cu_seqlens_k.long(), bool(causal), tuple(window))


@dataclass(frozen=True)
class DilatedSlidingWindow(MaskMod):
    """Causal, every ``dilation``-th key among the last ``window · dilation`` positions: keys q, q − d,
    q − 2d, … (``window`` keys; Longformer's dilated window, Beltagy et al. 2020)."""

    window: int
    dilation: int

    def __call__(self, b, h, q_idx, kv_idx):
        diff = q_idx - kv_idx
        return (diff >= 0) & (diff < self.window * self.dilation) & (diff % self.dilation == 0)


def dilated_sliding_window(window: int, dilation: int) -> DilatedSlidingWindow:
    """Dilated causal window; window = 2, dilation = 2, T = 5::

    1 0 0 0 0
    0 1 0 0 0
    1 0 1 0 0
    0 1 0 1 0
    0 0 1 0 1
    """
    _opt_int("dilated_sliding_window: window", window, 1)
    _opt_int("dilated_sliding_window: dilation", dilation, 1)
    return DilatedSlidingWindow(window, dilation)


@dataclass(frozen=True)
class Natten(MaskMod):
    """2-D neighbourhood attention on a ``height × width`` grid flattened row by row: the query at (y, x)
    sees the ``kernel_h × kernel_w`` keys around it, the window shifted inwards at the borders so that it
    always holds kernel_h · kernel_w keys (NATTEN, Hassani et al. 2023)."""

    height: int
    width: int
    kernel_h: int
    kernel_w: int

    def __call__(self, b, h, q_idx, kv_idx):
        qy, qx = q_idx // self.width, q_idx % self.width
        ky, kx = kv_idx // self.width, kv_idx % self.width
        rh, rw = self.kernel_h // 2, self.kernel_w // 2
        cy = qy.clamp(rh, self.height - 1 - rh)
        cx = qx.clamp(rw, self.width - 1 - rw)
        return ((cy - ky).abs() <= rh) & ((cx - kx).abs() <= rw)


def natten(height: int, width: int, kernel_h: int, kernel_w: int) -> Natten:
    """Neighbourhood attention over an image of height × width tokens (odd kernel sizes ≤ the grid)."""
    for name, v in (("height", height), ("width", width), ("kernel_h", kernel_h), ("kernel_w", kernel_w)):
        _opt_int(f"natten: {name}", v, 1)
    if kernel_h % 2 == 0 or kernel_w % 2 == 0 or kernel_h > height or kernel_w > width:
        raise ValueError("natten: kernel sizes must be odd and at most the grid's height/width")
    return Natten(height, width, kernel_h, kernel_w)


@dataclass(frozen=True)
class SinkTokens(MaskMod):
    """Causal window of ``window`` keys plus the first ``n_sinks`` keys, which every later query keeps
    seeing (StreamingLLM's attention sinks, Xiao et al. 2023)."""

    n_sinks: int
    window: int

    def __call__(self, b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx < self.window) | (kv_idx < self.n_sinks))


def sink_tokens(n_sinks: int, window: int) -> SinkTokens:
    """Sink tokens + a causal window; n_sinks = 1, window = 2, T = 5::

    1 0 0 0 0
    1 1 0 0 0
    1 1 1 0 0
    1 0 1 1 0
    1 0 0 1 1
    """
    _opt_int("sink_tokens: n_sinks", n_sinks)
    _opt_int("sink_tokens: window", window, 1)
    return SinkTokens(n_sinks, window)


@dataclass(frozen=True, eq=False)
class And(MaskMod):
    """The intersection of mask mods (what :func:`and_masks` returns)."""

    mods: tuple

    def __call__(self, b, h, q_idx, kv_idx):
        out = b.new_ones((), dtype=torch.bool)
        for m in self.mods:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    def structure(self, q_len, k_len):
        merged: dict = {}
        for m in self.mods:
            f = visibility_fields(m, q_len, k_len)
            if f is None:
                return None
            for key, val in f.items():
                if key in ("q_doc", "k_doc", "doc_offset"):
                    if key in merged:
                        return None  # two document constraints: evaluated per block
                    merged[key] = val
                elif key == "is_causal":
                    merged[key] = merged.get(key, False) or val
                elif key == "window":
                    if val is not None:
                        merged[key] = val if merged.get(key) is None else min(merged[key], val)
                elif key == "q_offset":
                    if merged.get(key, val) != val:
                        return None  # different offsets: evaluated per block
                    merged[key] = val
        if "doc_offset" in merged and "q_offset" in merged:
            return None
        return merged


@dataclass(frozen=True, eq=False)
class Or(MaskMod):
    """The union of mask mods (what :func:`or_masks` returns); evaluated per block."""

    mods: tuple

    def __call__(self, b, h, q_idx, kv_idx):
        out = b.new_zeros((), dtype=torch.bool)
        for m in self.mods:
            out = out | m(b, h, q_idx, kv_idx)
        return out

    def structure(self, q_len, k_len):
        fields = [visibility_fields(m, q_len, k_len) for m in self.mods]
        return {} if any(f == {} for f in fields) else None


class NotAMaskMod(TypeError, RuntimeError):
    """An argument of :func:`and_masks` / :func:`or_masks` that is not callable: a ``TypeError``, and the
    ``RuntimeError`` torch's combiners raise (code catching either works)."""


def _check_callables(name: str, mods) -> None:
    if not all(callable(m) for m in mods):
        raise NotAMaskMod(f"{name}: every argument must be a callable mask_mod, got {mods!r}")


def and_masks(*mask_mods: Callable) -> And:
    """The mask mod that is True where every one of ``mask_mods`` is (torch's ``and_masks``)."""
    _check_callables("and_masks", mask_mods)
    return And(tuple(mask_mods))


def or_masks(*mask_mods: Callable) -> Or:
    """The mask mod that is True where any of ``mask_mods`` is (torch's ``or_masks``)."""
    _check_callables("or_masks", mask_mods)
    return Or(tuple(mask_mods))


def visibility_fields(mask_mod: Callable | None, q_len: int, k_len: int) -> dict | None:
    """The :class:`~selfattention.visibility.Visibility` fields of a recognised mask mod for Tq × Tk
    (``{}``: every key visible), or None when it must be evaluated per block."""
    if mask_mod is None or mask_mod is noop_mask:
        return {}
    if isinstance(mask_mod, MaskMod):
        return mask_mod.structure(q_len, k_len)
    return None
