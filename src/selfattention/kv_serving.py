"""The serving side of :class:`~selfattention.kv_cache.KVCache`: per-sequence lengths, pages, beams, forks.

Functions on a ``KVCache`` built with ``ragged=True`` or ``page_size=`` (see its docstring); the cache
calls them. Every function validates everything first and changes nothing when it raises.
"""

from __future__ import annotations

import torch

from .visibility import Visibility

__all__ = ["update", "assign", "reorder", "fork", "release", "gather"]


def _fmt(values) -> str:
    return "[" + ", ".join("T" if v else "F" for v in values) + "]"


def _counts(cache, n: int, key_padding_mask: torch.Tensor | None) -> tuple[list[int], torch.Tensor]:
    """Tokens each sequence appends, and the (B, n) bool of the real ones (each row's first counts[b])."""
    b = cache.batch_size
    if key_padding_mask is None:
        return [n] * b, torch.ones(b, n, dtype=torch.bool, device=cache.device)
    counts = key_padding_mask.sum(1).tolist()
    prefix = torch.arange(n, device=key_padding_mask.device)[None] < key_padding_mask.sum(1, keepdim=True)
    if not torch.equal(prefix, key_padding_mask):
        bad = next(i for i in range(b) if not torch.equal(prefix[i], key_padding_mask[i]))
        raise ValueError(
            f"key_padding_mask row {bad} is {_fmt(key_padding_mask[bad].tolist())}: a ragged cache takes each "
            "row's real tokens first, then padding (right padding, True = real token)"
        )
    return counts, prefix


def _check_room(cache, counts: list[int]) -> None:
    for b, c in enumerate(counts):
        if c and b in cache._finished:
            raise ValueError(
                f"sequence {b} is finished (finish({b}) was called) and cannot take the {c} token(s) of row {b}; "
                f"release({b}) to reuse the slot, or mark row {b} as padding in key_padding_mask"
            )
        if cache._lengths[b] + c > cache.capacity:
            from .kv_cache import CacheCapacityError

            raise CacheCapacityError(
                f"KVCache capacity exceeded: sequence {b} holds {cache._lengths[b]} of {cache.capacity} positions "
                f"and cannot take {c} more (needs {cache._lengths[b] + c}); create the cache with capacity >= "
                f"{cache._lengths[b] + c}, or release({b})"
            )


def gather(cache, pool: torch.Tensor, tk: int) -> torch.Tensor:
    """(B, Hkv, tk, X) of a paged pool through the block table: one gather of the visible pages."""
    ps = cache.page_size
    table = cache.pages.tensor[:, : -(-tk // ps)].long().clamp(min=0)  # −1 (no page) → page 0, hidden anyway
    return pool[table].flatten(1, 2)[:, :tk].transpose(1, 2)


def update(cache, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None):
    """:meth:`KVCache.update` for a ragged/paged cache (see the KVCache docstring)."""
    n = cache._check(key, value, key_padding_mask)
    counts, real = _counts(cache, n, key_padding_mask)
    _check_room(cache, counts)
    need = cache.pages.plan(counts) if cache.pages is not None else []
    # ---- nothing below raises: the cache changes only now
    dev = cache.device
    old = torch.tensor(cache._lengths, device=dev)
    b_idx, i_idx = real.nonzero(as_tuple=True)
    pos = old[b_idx] + i_idx
    kn = key.detach().transpose(1, 2)[b_idx, i_idx]  # (N, Hkv, D)
    vn = value.detach().transpose(1, 2)[b_idx, i_idx]
    if cache.pages is not None:
        for src, dst in cache.pages.apply(need):  # copy-on-write of shared pages
            cache.key_pages[dst] = cache.key_pages[src]
            cache.value_pages[dst] = cache.value_pages[src]
        ps = cache.page_size
        page = cache.pages.tensor.long()[b_idx, pos // ps]
        cache.key_pages.index_put_((page, pos % ps), kn)
        cache.value_pages.index_put_((page, pos % ps), vn)
    else:
        cache.key.transpose(1, 2).index_put_((b_idx, pos), kn)
        cache.value.transpose(1, 2).index_put_((b_idx, pos), vn)
    cache._lengths = [a + c for a, c in zip(cache._lengths, counts, strict=True)]
    if cache.pages is not None:
        cache.pages.lengths = list(cache._lengths)
    cache.offset = max(cache._lengths)
    tk = cache.offset
    if cache.pages is not None:
        keys, values = gather(cache, cache.key_pages, tk), gather(cache, cache.value_pages, tk)
    else:
        keys, values = cache.key[:, :, :tk], cache.value[:, :, :tk]
    # query i of sequence b at position old[b] + i sees keys j <= old[b] + i that exist (j < new length)
    j = torch.arange(tk, device=dev)
    end = torch.tensor(cache._lengths, device=dev)[:, None, None]
    if n > 1 and len(set(old.tolist())) == 1:  # the same past everywhere (a ragged prefill): causal at one
        # offset + a key mask, the engine's structural plan, no (B, 1, Tq, Tk) mask
        keys_ok = (j < end)[:, None]  # (B, 1, 1, Tk)
        at = int(old[0])
        return (
            keys,
            values,
            Visibility(n, tk, is_causal=True, window=cache.window, q_offset=at, attn_mask=keys_ok),
        )
    rows = torch.arange(n if n > 1 else 1, device=dev)[None, :, None]
    qpos = old[:, None, None] + rows
    ok = (j < end) & (j <= qpos)
    if cache.window is not None:
        ok = ok & (j > qpos - cache.window)
    return keys, values, Visibility(n, tk, attn_mask=ok[:, None])  # mask (B, 1, Tq or 1, Tk)


def check_slot(cache, name: str, b: object) -> int:
    if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < cache.batch_size:
        raise ValueError(f"{name} must be a sequence index in [0, {cache.batch_size}), got {b!r}")
    return b


def reorder(cache, indices) -> None:
    """Row b becomes old row ``indices[b]`` (beam search)."""
    idx = torch.as_tensor(indices).tolist() if not isinstance(indices, list) else list(indices)
    if len(idx) != cache.batch_size or not all(isinstance(i, int) and 0 <= i < cache.batch_size for i in idx):
        raise ValueError(
            f"indices must hold {cache.batch_size} sequence indices in [0, {cache.batch_size}), got {indices!r}"
        )
    t = torch.tensor(idx, device=cache.device)
    if cache.pages is not None:
        cache.pages.reorder(idx)
    else:
        cache.key.copy_(cache.key.index_select(0, t))
        cache.value.copy_(cache.value.index_select(0, t))
    cache.real.copy_(cache.real.index_select(0, t))
    cache._lengths = [cache._lengths[i] for i in idx]
    cache._finished = {b for b, i in enumerate(idx) if i in cache._finished}


def fork(cache, src: int, dst: int) -> None:
    """Sequence ``dst`` becomes a copy of ``src`` (its own content is dropped): a paged cache shares the pages
    (copied when either sequence appends to a shared partial page), a contiguous one copies the row."""
    check_slot(cache, "src", src)
    check_slot(cache, "dst", dst)
    if src == dst:
        raise ValueError(f"fork: src and dst are the same sequence ({src})")
    if cache.pages is not None:
        cache.pages.share(src, dst)
    else:
        n = cache._lengths[src]
        cache.key[dst, :, :n] = cache.key[src, :, :n]
        cache.value[dst, :, :n] = cache.value[src, :, :n]
    cache.real[dst] = cache.real[src]
    cache._lengths[dst] = cache._lengths[src]
    cache._finished.discard(dst)
    if src in cache._finished:
        cache._finished.add(dst)


def release(cache, b: int) -> None:
    """Empty sequence b (its pages go back to the pool) so that the slot takes a new sequence."""
    check_slot(cache, "sequence", b)
    if cache.pages is not None:
        cache.pages.release(b)
    cache._lengths[b] = 0
    cache._finished.discard(b)
    cache.offset = max(cache._lengths) if cache.ragged else cache.offset


def assign(cache, b: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Fill the empty sequence ``b`` with ``key`` (Hkv, T, D) / ``value`` (Hkv, T, Dv) at positions 0 … T − 1
    (a sequence prefilled elsewhere joins the batch: continuous batching)."""
    check_slot(cache, "sequence", b)
    if cache._lengths[b]:
        raise ValueError(
            f"sequence {b} holds {cache._lengths[b]} tokens: release({b}) before assigning to it"
        )
    n = cache._check(
        key[None].expand(cache.batch_size, *key.shape),
        value[None].expand(cache.batch_size, *value.shape),
        None,
    )
    counts = [0] * cache.batch_size
    counts[b] = n
    cache._finished.discard(b)
    _check_room(cache, counts)
    need = cache.pages.plan(counts) if cache.pages is not None else []
    # ---- nothing below raises
    if cache.pages is not None:
        cache.pages.apply(need)
        ps = cache.page_size
        pos = torch.arange(n, device=cache.device)
        page = cache.pages.tensor[b].long()[pos // ps]
        cache.key_pages.index_put_((page, pos % ps), key.detach().transpose(0, 1))
        cache.value_pages.index_put_((page, pos % ps), value.detach().transpose(0, 1))
    else:
        cache.key[b, :, :n] = key.detach()
        cache.value[b, :, :n] = value.detach()
    cache.real[b, :n] = True
    cache._lengths[b] = n
    if cache.pages is not None:
        cache.pages.lengths[b] = n
    cache.offset = max(cache._lengths)
