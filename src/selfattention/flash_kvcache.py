"""``flash_attn_with_kvcache``: flash-attn 2's decoding entry point — a KV cache with per-sequence lengths,
optionally paged — on this library's block engine (CPU, or any device the engine's vendor kernel serves).

One call (flash-attn 2's semantics, signature and defaults): the new keys/values ``k``/``v`` (if given) are
written **in place** into ``k_cache``/``v_cache`` at each sequence's own length ``cache_seqlens[b]``
(rotated first when ``rotary_cos``/``rotary_sin`` are given), then ``q`` attends over the keys each sequence
can see. Per-sequence lengths are the point: sequence b sees keys ``cache_leftpad[b] … cache_seqlens[b] +
seqlen_new − 1``; with ``causal=True`` its queries sit bottom-right **on its own keys**. Two sequences of a
batch, lengths 3 and 5, one query each (1 = attend)::

    keys →           0 1 2 3 4
    sequence 0       1 1 1 0 0          (cache_seqlens = 3)
    sequence 1       1 1 1 1 1          (cache_seqlens = 5)

and with two new tokens per sequence, causal (the cache lengths before the call are 1 and 3)::

    keys →           0 1 2 3 4
    seq 0, query 0   1 1 0 0 0
    seq 0, query 1   1 1 1 0 0
    seq 1, query 0   1 1 1 1 0
    seq 1, query 1   1 1 1 1 1

How it runs: the keys are a strided view of the cache, sliced to the span some sequence can see (never a
copy of the whole cache; with ``block_table`` a view when the pages used form equally spaced runs, else one
gather of the visible pages only); the per-sequence visibility is a bool key mask (B, 1, 1, Tk) riding along
the engine's plan when it does not depend on the query row (decoding: one token per sequence; non-causal
chunks), else a (B, 1, Tq, Tk) mask (chunks of several tokens with causal/window: O(Tq·Tk), meant for short
chunks). When every sequence has the same length the call needs no mask at all (the plain causal plan).
A flex-style predicate (``mask_mod(b, h, q_idx, kv_idx)`` with per-batch offsets) would let the engine plan
per-sequence causal chunks without the dense (B, 1, Tq, Tk) mask and skip blocks per sequence.

Differences from flash-attn (documented, never silent): any float dtype (flash-attn: fp16/bf16 on CUDA), any
``page_block_size`` ≥ 1 (flash-attn: a multiple of 256), ``cache_leftpad`` together with ``block_table``
(flash-attn refuses the pair), and every index is validated before anything is written (flash-attn reads
out of bounds); ``cache_batch_idx`` with repeated entries and new ``k``/``v`` is refused (flash-attn: "the
values updated might come from any of the duplicates"). ``num_splits`` is accepted and has no effect on
the result (flash-attn uses it only to split the work). No backward pass (as flash-attn).

Sources: Dao 2023, "FlashAttention-2"; flash-attn's ``flash_attn_interface.flash_attn_with_kvcache``
docstring (the semantics followed here); Kwon et al. 2023, "Efficient Memory Management for Large Language
Model Serving with PagedAttention" (the block table); Su et al. 2021, "RoFormer" (rotary embeddings).
"""

from __future__ import annotations

import math

import torch

from .kernels import engine, vendor
from .kernels.plan import Call, Plan
from .kvcache_args import KVCacheArgs, check_kvcache_args
from .visibility import Visibility

__all__ = ["flash_attn_with_kvcache", "apply_rotary"]


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotary embedding of ``x`` (B, T, heads, D) at integer ``positions`` (B, T) (a new tensor).

    ``cos``/``sin`` are (seqlen_ro, rotary_dim / 2); the first ``rotary_dim`` features rotate, the rest stay.
    ``interleaved``: pairs (0, 1), (2, 3), … (GPT-J); else (i, i + rotary_dim / 2) (GPT-NeoX). Each pair
    (x₁, x₂) at position p becomes (x₁ cos θ − x₂ sin θ, x₁ sin θ + x₂ cos θ), θ = angle p of its frequency.

    >>> x = torch.tensor([[[[1.0, 0.0]]]])                    # one feature pair, (1, 0)
    >>> c, s = torch.tensor([[1.0], [0.0]]), torch.tensor([[0.0], [1.0]])   # position 1: a quarter turn
    >>> apply_rotary(x, c, s, torch.tensor([[1]]), True)
    tensor([[[[0., 1.]]]])
    """
    half = cos.shape[-1]
    rd = 2 * half
    work = torch.promote_types(x.dtype, torch.float32)
    c = cos.to(work)[positions][:, :, None, :]  # (B, T, 1, rd/2)
    s = sin.to(work)[positions][:, :, None, :]
    xr = x[..., :rd].to(work)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rot.to(x.dtype), x[..., rd:]], dim=-1)


def _write(a: KVCacheArgs, k_cache, v_cache, k, v, block_table) -> None:
    """Write the new keys/values at positions cache_seqlens[b] … + seqlen_new − 1 (one index_put each)."""
    dev = k_cache.device
    pos = torch.tensor(a.seqlens, device=dev)[:, None] + torch.arange(a.new, device=dev)  # (B, n)
    if a.page:
        bt = block_table.long()
        first = torch.arange(a.batch, device=dev)[:, None].expand_as(pos)
        idx = (bt[first, pos // a.page], pos % a.page)
    else:
        rows = torch.arange(a.batch, device=dev) if a.rows is None else torch.tensor(a.rows, device=dev)
        idx = (rows[:, None].expand_as(pos), pos)
    k_cache.index_put_(idx, k)
    v_cache.index_put_(idx, v)


def _affine(rows: torch.Tensor) -> tuple[int, int] | None:
    """(first page, page step between sequences) if every row is a run of consecutive pages and the runs
    start at equally spaced pages (step ≥ 0): then the visible keys are one strided view of the pool."""
    n = rows.shape[1]
    if not bool((rows - rows[:, :1] == torch.arange(n, device=rows.device)).all()):
        return None
    starts = rows[:, 0].tolist()
    step = starts[1] - starts[0] if len(starts) > 1 else 0
    if step < 0 or any(b - a != step for a, b in zip(starts, starts[1:], strict=False)):
        return None
    return starts[0], step


def _run(a: KVCacheArgs, block_table: torch.Tensor, p0: int, p1: int) -> tuple[int, int] | None:
    """:func:`_affine` of block-table columns [p0, p1), computed once per call (keys and values share it)."""
    if (p0, p1) not in a.memo:
        a.memo[(p0, p1)] = _affine(block_table[:, p0:p1].long())
    return a.memo[(p0, p1)]


def _visible(a: KVCacheArgs, cache: torch.Tensor, block_table, c0: int, c1: int) -> torch.Tensor:
    """Keys (or values) at positions [c0, c1) of every sequence, (B, Hkv, c1 − c0, D): a view when possible."""
    if not a.page:
        if a.rows is None:
            rows = cache if cache.shape[0] == a.batch else cache[: a.batch]  # (one view op fewer per step)
            return rows[:, c0:c1].transpose(1, 2)
        if a.rows == list(range(a.rows[0], a.rows[0] + a.batch)):
            return cache[a.rows[0] : a.rows[0] + a.batch, c0:c1].transpose(1, 2)
        idx = torch.tensor(a.rows, device=cache.device)
        return cache[:, c0:c1].index_select(0, idx).transpose(1, 2)  # a copy of the visible span only
    ps = a.page
    p0, p1 = c0 // ps, -(-c1 // ps)
    hk, d = cache.shape[2], cache.shape[3]
    run = _run(a, block_table, p0, p1) if cache.is_contiguous() else None
    if run is not None:
        first, step = run
        step = step if a.batch > 1 else p1 - p0  # (one sequence: a natural stride, not 0)
        view = cache.as_strided(
            (a.batch, (p1 - p0) * ps, hk, d),
            (step * ps * hk * d, hk * d, d, 1),
            cache.storage_offset() + first * ps * hk * d,
        )
    else:  # scattered pages: gather the visible pages (not the pool)
        view = cache[block_table[:, p0:p1].long()].flatten(1, 2)  # (B, P·ps, Hkv, D)
    off = c0 - p0 * ps
    return view[:, off : off + c1 - c0].transpose(1, 2)


def _pool_span(a: KVCacheArgs, k_cache, v_cache, block_table, device):
    """Sequences whose pages lie scattered in a dense stretch of the pool: the stretch in pool order (a view,
    no copy) with a mask of each sequence's own slots — valid whenever key order does not matter (one query
    per sequence, or no causal/window; no ALiBi). Every sequence's queries become rows of one problem over
    the stretch, so the keys are read once. (K (1, Hkv, span, D), V, mask (B, span)) or None when the
    stretch holds more than twice the pages in use."""
    ps = a.page
    n_used = torch.tensor(a.pages, device=device)
    table = block_table[:, : max(a.pages)].long()
    used = torch.arange(table.shape[1], device=device)[None] < n_used[:, None]  # (B, P)
    if not bool(used.any()):
        return None
    pages = table[used]
    lo, hi = int(pages.min()), int(pages.max()) + 1
    if hi - lo > 2 * int(pages.unique().numel()):
        return None
    b_idx, j_idx = used.nonzero(as_tuple=True)
    pos = torch.full((a.batch, hi - lo, ps), -1, dtype=torch.long, device=device)
    pos[b_idx, table[b_idx, j_idx] - lo] = j_idx[:, None] * ps + torch.arange(ps, device=device)
    pos = pos.flatten(1)  # (B, span): each slot's position in each sequence, −1 = not its slot
    end = torch.tensor([n + a.new for n in a.seqlens], device=device)[:, None]
    start = torch.tensor(a.leftpad, device=device)[:, None]
    mask = (pos >= start) & (pos < end)
    k4 = k_cache[lo:hi].flatten(0, 1)[None].transpose(1, 2)  # (1, Hkv, span, D)
    v4 = v_cache[lo:hi].flatten(0, 1)[None].transpose(1, 2)
    return k4, v4, mask


def _mask(a: KVCacheArgs, c0: int, c1: int, row_dependent: bool, device) -> torch.Tensor:
    """Bool (B, 1, Tq or 1, Tk), True = attend, for key positions c0 … c1 − 1."""
    j = torch.arange(c0, c1, device=device)  # (Tk,)
    end = torch.tensor([n + a.new for n in a.seqlens], device=device)[:, None, None]  # (B, 1, 1)
    start = torch.tensor(a.leftpad, device=device)[:, None, None]
    rows = a.q_len if row_dependent else 1
    qpos = end - a.q_len + torch.arange(rows, device=device)[None, :, None]  # (B, rows, 1)
    ok = (j >= start) & (j < end)
    if rows == a.q_len:  # (with one row for several queries, the caller has checked nothing depends on it)
        if a.right >= 0:
            ok = ok & (j <= qpos + a.right)
        if a.left >= 0:
            ok = ok & (j >= qpos - a.left)
    return ok[:, None]  # (B, 1, rows, Tk)


def _alibi(a: KVCacheArgs, slopes: torch.Tensor, c0: int, c1: int, dtype, device) -> torch.Tensor:
    """Float (B or 1, H, Tq, Tk): −slope · |position of query − position of key|."""
    j = torch.arange(c0, c1, device=device)
    end = torch.tensor([n + a.new for n in a.seqlens], device=device)[:, None, None]
    qpos = end - a.q_len + torch.arange(a.q_len, device=device)[None, :, None]  # (B, Tq, 1)
    dist = (qpos - j).abs().to(dtype)[:, None]  # (B, 1, Tq, Tk)
    s = slopes.to(device=device, dtype=dtype)
    s = s[None, :, None, None] if s.dim() == 1 else s[:, :, None, None]
    return -s * dist


def _softcapped(q4, k4, v4, bias, scale: float, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention with soft-capped scores softcap · tanh(q·k · scale / softcap), then ``bias`` (−inf =
    hidden): torch ops in float32 at least, 256 query rows at a time. (out, lse) with lse −inf for blind rows."""
    work = torch.promote_types(q4.dtype, torch.float32)
    g = q4.shape[1] // k4.shape[1]
    k4, v4 = k4.to(work), v4.to(work)
    finite = torch.isfinite(v4)
    v_fin, v_bad = v4, None
    if not bool(finite.all()):
        v_fin, v_bad = torch.where(finite, v4, 0.0), (~finite).to(work)
    outs, lses = [], []
    for r in range(0, q4.shape[2], 256):
        s = torch.einsum("bhgqd,bhkd->bhgqk", q4[:, :, r : r + 256].to(work).unflatten(1, (-1, g)), k4)
        s = (softcap * torch.tanh(s * (scale / softcap))).flatten(1, 2)  # (B, H, rows, Tk)
        if bias is not None:
            b = bias[..., r : r + 256, :] if bias.shape[-2] != 1 else bias
            s = torch.where(b == -math.inf, -math.inf, s + b)  # a hidden NaN key stays hidden
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(lse == -math.inf, 0.0, lse)[..., None]).unflatten(1, (-1, g))
        o = torch.einsum("bhgqk,bhkd->bhgqd", p, v_fin).flatten(1, 2)
        if v_bad is not None:  # a non-finite value reaches only the rows that see it
            hit = torch.einsum("bhgqk,bhkd->bhgqd", (p > 0).to(work), v_bad).flatten(1, 2) > 0
            o = torch.where(hit, torch.einsum("bhgqk,bhkd->bhgqd", p, v4).flatten(1, 2), o)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Append ``k``/``v`` to a KV cache in place and attend over it, per sequence (flash-attn 2's API).

    Args (flash-attn's layouts: sequence before heads):
        q: (batch_size, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim), or with ``block_table`` a
            page pool (num_pages, page_block_size, nheads_k, headdim). Same dtype and device as ``q``.
            **Updated in place** when ``k``/``v`` are given.
        k, v: optional (batch_size, seqlen_new, nheads_k, headdim): written at positions
            ``cache_seqlens[b] … cache_seqlens[b] + seqlen_new − 1`` of sequence b.
        rotary_cos, rotary_sin: optional (seqlen_ro, rotary_dim / 2): rotate the new k at those positions,
            and q at ``cache_seqlens[b] + i`` when causal or windowed, else all of q at ``cache_seqlens[b]``.
            Only with ``k``/``v``. ``rotary_interleaved``: pairs (0, 1), (2, 3), … (True) or (i, i +
            rotary_dim / 2) (False, GPT-NeoX).
        cache_seqlens: int, or int32 (batch_size,): tokens in each sequence's cache before this call
            (None: the whole cache is full).
        cache_batch_idx: int32 (batch_size,): the cache row of each sequence (default 0 … batch_size − 1).
        cache_leftpad: int32 (batch_size,): the first cache position of each sequence (keys before it
            are never seen). Default 0.
        block_table: int32 (batch_size, max_num_blocks_per_seq): page j of sequence b holds its positions
            j·page_block_size … (j + 1)·page_block_size − 1.
        softmax_scale: scale of q·kᵀ (None: 1/√headdim).
        causal: bottom-right per sequence: query i of sequence b sits at key position
            ``seqlen_k[b] − seqlen_q + i`` (``seqlen_k[b] = cache_seqlens[b] + seqlen_new``).
        window_size: (left, right): query at position p sees keys p − left … p + right (−1 = unbounded).
        softcap: > 0: scores become softcap · tanh(scores / softcap) (before any bias).
        alibi_slopes: float32 (nheads,) or (batch_size, nheads): −slope · |p − j| added to the scores.
        num_splits: accepted (an int ≥ 0); how flash-attn splits its work — no effect on the result here.
        return_softmax_lse: also return the log-sum-exp of each row's scaled scores.

    Returns:
        out (batch_size, seqlen_q, nheads, headdim) in q's dtype; with ``return_softmax_lse`` also
        lse float32 (batch_size, nheads, seqlen_q). A query that sees no key gets zeros and lse = +inf
        (flash-attn's convention).

    Raises:
        TypeError/ValueError naming the argument and value, **before anything is written**: shapes, dtypes
        or devices that do not match q / the cache, ``cache_seqlens`` negative or past the capacity, index
        tensors that are not int32, ``cache_batch_idx`` outside the cache (or repeated with new k/v), a
        block table pointing outside the pool, using a page twice in one sequence, or making two sequences
        write one page, rotary tables too short.

    >>> kc = torch.zeros(2, 8, 1, 4); vc = torch.zeros(2, 8, 1, 4)       # two sequences, capacity 8
    >>> lens = torch.tensor([3, 5], dtype=torch.int32)
    >>> k = torch.randn(2, 1, 1, 4); q = torch.randn(2, 1, 2, 4)
    >>> out = flash_attn_with_kvcache(q, kc, vc, k, k, cache_seqlens=lens, causal=True)
    >>> torch.equal(kc[0, 3], k[0, 0]), torch.equal(kc[1, 5], k[1, 0])   # written at each own length
    (True, True)
    """
    if torch.is_grad_enabled() and any(
        getattr(t, "requires_grad", False)
        for t in (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, alibi_slopes)
    ):  # no backward pass: record no graph (without such an input nothing is recorded anyway, and entering
        # no_grad costs microseconds per decode step)
        with torch.no_grad():
            return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)  # fmt: skip
    a = check_kvcache_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
               cache_leftpad, block_table, causal, window_size, softcap, alibi_slopes, num_splits)  # fmt: skip
    if not isinstance(return_softmax_lse, bool) or not isinstance(rotary_interleaved, bool):
        raise TypeError("return_softmax_lse and rotary_interleaved must be bools")
    dim = q.shape[-1]
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(dim) if dim else 1.0
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, int | float):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    elif not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale!r}")
    else:
        scale = float(softmax_scale)
    dev = q.device
    if rotary_cos is not None:
        base = torch.tensor(a.seqlens, device=dev)[:, None]
        k = apply_rotary(
            k, rotary_cos, rotary_sin, base + torch.arange(a.new, device=dev), rotary_interleaved
        )
        structured = a.right >= 0 or a.left >= 0
        qsteps = torch.arange(a.q_len, device=dev) if structured else torch.zeros(a.q_len, dtype=torch.long)
        q = apply_rotary(q, rotary_cos, rotary_sin, base + qsteps.to(dev), rotary_interleaved)
    if a.new:
        _write(a, k_cache, v_cache, k, v, block_table)

    ends = [n + a.new for n in a.seqlens]
    c1 = max(ends) if ends else 0
    c0 = min(a.leftpad) if a.leftpad else 0
    if a.left >= 0:  # keys before every query's window are never seen
        c0 = max(c0, min(e - a.q_len for e in ends) - a.left)
    c0 = max(0, min(c0, c1))
    b, tq, h = q.shape[0], q.shape[1], q.shape[2]
    dv = v_cache.shape[-1]
    if c1 <= c0 or b == 0 or tq == 0:
        out = q.new_zeros(b, tq, h, dv)
        lse = torch.full((b, h, tq), math.inf, dtype=torch.float32, device=dev)
        return (out, lse) if return_softmax_lse else out
    q4 = q.transpose(1, 2)  # (B, H, Tq, D)
    order_free = alibi_slopes is None and a.left < 0 and (tq == 1 or a.right < 0)
    if a.page and a.batch * tq <= 64 and order_free and _run(a, block_table, 0, max(a.pages)) is None:
        span = _pool_span(a, k_cache, v_cache, block_table, dev)  # scattered pages: read in place, no gather
        if span is not None:
            k4, v4, mask = span
            rows = mask.repeat_interleave(tq, 0)[None, None]  # (1, 1, B·Tq, span)
            qr = q.reshape(1, b * tq, h, q.shape[-1]).transpose(1, 2)  # every query a row: (1, H, B·Tq, D)
            if softcap > 0:
                bias = torch.where(rows, 0.0, -math.inf).to(torch.promote_types(q.dtype, torch.float32))
                out, lse = _softcapped(qr, k4, v4, bias, scale, float(softcap))
            else:
                vis = Visibility(b * tq, k4.shape[2], attn_mask=rows)
                out, lse = engine.attention(qr, k4, v4, _problem(qr, k4, v4, vis, scale, one_call=True))
            out = out.unflatten(2, (b, tq)).permute(2, 0, 1, 3, 4).flatten(1, 2)  # (B, H, Tq, Dv)
            lse = lse.unflatten(2, (b, tq)).permute(2, 0, 1, 3).flatten(1, 2)  # (B, H, Tq)
            return _result(out, lse, q.dtype, return_softmax_lse)
    k4 = _visible(a, k_cache, block_table, c0, c1)
    v4 = _visible(a, v_cache, block_table, c0, c1)
    tk = c1 - c0
    uniform = len(set(ends)) == 1 and all(lp <= c0 for lp in a.leftpad)
    structural = a.right == 0  # causal, or a window that ends at the query
    bias = None
    if alibi_slopes is None and uniform and (structural or (a.left < 0 and a.right < 0)):
        window = a.left + 1 if structural and a.left >= 0 else None
        vis = Visibility(tq, tk, is_causal=structural, window=window, q_offset=ends[0] - tq - c0)
    else:
        row_dependent = tq > 1 and (a.right >= 0 or a.left >= 0)
        mask = _mask(a, c0, c1, row_dependent or alibi_slopes is not None, dev)
        if alibi_slopes is not None:
            work = torch.promote_types(q.dtype, torch.float32)
            ali = _alibi(a, alibi_slopes, c0, c1, work, dev)
            mask = torch.where(mask, ali, torch.full((), -math.inf, dtype=work, device=dev))
        vis = Visibility(tq, tk, attn_mask=mask)
        bias = mask
    if softcap > 0:
        if bias is None:
            bias = vis.to_mask(dev)[None, None]
        if bias.dtype == torch.bool:
            bias = torch.where(bias, 0.0, -math.inf).to(torch.promote_types(q.dtype, torch.float32))
        out, lse = _softcapped(q4, k4, v4, bias, scale, float(softcap))
    else:
        out, lse = engine.attention(q4, k4, v4, _problem(q4, k4, v4, vis, scale))
    return _result(out, lse, q.dtype, return_softmax_lse)


def _problem(q4, k4, v4, vis: Visibility, scale: float, *, one_call: bool = False) -> engine.Problem:
    """The engine's problem; a decode step (every query row sees every key the mask shows: one query with
    causal, or no causal/window) is one kernel call, planned here without the planner's general machinery
    (it costs as much as the kernel at short contexts)."""
    one_call = one_call or (
        (vis.q_len == 1 or not vis.structural) and (vis.attn_mask is None or vis.attn_mask.shape[-2] == 1)
    )
    if not one_call:
        return engine.make_problem(q4, k4, v4, vis, scale, defer_kv=True)
    kernel, reason = engine.choose_kernel(q4, k4, v4, vis, defer_kv=True)
    if kernel != "vendor":
        return engine.make_problem(q4, k4, v4, vis, scale, defer_kv=True)
    call = Call(0, vis.q_len, 0, vis.k_len, tile=vis.attn_mask is not None)
    return engine.Problem(
        vis=vis, scale=scale, plan=Plan([call], "single"), kernel=kernel, reason=reason,
        compute=vendor.compute_dtype(q4.device, q4.dtype), verify=True,
    )  # fmt: skip


def _result(out, lse, dtype, return_softmax_lse: bool):
    out = (out if out.dtype == dtype else out.to(dtype)).transpose(1, 2)  # (B, Tq, H, Dv)
    if not out.is_contiguous():
        out = out.contiguous()
    if not return_softmax_lse:
        return out
    lse = lse.float()
    return out, torch.where(lse == -math.inf, torch.full((), math.inf, device=lse.device), lse)
