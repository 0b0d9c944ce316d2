"""The arguments of :func:`selfattention.flash_kvcache.flash_attn_with_kvcache`, checked before anything is
written: every failure names the argument and its value (see that function's docstring for the rules)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

__all__ = ["CapacityError", "KVCacheArgs", "as_int", "check_index", "check_kvcache_args", "window_pair"]

_INDEX_DTYPE = torch.int32  # flash-attn's dtype for every index tensor


def _fmt(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


@dataclass
class KVCacheArgs:
    batch: int
    q_len: int
    new: int  # seqlen_new (0 without k/v)
    seqlens: list[int]  # cache_seqlens before the call
    leftpad: list[int]
    rows: list[int] | None  # cache_batch_idx, or None = 0 … B-1
    capacity: int  # positions one sequence can hold
    page: int  # page size (0 = contiguous cache)
    pages: list[int] | None  # pages each sequence uses after the call (block table columns)
    left: int
    right: int
    memo: dict = field(default_factory=dict)  # per-call results shared by keys and values


class CapacityError(ValueError, RuntimeError):
    """A sequence longer than its cache (or its ``block_table`` row) can hold. A ``ValueError`` like every
    bad argument here, and a ``RuntimeError`` as flash-attn's own check (code catching either works)."""


def as_int(name: str, x: object) -> int:
    """An int argument; a one-element integer tensor counts (flash-attn's tests pass
    ``window_size=torch.randint(0, seqlen_k, (2,))``). bool and float are refused (``TypeError``)."""
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point() and x.dtype != torch.bool:
        return int(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {x!r}")
    return int(x)


def window_pair(window_size: object) -> tuple[int, int]:
    """flash-attn's ``window_size``: a pair (left, right) of ints ≥ −1 (−1 = infinite), as a tuple, list or
    1-D integer tensor of two entries."""
    if isinstance(window_size, torch.Tensor):
        window_size = window_size.tolist() if window_size.dim() == 1 else window_size
    if not isinstance(window_size, tuple | list) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right) of ints, got {window_size!r}")
    left, right = (as_int(f"window_size[{i}]", w) for i, w in enumerate(window_size))
    for i, w in enumerate((left, right)):
        if w < -1:
            raise ValueError(f"window_size[{i}] must be >= -1 (-1 = infinite), got {w}")
    return left, right


def check_index(name: str, t: object, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype int32, got {type(t).__name__}")
    if t.dtype != _INDEX_DTYPE:
        raise TypeError(
            f"{name} must have dtype torch.int32 (as flash-attn), got {t.dtype}; use {name}.int()"
        )
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {_fmt(shape)}, got {_fmt(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the cache is on {device}")
    return t


def check_kvcache_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
           cache_leftpad, block_table, causal, window_size, softcap, alibi_slopes, num_splits) -> KVCacheArgs:  # fmt: skip
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got {what}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {_fmt(t.shape)}")
    batch, q_len, heads, dim = q.shape
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but q has {q.dtype}: the cache and q must share a dtype"
            )
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}"
            )
    hkv = k_cache.shape[2]
    if k_cache.shape[-1] != dim:
        raise ValueError(f"k_cache head_dim {k_cache.shape[-1]} differs from q's {dim} (q {_fmt(q.shape)})")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"v_cache {_fmt(v_cache.shape)} must match k_cache {_fmt(k_cache.shape)} but for head_dim"
        )
    if hkv == 0 or heads % hkv:
        raise ValueError(f"q's heads ({heads}) must be a multiple of the cache's kv heads ({hkv})")
    if (k is None) != (v is None):
        raise ValueError("give both k and v (the new keys and values), or neither")
    new = 0
    if k is not None:
        for name, t, d in (("k", k, dim), ("v", v, v_cache.shape[-1])):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[0] != batch or t.shape[2] != hkv or t.shape[3] != d:
                raise ValueError(
                    f"{name} must have shape (batch_size={batch}, seqlen_new, nheads_k={hkv}, {d}), got {_fmt(t.shape)}"
                )
            if t.dtype != k_cache.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but the cache holds {k_cache.dtype}")
            if t.device != k_cache.device:
                raise ValueError(f"{name} is on {t.device} but the cache is on {k_cache.device}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k {_fmt(k.shape)} and v {_fmt(v.shape)} have different seqlen_new")
        new = k.shape[1]
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if new and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True)):
                raise ValueError(
                    f"{name} has stride 0 along a dimension (an expanded view, strides {tuple(t.stride())}): "
                    "writing the new keys/values into it would make several positions share memory; pass a "
                    "real buffer (e.g. .contiguous())"
                )
    dev = q.device
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError(
                "cache_batch_idx cannot be used with block_table (a paged cache has no batch rows)"
            )
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
            raise ValueError(
                f"block_table must be (batch_size, max_num_blocks_per_seq), got {getattr(block_table, 'shape', block_table)}"
            )
        check_index("block_table", block_table, (batch, block_table.shape[1]), dev)
        page, num_pages = k_cache.shape[1], k_cache.shape[0]
        capacity = block_table.shape[1] * page
    else:
        page, num_pages = 0, 0
        capacity = k_cache.shape[1]
    rows = None
    if cache_batch_idx is not None:
        rows = check_index("cache_batch_idx", cache_batch_idx, (batch,), dev).tolist()
        for b, r in enumerate(rows):
            if not 0 <= r < k_cache.shape[0]:
                raise ValueError(
                    f"cache_batch_idx[{b}] = {r} is outside the cache's {k_cache.shape[0]} batch rows"
                )
        if new and len(set(rows)) != len(rows):
            raise ValueError(
                f"cache_batch_idx {rows} repeats a row: two sequences would write the same cache row"
            )
    elif not paged and k_cache.shape[0] < batch:
        raise ValueError(
            f"k_cache has {k_cache.shape[0]} batch rows, q has batch_size {batch}: pass cache_batch_idx"
        )
    if cache_seqlens is None:
        seqlens = [capacity] * batch
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlens = [cache_seqlens] * batch
    else:
        seqlens = check_index("cache_seqlens", cache_seqlens, (batch,), dev).tolist()
    for b, n in enumerate(seqlens):
        if n < 0:
            raise ValueError(f"cache_seqlens[{b}] = {n} is negative")
        if n + new > capacity:
            raise CapacityError(
                f"cache_seqlens[{b}] = {n} + seqlen_new {new} = {n + new} exceeds the cache's capacity of {capacity} "
                + (
                    f"positions of its block_table row (max_num_blocks_per_seq {capacity // page} × page_block_size {page})"
                    if paged
                    else "positions (seqlen_cache)"
                )
            )
    leftpad = [0] * batch
    if cache_leftpad is not None:
        leftpad = check_index("cache_leftpad", cache_leftpad, (batch,), dev).tolist()
        for b, (lp, n) in enumerate(zip(leftpad, seqlens, strict=True)):
            if not 0 <= lp <= n:
                raise ValueError(f"cache_leftpad[{b}] = {lp} must be in [0, cache_seqlens[{b}] = {n}]")
    pages = None
    if paged:
        pages = _check_table(block_table, seqlens, new, page, num_pages)
    left, right = window_pair(window_size)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal:
        right = 0
    # flash-attn's normalisation (mha_fwd_kvcache): a side as long as the cache is infinite; it decides
    # whether the call is "local", hence where rotary places q (identical visibility either way)
    left, right = (-1 if w >= capacity else w for w in (left, right))
    if isinstance(softcap, bool) or not isinstance(softcap, int | float) or not 0 <= softcap < float("inf"):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("give both rotary_cos and rotary_sin, or neither")
    if rotary_cos is not None:
        if k is None:
            raise ValueError(
                "rotary_cos/rotary_sin need the new k and v (the rotation is applied as they are appended)"
            )
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
                raise ValueError(
                    f"{name} must be a float tensor (seqlen_ro, rotary_dim / 2), got {getattr(t, 'shape', t)}"
                )
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(
                f"rotary_sin {_fmt(rotary_sin.shape)} must match rotary_cos {_fmt(rotary_cos.shape)}"
            )
        if 2 * rotary_cos.shape[1] > dim:
            raise ValueError(f"rotary_dim = 2 × {rotary_cos.shape[1]} exceeds head_dim {dim}")
        # the new keys sit at n … n + new − 1; q at n … n + q_len − 1 when causal/local, else all at n
        q_span = q_len if (left >= 0 or right >= 0) else min(q_len, 1)
        need = max(n + max(new, q_span) for n in seqlens)
        if rotary_cos.shape[0] < need:
            raise ValueError(
                f"rotary_cos has {rotary_cos.shape[0]} positions, the call needs {need} (cache_seqlens + seqlen)"
            )
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
            raise TypeError("alibi_slopes must be a float32 tensor (nheads,) or (batch_size, nheads)")
        if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            raise ValueError(
                f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}), got {_fmt(alibi_slopes.shape)}"
            )
        if not bool(torch.isfinite(alibi_slopes).all()):
            raise ValueError(f"alibi_slopes must be finite, got {alibi_slopes.tolist()}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    return KVCacheArgs(batch, q_len, new, seqlens, leftpad, rows, capacity, page, pages, left, right)


def _check_table(
    block_table: torch.Tensor, seqlens: list[int], new: int, page: int, num_pages: int
) -> list[int]:
    """Validate the block table entries a call uses (vectorised: a table has B × pages entries); returns the
    number of pages each sequence uses."""
    batch, width = block_table.shape
    n_used = [-(-(n + new) // page) for n in seqlens]
    table = block_table.long()
    col = torch.arange(width, device=table.device)
    used = col[None] < torch.tensor(n_used, device=table.device)[:, None]  # (B, P)
    bad = used & ((table < 0) | (table >= num_pages))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{b}, {j}] = {int(table[b, j])} points outside the pool of {num_pages} pages"
        )
    # a page twice in one row: sort the used entries (unused ones made distinct negatives) and compare neighbours
    marked = torch.where(used, table, -1 - col[None].expand_as(table))
    srt = marked.sort(dim=1).values
    twice = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    if bool(twice.any()):
        b, j = (int(x) for x in twice.nonzero()[0])
        raise ValueError(
            f"block_table row {b} uses page {int(srt[b, j])} twice (a sequence's pages must be distinct)"
        )
    if new:  # the pages this call writes: a few per sequence
        writer: dict[int, int] = {}
        rows = block_table.tolist() if batch * width <= 4096 else None
        for b in range(batch):
            for j in range(seqlens[b] // page, n_used[b]):
                p = rows[b][j] if rows is not None else int(table[b, j])
                if writer.setdefault(p, b) != b:
                    raise ValueError(
                        f"page {p} would be written by sequences {writer[p]} and {b} (block_table[{b}, {j}]); "
                        "copy a shared page before appending to it"
                    )
        # a page one sequence writes may not be read by another (its keys would change under it): pages
        # written are referenced once in the used table (the writer's own entry), else find the reader
        wp = torch.tensor(list(writer), dtype=torch.long, device=table.device)
        written = torch.zeros(num_pages, dtype=torch.bool, device=table.device)
        written[wp] = True
        if int((used & written[table.clamp(0, num_pages - 1)]).sum()) > len(writer):
            owner = torch.full((num_pages,), -1, dtype=torch.long, device=table.device)
            owner[wp] = torch.tensor(list(writer.values()), dtype=torch.long, device=table.device)
            who = owner[table.clamp(0, num_pages - 1)]  # (B, P): the page's writer, or −1
            hit = used & (who >= 0) & (who != torch.arange(batch, device=table.device)[:, None])
            b, j = (int(x) for x in hit.nonzero()[0])
            raise ValueError(
                f"page {int(table[b, j])} would be written by sequence {int(who[b, j])} while sequence {b} "
                f"reads it (block_table[{b}, {j}]); copy a shared page before appending to it"
            )
    return n_used
