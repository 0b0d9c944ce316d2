"""The KV cache: keep the keys and values of past positions, compute only the new ones (lecture 003 §5 →
lecture 22).

When a causal decoder generates text, the key K = X·W_k and value V = X·W_v of a position never change
once computed (lecture 003 §3), so they are stored. Each new token (or chunk of tokens) then needs its own
query, key and value only, and attends over [cached keys ∪ new keys]. The result is the same as
recomputing the whole sequence — the tests prove it to 1e-5 in float32 — and a decode step costs O(T)
instead of O(T²).

Positions and masks. The cache counts the tokens it has seen: ``offset`` is the absolute position of the
next token (use it for position embeddings). A chunk of ``Tq`` new tokens sits at positions
``offset … offset + Tq - 1``; query ``i`` may see the stored keys and the chunk's keys up to its own
position. A chunk of 2 tokens at positions 3–4 after a 3-token cache (keys 0–4)::

    keys →          0 1 2 3 4
    query 0 (pos 3) 1 1 1 1 0
    query 1 (pos 4) 1 1 1 1 1

which is the bottom-right aligned ``causal_mask(2, 5)`` of :mod:`selfattention.masks`. With a sliding
window W (the query at position p sees keys p-W+1 … p), W = 3, the same chunk::

    keys →          0 1 2 3 4
    query 0 (pos 3) 0 1 1 1 0
    query 1 (pos 4) 0 0 1 1 1

and after the call only the keys a future token can still see are kept: the last W - 1 = 2 (positions
3, 4). A prefill chunk longer than the window is handled: the chunk first attends over [cache ∪ chunk]
(its early queries need keys that are evicted afterwards), then the cache drops what no later query can see.

Serving (``ragged=True``, or ``page_size=`` for paged storage): every sequence has its own length
(``lengths``), so prompts of different lengths are prefilled together (a right-padded chunk whose
``key_padding_mask`` marks each row's real tokens: only those are stored), sequences finish
(:meth:`finish`) and slots are reused (:meth:`release`), beams are reordered (:meth:`reorder`) and a
prefix is shared (:meth:`fork`). Query i of sequence b sits at position ``lengths[b] + i``; two sequences
of lengths 3 and 1 taking 2 and 1 new tokens (the second row of sequence 1 is padding)::

    keys →          0 1 2 3 4
    seq 0, query 0  1 1 1 1 0        (position 3)
    seq 0, query 1  1 1 1 1 1        (position 4)
    seq 1, query 0  1 1 0 0 0        (position 1)
    seq 1, query 1  1 1 0 0 0        (padding: sees the real keys, its output is meaningless)

With ``page_size`` the keys live in a page pool with a block table (:mod:`selfattention.kv_pages`):
a sequence holds ⌈length / page_size⌉ pages, forks and reorders share pages (copy-on-write on append),
and :attr:`pages_used` / :attr:`bytes` account for the memory. Paged and contiguous caches give identical
outputs. The same buffers serve :func:`selfattention.flash_kvcache.flash_attn_with_kvcache` directly
(:meth:`flash_args`).

Sources: lecture 003 §5 ("第 22 讲的 KV Cache ... 之前位置的 K、V 一旦算过就不会变，可以缓存下来");
Pope et al. 2022, "Efficiently Scaling Transformer Inference" (KV cache); Beltagy et al. 2020 and
Jiang et al. 2023 (Mistral 7B) for the sliding window / rolling cache.
"""

from __future__ import annotations

import torch

from . import kv_serving as _serving
from ._validation import check_positive_int
from .kv_pages import PageTable, PoolExhaustedError
from .visibility import Visibility

__all__ = ["KVCache", "CacheCapacityError", "PoolExhaustedError"]


class CacheCapacityError(ValueError):
    """Appending would exceed the capacity of a :class:`KVCache` (a ``ValueError``)."""


def _fmt(shape: torch.Size | tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


class KVCache:
    """Preallocated keys and values of one attention layer, for autoregressive decoding.

    Buffers ``key`` (B, Hkv, capacity, D) and ``value`` (B, Hkv, capacity, Dv) are allocated once.
    :meth:`update` appends the keys/values of ``Tq`` new tokens (a prefill of any length, a chunk of a
    chunked prefill, or one decode step) and returns everything the new queries attend over, with the
    bool mask (True = attend) that places those queries at their true positions.

    Args:
        batch_size: B.
        num_kv_heads: Hkv (the key/value heads; fewer than the query heads with GQA/MQA).
        head_dim: D of the keys.
        capacity: positions the buffers hold. Without a window this is the most tokens the cache can
            ever see (prefill + generated); exceeding it raises :class:`CacheCapacityError`. With a
            window it must be ≥ ``window``; a chunk that does not fit is attended over a temporary copy.
        window: optional sliding window W: the token at position p sees keys p-W+1 … p. The cache then
            keeps only the W - 1 most recent keys between calls.
        value_dim: Dv (default ``head_dim``).
        dtype, device: of the buffers (float32 and CPU by default).
        ragged: per-sequence lengths (serving; see the module docstring). A window then masks but does
            not evict: ``capacity`` must hold every token.
        page_size: store keys/values in pages of this many positions (implies ``ragged``); ``capacity``
            (the most positions of one sequence) must be a multiple of it. ``key``/``value`` are then the
            page pools (num_pages, page_size, Hkv, D), flash-attn's layout, and ``pages`` the block table.
        num_pages: pages in the pool (default ``batch_size · capacity / page_size``: every sequence can
            reach its capacity; fewer is fine when sequences share pages or finish early).

    Attributes:
        offset: tokens seen so far = absolute position of the next token (ragged: of the longest sequence).
        lengths: int64 (B,) tokens stored per sequence.

    Raises:
        TypeError/ValueError: non-positive sizes, ``capacity < window``, ``capacity`` not a multiple of
        ``page_size``.

    >>> cache = KVCache(batch_size=1, num_kv_heads=1, head_dim=2, capacity=8)
    >>> k = torch.randn(1, 1, 3, 2)
    >>> keys, values, visibility = cache.update(k, k)          # prefill 3 tokens (positions 0-2)
    >>> keys.shape, cache.offset
    (torch.Size([1, 1, 3, 2]), 3)
    >>> from selfattention.masks import draw
    >>> _, _, visibility = cache.update(torch.randn(1, 1, 2, 2), torch.randn(1, 1, 2, 2))  # positions 3-4
    >>> visibility
    Visibility(q_len=2, k_len=5, is_causal=True, window=None, q_offset=None, doc_offset=None)
    >>> print(draw(visibility))
    1 1 1 1 0
    1 1 1 1 1
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        window: int | None = None,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        ragged: bool = False,
        page_size: int | None = None,
        num_pages: int | None = None,
    ) -> None:
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.value_dim = self.head_dim if value_dim is None else check_positive_int("value_dim", value_dim)
        self.capacity = check_positive_int("capacity", capacity)
        self.window = None if window is None else check_positive_int("window", window)
        if self.window is not None and self.capacity < self.window:
            raise ValueError(
                f"capacity ({capacity}) must be >= window ({window}): the cache holds the W - 1 kept keys "
                "plus at least one new token"
            )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype}")
        if not isinstance(ragged, bool):
            raise TypeError(f"ragged must be a bool, got {type(ragged).__name__}")
        self.page_size = None if page_size is None else check_positive_int("page_size", page_size)
        self.ragged = ragged or page_size is not None
        self.pages: PageTable | None = None
        self._finished: set[int] = set()
        if self.page_size is not None:
            if capacity % self.page_size:
                raise ValueError(
                    f"capacity ({capacity}) must be a multiple of page_size ({self.page_size}): a sequence "
                    f"holds whole pages; use capacity={-(-capacity // self.page_size) * self.page_size}"
                )
            per = capacity // self.page_size
            n = batch_size * per if num_pages is None else check_positive_int("num_pages", num_pages)
            self.pages = PageTable(batch_size, n, self.page_size, per, device=device)
            # flash-attn's layout: (num_pages, page_size, Hkv, D)
            self.key_pages = torch.zeros(
                n, self.page_size, num_kv_heads, self.head_dim, dtype=dtype, device=device
            )
            self.value_pages = torch.zeros(
                n, self.page_size, num_kv_heads, self.value_dim, dtype=dtype, device=device
            )
            self.key, self.value = self.key_pages, self.value_pages  # the pools (dtype, device)
        elif num_pages is not None:
            raise ValueError("num_pages needs page_size (a contiguous cache has no pages)")
        else:
            # (B, Hkv, capacity, D) / (B, Hkv, capacity, Dv)
            self.key = torch.zeros(
                batch_size, num_kv_heads, capacity, self.head_dim, dtype=dtype, device=device
            )
            self.value = torch.zeros(
                batch_size, num_kv_heads, capacity, self.value_dim, dtype=dtype, device=device
            )
        self._lengths = [0] * batch_size
        self.dtype = dtype
        self.device = self.key.device
        self.real = torch.ones(batch_size, capacity, dtype=torch.bool, device=device)  # (B, capacity)
        self.offset = 0
        self._stored = 0  # keys in the buffer, the most recent positions in order
        self._padded = False  # whether any stored token is padding

    # ------------------------------------------------------------------ state
    @property
    def length(self) -> int:
        """Stored keys a next token can still see (≤ W - 1 with a window; ragged: the longest sequence)."""
        if self.ragged:
            return self.offset
        if self.window is None:
            return self._stored
        return min(self._stored, self.window - 1)

    def __len__(self) -> int:
        return self.length

    def key_positions(self) -> torch.Tensor:
        """Absolute positions of the keys :meth:`keys` returns, (length,) int64."""
        return torch.arange(self.offset - self.length, self.offset, device=self.key.device)

    def keys(self) -> torch.Tensor:
        """The kept keys, (B, Hkv, length, D) (a view, valid until the next :meth:`update`; paged: a copy)."""
        if self.pages is not None:
            return _serving.gather(self, self.key_pages, self.length)
        if self.ragged:
            return self.key[:, :, : self.length]
        return self.key[:, :, self._stored - self.length : self._stored]

    def values(self) -> torch.Tensor:
        """The kept values, (B, Hkv, length, Dv) (a view, valid until the next :meth:`update`; paged: a copy)."""
        if self.pages is not None:
            return _serving.gather(self, self.value_pages, self.length)
        if self.ragged:
            return self.value[:, :, : self.length]
        return self.value[:, :, self._stored - self.length : self._stored]

    def positions(self, n: int) -> torch.Tensor:
        """Absolute positions of the next ``n`` tokens: ``offset … offset + n - 1``, int64 (n,)."""
        return torch.arange(self.offset, self.offset + n, device=self.key.device)

    def reset(self) -> None:
        """Forget everything (the buffers are reused, not reallocated)."""
        self.offset = 0
        self._stored = 0
        self._padded = False
        self.real.fill_(True)
        for b in range(self.batch_size):
            _serving.release(self, b)

    # ------------------------------------------------------------------ serving
    @property
    def lengths(self) -> torch.Tensor:
        """Tokens stored per sequence, int64 (B,) (all equal to ``offset`` in a lockstep cache)."""
        if not self.ragged:
            return torch.full((self.batch_size,), self.offset, dtype=torch.int64)
        return torch.tensor(self._lengths, dtype=torch.int64)

    def positions_per_sequence(self, n: int) -> torch.Tensor:
        """Positions of each sequence's next ``n`` tokens, int64 (B, n): ``lengths[b] + 0 … n − 1``."""
        return self.lengths.to(self.device)[:, None] + torch.arange(n, device=self.device)

    @property
    def finished(self) -> list[int]:
        """Sequences marked by :meth:`finish` (they take no more tokens until :meth:`release`)."""
        return sorted(self._finished)

    def finish(self, b: int) -> None:
        """Mark sequence b finished: appending a real token to it raises ``ValueError`` (its keys stay)."""
        self._finished.add(_serving.check_slot(self, "sequence", b))

    def release(self, b: int) -> None:
        """Empty sequence b and free its pages: the slot takes a new sequence (continuous batching)."""
        self._need_ragged("release")
        _serving.release(self, b)

    def assign(self, b: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Fill the empty sequence ``b`` with keys (Hkv, T, D) and values (Hkv, T, Dv) at positions 0 … T − 1:
        a sequence prefilled on its own (e.g. with a one-row cache) joins the batch. ``ValueError`` if the
        slot is not empty, shapes/dtype/device do not match, or it does not fit; nothing changes then."""
        self._need_ragged("assign")
        _serving.assign(self, b, key, value)

    def fork(self, src: int, dst: int) -> None:
        """Sequence ``dst`` continues from a copy of ``src`` (prefix sharing; paged: the pages are shared,
        copy-on-write on append)."""
        self._need_ragged("fork")
        _serving.fork(self, src, dst)

    def reorder(self, indices: torch.Tensor | list[int]) -> None:
        """Beam search: sequence b becomes old sequence ``indices[b]`` (paged: only the block table moves)."""
        if not self.ragged and self.window is not None:
            raise ValueError("reorder of a lockstep cache with a window is not supported; use ragged=True")
        _serving.reorder(self, indices)

    @property
    def pages_used(self) -> int:
        """Pages holding keys: referenced pages of a paged cache; a contiguous cache counts one page of
        ``capacity`` positions per sequence."""
        return self.pages.pages_used if self.pages is not None else self.batch_size

    @property
    def bytes(self) -> int:
        """Bytes of keys and values in :attr:`pages_used` (a contiguous cache: its whole buffers)."""
        per_pos = self.num_kv_heads * (self.head_dim + self.value_dim) * self.key.element_size()
        size = self.page_size if self.page_size is not None else self.capacity
        return self.pages_used * size * per_pos

    def flash_args(self) -> dict:
        """``k_cache``, ``v_cache``, ``cache_seqlens`` (and ``block_table``) for
        :func:`~selfattention.flash_kvcache.flash_attn_with_kvcache` reading this cache as it is (flash-attn's
        layout: a view of the contiguous buffers, or the page pools)."""
        self._need_ragged("flash_args")
        seqlens = torch.tensor(self._lengths, dtype=torch.int32, device=self.device)
        if self.pages is not None:
            return dict(k_cache=self.key_pages, v_cache=self.value_pages, cache_seqlens=seqlens,
                        block_table=self.pages.tensor)  # fmt: skip
        return dict(
            k_cache=self.key.transpose(1, 2), v_cache=self.value.transpose(1, 2), cache_seqlens=seqlens
        )

    def _need_ragged(self, what: str) -> None:
        if not self.ragged:
            raise ValueError(
                f"{what} needs per-sequence lengths: create the KVCache with ragged=True (or page_size)"
            )

    def __repr__(self) -> str:
        w = "" if self.window is None else f", window={self.window}"
        if self.ragged:
            w += f", lengths={self._lengths}" + (
                "" if self.page_size is None else f", page_size={self.page_size}"
            )
        return (
            f"KVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, capacity={self.capacity}{w}, offset={self.offset}, "
            f"length={self.length})"
        )

    # ----------------------------------------------------------------- update
    def _check(self, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None) -> int:
        for name, t, d in (("key", key, self.head_dim), ("value", value, self.value_dim)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            want = (self.batch_size, self.num_kv_heads, t.shape[2] if t.dim() == 4 else -1, d)
            if t.dim() != 4 or t.shape[0] != want[0] or t.shape[1] != want[1] or t.shape[3] != d:
                raise ValueError(
                    f"{name} must have shape (batch_size={self.batch_size}, num_kv_heads="
                    f"{self.num_kv_heads}, T, {d}) for this cache, got {_fmt(t.shape)}"
                )
            if t.dtype != self.key.dtype:
                raise TypeError(f"{name} has dtype {t.dtype}, the cache holds {self.key.dtype}")
            if t.device != self.key.device:
                raise ValueError(f"{name} is on {t.device}, the cache is on {self.key.device}")
        if key.shape[2] != value.shape[2]:
            raise ValueError(f"key {_fmt(key.shape)} and value {_fmt(value.shape)} have different lengths")
        n = key.shape[2]
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
                raise TypeError(
                    "key_padding_mask for a cached call must be a bool tensor (True = real token)"
                )
            if tuple(key_padding_mask.shape) != (self.batch_size, n):
                raise ValueError(
                    f"key_padding_mask must have shape (batch_size, new tokens) = ({self.batch_size}, {n}) "
                    f"with a KV cache (one flag per token passed in), got {_fmt(key_padding_mask.shape)}"
                )
        return n

    def update(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Visibility]:
        """Append the keys/values of ``Tq`` new tokens and return what they attend over.

        Args:
            key: (B, Hkv, Tq, D), the new tokens' keys (dtype/device of the cache).
            value: (B, Hkv, Tq, Dv).
            key_padding_mask: optional bool (B, Tq), True = real token, False = padding; remembered with
                the keys, so later queries never attend to a padding token either.

        Returns:
            ``(keys, values, visibility)``: keys (B, Hkv, Tk, D) and values (B, Hkv, Tk, Dv) are the kept
            past followed by the new tokens (views of the buffers, valid until the next update, or new
            tensors when the new keys/values require grad); the new tokens are the last Tq of the Tk.
            ``visibility`` is a :class:`~selfattention.visibility.Visibility` — causal with query i at
            position ``offset + i`` (bottom-right), inside the window if any, with the padding flags as a
            (B, 1, 1, Tk) key mask — that every attention function takes as ``attn_mask``: the block
            engine plans with it instead of a dense (Tq, Tk) mask; ``visibility.to_mask()`` gives the
            dense bool mask (True = attend).

        Autograd: the cache stores ``key.detach()`` / ``value.detach()``, so the buffers never require
        grad and no graph outlives the call (decoding without ``torch.no_grad()`` does not leak memory).
        When grad is enabled and ``key``/``value`` require grad, the returned keys/values are
        ``cat(cached (constants), key/value (live))``: the output of this call is differentiable with
        respect to its own new tokens, while keys/values cached by earlier calls are constants (their
        gradient flows only through the call that produced them). Training on full sequences should not
        use a cache.

        Raises:
            CacheCapacityError: without a window, when ``offset + Tq > capacity``; the cache is unchanged.
            ValueError (ragged/paged): a key_padding_mask row that is not real tokens then padding, tokens
            for a finished sequence; :class:`PoolExhaustedError` when the page pool is full. Nothing changes.

        Ragged/paged caches: row b's real tokens (``key_padding_mask`` True, first in the row) are stored at
        positions ``lengths[b] …``; the mask is (B, 1, Tq or 1, Tk) and places query i of sequence b at
        ``lengths[b] + i`` (see the module docstring). The returned keys are the stored (detached) ones:
        no gradient reaches this call's new keys/values (serving is inference). Paged caches return a
        gather of the visible pages; :func:`~selfattention.flash_kvcache.flash_attn_with_kvcache` with
        :meth:`flash_args` reads the pool without it.
            TypeError/ValueError: shape, dtype or device not those of the cache.
        """
        if self.ragged:
            return _serving.update(self, key, value, key_padding_mask)
        return self._update_lockstep(key, value, key_padding_mask)

    def _update_lockstep(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Visibility]:
        n = self._check(key, value, key_padding_mask)
        window = self.window
        if window is None and self._stored + n > self.capacity:
            raise CacheCapacityError(
                f"KVCache capacity exceeded: it holds {self._stored} of {self.capacity} positions and cannot "
                f"take {n} more (needs {self._stored + n}); create it with capacity >= {self._stored + n}, "
                "use a sliding window, or call reset()"
            )
        if window is not None and self._stored > window - 1:
            # Lazy eviction: drop the keys no query from `offset` on can see (the previous call's
            # queries needed them, so they were kept until now).
            keep = window - 1
            src = slice(self._stored - keep, self._stored)
            if keep > 0:
                self.key[:, :, :keep] = self.key[:, :, src].clone()
                self.value[:, :, :keep] = self.value[:, :, src].clone()
                self.real[:, :keep] = self.real[:, src].clone()
            self._stored = keep
        past = self._stored
        total = past + n
        real_new = key_padding_mask
        if real_new is not None and not bool(real_new.all()):
            self._padded = True

        # The buffers hold DETACHED keys/values: a cache is state, not part of any autograd graph, so
        # no step's graph is kept alive by the next one. The keys/values passed in keep their gradient
        # in what this call returns (see the docstring).
        live = torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)
        if total <= self.capacity:
            self.key[:, :, past:total] = key.detach()
            self.value[:, :, past:total] = value.detach()
            if real_new is not None:
                self.real[:, past:total] = real_new
            else:
                self.real[:, past:total] = True
            if live:  # [detached past ∪ live new]: new memory, differentiable w.r.t. this call's keys
                keys = torch.cat([self.key[:, :, :past], key], dim=2)
                values = torch.cat([self.value[:, :, :past], value], dim=2)
            else:
                keys = self.key[:, :, :total]  # (B, Hkv, Tk, D), a view
                values = self.value[:, :, :total]
            real = self.real[:, :total]
            self._stored = total
        else:
            # Only reachable with a window: a chunk longer than the free room. Attend over a temporary
            # [cache ∪ chunk], then keep the W - 1 most recent keys in the buffer.
            keys = torch.cat([self.key[:, :, :past], key], dim=2)  # (B, Hkv, Tk, D), new memory
            values = torch.cat([self.value[:, :, :past], value], dim=2)
            new_real = real_new if real_new is not None else self.real.new_ones(self.batch_size, n)
            real = torch.cat([self.real[:, :past], new_real], dim=1)  # (B, Tk)
            keep = min(window - 1, total) if window is not None else 0
            if keep > 0:
                self.key[:, :, :keep] = keys[:, :, total - keep :].detach()
                self.value[:, :, :keep] = values[:, :, total - keep :].detach()
                self.real[:, :keep] = real[:, total - keep :]
            self._stored = keep

        # Positions: queries at offset .. offset + n - 1; keys at offset - past .. offset + n - 1, so query i
        # sits at key index past + i = Tk - Tq + i: bottom-right, the engine's default.
        self.offset += n
        pad = real[:, None, None, :] if self._padded else None  # (B, 1, 1, Tk)
        return keys, values, Visibility(n, total, is_causal=True, window=window, attn_mask=pad)
