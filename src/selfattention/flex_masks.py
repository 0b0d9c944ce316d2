"""The block-mask half of :mod:`selfattention.flex`: torch's ``create_mask`` / ``create_block_mask`` (the
mask_mod evaluated per block, full / partial / empty blocks as torch's own :class:`BlockMask`), and the
:class:`~selfattention.visibility.Visibility` the engine plans from a BlockMask (recognised structure, or a
:class:`~selfattention.predicate.Predicate` on the mask's grid)."""

from __future__ import annotations

import inspect
import numbers
import weakref
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from .flex_tables import Snapshot, table_entries
from .mods import noop_mask, visibility_fields
from .mods.recognise import RowRuns, equivalent, reads
from .visibility import FULL, PARTIAL, SKIP, Predicate, Visibility, evaluate_mod, index_tiles

__all__ = ["create_mask", "create_block_mask", "visibility_of", "positional_args", "takes", "LARGE"]

LARGE = 1 << 30  # torch's block size of "no block mask"

# BlockMasks of a recognised mod → (mod, lengths, Visibility fields, (batch, heads) limits of a function that
# reads b / h, or None), written by _remember with LOOKED, the copy of the tables they were read from
STRUCTURE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# ... of a function equal to a ready mod without Visibility fields (prefix-LM) → (mod, lengths, ready mod, limits)
TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# every BlockMask looked at (made here, or torch's on its first call) → a copy of its tables then (flex_tables.Snapshot)
LOOKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
RUNS_MAX_ROWS = 1 << 22  # rows (B·H·Q_LEN) up to which create_block_mask looks for a ready mod's pattern

# ---------------------------------------------------------------------------------------------------------
# Block masks
# ---------------------------------------------------------------------------------------------------------


def default_device(device):
    if device is not None:
        return torch.device(device)
    acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return torch.device(acc) if acc is not None else torch.device("cpu")


def check_mask_mod(mask_mod: Callable) -> None:
    if not callable(mask_mod):
        raise TypeError(
            f"mask_mod must be callable (b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}"
        )


def _count(name: str, n, least: int) -> int:
    """``n`` as an int ≥ ``least``: an int, a numpy integer, or a 0-d integer tensor (torch's
    create_block_mask takes all three, e.g. lengths read from a numpy array); ValueError naming ``name``
    for bools, anything else, or a smaller value."""
    value = None
    if isinstance(n, torch.Tensor) and n.dim() == 0 and not n.is_floating_point() and n.dtype != torch.bool:
        value = int(n)
    elif isinstance(n, numbers.Integral) and not isinstance(n, bool):
        value = int(n)
    if value is None or value < least:
        kind = "a non-negative int" if least == 0 else "a positive int or None"
        raise ValueError(f"{name} must be {kind}, got {n!r}")
    return value


def checked_sizes(B, H, Q_LEN, KV_LEN) -> tuple[int, int, int, int]:
    """(B, H, Q_LEN, KV_LEN) checked and made ints, B / H None read as 1; ValueError naming the argument."""
    b = 1 if B is None else _count("B", B, 1)
    h = 1 if H is None else _count("H", H, 1)
    return b, h, _count("Q_LEN", Q_LEN, 0), _count("KV_LEN", KV_LEN, 0)


def create_mask(
    mod_fn: Callable, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, device=None
) -> torch.Tensor:
    """The dense bool mask (B, H, Q_LEN, KV_LEN) of a mask_mod, or of a score_mod (True where it does not
    give −inf), as torch's ``create_mask``; B/H None = 1."""
    b_, h_, Q_LEN, KV_LEN = checked_sizes(B, H, Q_LEN, KV_LEN)
    idx = index_tiles(b_, h_, 0, Q_LEN, 0, KV_LEN, default_device(device))
    shape = (b_, h_, Q_LEN, KV_LEN)
    if positional_args(mod_fn) == 5:
        zero = torch.zeros(shape, device=idx[0].device)
        return ~torch.isneginf(evaluate_mod(mod_fn, *idx, score=zero)).expand(shape)
    return evaluate_mod(mod_fn, *idx).expand(shape).clone()


def positional_args(fn) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 4
    return sum(
        1
        for p in params
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


def takes(fn, n: int) -> bool:
    """Whether ``fn`` can be called with ``n`` positional arguments (True when its signature is unknown)."""
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_blocks (…, rows), indices (…, rows, cols)) int32 of a 0/1 block table, listed blocks first."""
    dense = dense.to(torch.int32)
    return dense.sum(dim=-1).to(torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(
        torch.int32
    )


def create_block_mask(
    mask_mod: Callable,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device=None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    _compile: bool = False,
    separate_full_blocks: bool = True,
    compute_dq_write_order: bool = False,
    dq_kv_order: bool = True,
) -> BlockMask:
    """torch's ``create_block_mask``: the mask_mod evaluated per block on broadcast index tensors (b (B, 1,
    1, 1), h (1, H, 1, 1), q_idx (1, 1, R, 1), kv_idx (1, 1, 1, C); ``torch.vmap`` when the mod is not
    broadcast-friendly), each block of BLOCK_SIZE queries × keys classified full / partial / empty, as
    **torch's own** :class:`BlockMask` (``to_dense()``, printing and torch's flex_attention work on it).
    B/H None: the mask is the same for every batch entry / head. As in torch, a block cut by the end of the
    sequence is never "full". ``_compile`` is accepted (nothing to compile here); ``compute_dq_write_order``
    (metadata of torch's deterministic FLASH backward) is not supported.

    >>> from selfattention.mods import causal_mask
    >>> bm = create_block_mask(causal_mask, None, None, 256, 256, device="cpu")
    >>> bm.to_dense()[0, 0].tolist(), bm.kv_num_blocks.tolist(), bm.full_kv_num_blocks.tolist()
    ([[1, 0], [1, 1]], [[[1, 1]]], [[[0, 1]]])

    A plain function equal to a ready mod is planned as that mod (:mod:`selfattention.mods.recognise`):
    attention-gym's causal sliding window of 64 is the window of 65 keys

    >>> def sliding_window_causal(b, h, q_idx, kv_idx):
    ...     return (q_idx >= kv_idx) & (q_idx - kv_idx <= 64)
    >>> bm = create_block_mask(sliding_window_causal, None, None, 512, 512, device="cpu")
    >>> vis, _ = visibility_of(bm, 1, 1, 512, 512, torch.device("cpu"))
    >>> vis.is_causal, vis.window, vis.mod is None
    (True, 65, True)
    """
    check_mask_mod(mask_mod)
    n_args = positional_args(mask_mod)
    if n_args != 4:
        what = "a score_mod" if n_args == 5 else f"a function of {n_args} positional arguments"
        raise TypeError(f"create_block_mask requires a mask_mod (b, h, q_idx, kv_idx), got {what}")
    b_, h_, Q_LEN, KV_LEN = checked_sizes(B, H, Q_LEN, KV_LEN)
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    if not isinstance(sizes, tuple | list) or len(sizes) != 2:
        raise ValueError(f"BLOCK_SIZE must be a positive int or a pair of them, got {BLOCK_SIZE!r}")
    bq, bk = sizes
    for n in (bq, bk):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"BLOCK_SIZE must be a positive int or a pair of them, got {BLOCK_SIZE!r}")
    if compute_dq_write_order:
        raise NotImplementedError(
            "create_block_mask: compute_dq_write_order (torch's FLASH backend) is not supported"
        )
    device = default_device(device)
    nq, nk = -(-Q_LEN // bq), -(-KV_LEN // bk)
    counts = torch.zeros((b_, h_, nq, nk), dtype=torch.int64)
    fields = visibility_fields(mask_mod, Q_LEN, KV_LEN)
    # a function: the runs of keys its rows show, to find the ready mod it equals (mods/recognise.py)
    # (only a mod that reads b / h from its batch / head arguments when B / H were given: torch evaluates a
    # mod at the real b and h in partial blocks, and tables made for B = None show batch 0's)
    runs, limits = None, (None, None)  # limits: the batch / head counts a recognised function holds for
    if fields is None and b_ * h_ * Q_LEN <= RUNS_MAX_ROWS:
        reads_b, reads_h = _reads(mask_mod, B is None, H is None, Q_LEN, KV_LEN, device)
        if (B is not None or not reads_b) and (H is not None or not reads_h):
            runs = RowRuns(b_, h_, Q_LEN, KV_LEN)
            limits = (b_ if reads_b else None, h_ if reads_h else None)
    # columns per evaluated tile: ~4 M entries of the mod's own result, which has batch / head dims only
    # where it reads b / h (a first small tile says which): B = 4, H = 16 and a mod of q and kv only gets
    # tiles 64× wider than b_ · h_ would allow, and 64× fewer Python steps
    mb, mh = b_, h_
    if Q_LEN and KV_LEN:
        probe = evaluate_mod(mask_mod, *index_tiles(b_, h_, 0, min(Q_LEN, bq), 0, min(KV_LEN, bk), device))
        if isinstance(probe, torch.Tensor) and probe.dim() == 4:
            mb, mh = probe.shape[0], probe.shape[1]
    step = max(bk, ((1 << 22) // max(1, bq * mb * mh)) // bk * bk)
    for a in range(nq):
        i0, i1 = a * bq, min(Q_LEN, (a + 1) * bq)
        for j0 in range(0, KV_LEN, step):
            j1 = min(KV_LEN, j0 + step)
            m = evaluate_mod(mask_mod, *index_tiles(b_, h_, i0, i1, j0, j1, device))
            if m.dtype != torch.bool:
                raise TypeError(f"mask_mod must return a bool tensor, got dtype {m.dtype}")
            m = m.expand(*m.shape[:2], i1 - i0, j1 - j0)  # (1 or B, 1 or H, R, C)
            m = _whole_blocks(m, bk)
            if runs is not None:  # (its per-row counts per block, summed over the rows: the blocks' counts)
                m = runs.add(m, i0, j0, bk).sum(dim=2)
            else:
                m = m.unflatten(-1, (-1, bk)).sum(dim=(2, 4), dtype=torch.int32)  # visible entries per block
            counts[:, :, a, j0 // bk : j0 // bk + m.shape[-1]] = m.cpu()
    full = counts == bq * bk
    partial = (counts > 0) & ~full if separate_full_blocks else counts > 0
    kv_num, kv_idx = ordered(partial)
    f_num, f_idx = ordered(full) if separate_full_blocks else (None, None)
    bm = BlockMask.from_kv_blocks(
        kv_num.to(device), kv_idx.to(device), None if f_num is None else f_num.to(device),
        None if f_idx is None else f_idx.to(device), BLOCK_SIZE=(bq, bk), mask_mod=mask_mod,
        seq_lengths=(Q_LEN, KV_LEN),
    )  # fmt: skip
    twin = None if runs is None or Q_LEN == 0 or KV_LEN == 0 else equivalent(runs, Q_LEN, KV_LEN)
    _remember(
        bm, fields, twin, limits, b_
    )  # (decided here: visibility_of looks only at masks made elsewhere)
    return bm


def _whole_blocks(m: torch.Tensor, bk: int) -> torch.Tensor:
    """A bool tile (…, C) padded with hidden keys to a multiple of ``bk`` columns."""
    pad = -m.shape[-1] % bk
    return torch.cat([m, m.new_zeros((*m.shape[:-1], pad))], dim=-1) if pad else m


def _varies(mask_mod: Callable, axis: int, q_len: int, k_len: int, device) -> bool:
    """Whether the mod, on a sample of up to 64 rows × 4096 keys, differs between b = 0 and b = 1 … 7
    (``axis`` 0) or h = 0 and h = 1 … 7 (``axis`` 1), or cannot be evaluated there — a second look besides
    the traced code (:func:`selfattention.mods.recognise.reads`), which a branch on ``isinstance(h,
    torch.Tensor)`` fools. (A mod that hides a difference from both, e.g. behind that branch and only for
    h ≥ 8, is taken for one that ignores h: with H = None torch's tables assume that too.)"""
    rows = torch.linspace(0, q_len - 1, min(q_len, 64), device=device).round().long().unique()
    keys = torch.linspace(0, k_len - 1, min(k_len, 4096), device=device).round().long().unique()
    several = torch.arange(8, device=device)  # b or h = 0 … 7, each against 0
    zero = torch.zeros(1, dtype=torch.long, device=device)
    b, h = (several, zero) if axis == 0 else (zero, several)
    try:
        m = evaluate_mod(
            mask_mod, b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), rows.view(1, 1, -1, 1), keys.view(1, 1, 1, -1)
        )
    except Exception:
        return True
    if not isinstance(m, torch.Tensor) or m.dim() != 4:
        return True
    m = m.expand(8 if axis == 0 else m.shape[0], 8 if axis == 1 else m.shape[1], *m.shape[2:])
    return not bool((m == m.narrow(axis, 0, 1)).all())


def _batch_rows(value: torch.Tensor, b: int, device_type: str) -> torch.Tensor:
    """A recognised mod's per-batch field (ids (B', T)) for a query batch of ``b``: the rows the tables
    of each batch entry come from (:func:`table_entries`; a 1-D field is shared by every batch entry)."""
    if value.dim() < 2 or value.shape[0] in (1, b):
        return value
    return value[table_entries(b, value.shape[0], device_type).to(value.device)]


def _tables_cover(fields: dict, b: int) -> bool:
    """Whether tables made for ``b`` batch entries describe a recognised mod's every batch entry: with
    B = None (b = 1) and document ids that differ per batch entry, the tables are batch 0's and are
    obeyed as torch's kernels obey them (docs/flex.md), so the mod is then not planned from its structure."""
    for value in fields.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] > b:
            if not bool((value == value[:1]).all()):
                return False
    return True


def _look_at(bm: BlockMask) -> None:
    """Recognise a BlockMask made elsewhere (torch's ``create_block_mask``) as a ready mod, as our
    :func:`create_block_mask` does while it builds one: the keys each row sees are what the tables and the
    mod say together (full blocks, and the mod in partial ones), evaluated once over the blocks the tables
    list; a mod that reads b / h holds for calls of at most the tables' batch / heads. Fills STRUCTURE or
    TWINS; nothing where no ready mod matches, the mod cannot be evaluated, or the tables are too large."""
    mod, (tq, tk) = bm.mask_mod, tuple(bm.seq_lengths)
    kinds = block_kinds(bm)
    bb, bh, nq, _ = kinds.shape
    _remember(bm, None, None, (None, None), bb)  # what an earlier look found no longer holds
    if mod is None or tq == 0 or tk == 0 or bb * bh * tq > RUNS_MAX_ROWS:
        return
    bq, bk = bm.BLOCK_SIZE
    device = bm.kv_num_blocks.device
    reads_b, reads_h = _reads(mod, True, True, tq, tk, device)
    limits = (bb if reads_b else None, bh if reads_h else None)
    runs = RowRuns(bb, bh, tq, tk)
    try:
        for a in range(min(nq, -(-tq // bq))):
            i0, i1 = a * bq, min(tq, (a + 1) * bq)
            row = kinds[:, :, a]  # (bb, bh, key blocks)
            listed = (row != SKIP).any(0).any(0).nonzero()
            if listed.numel() == 0:
                continue
            j0, j1 = int(listed[0]) * bk, min(tk, (int(listed[-1]) + 1) * bk)
            cols = row[..., j0 // bk :].repeat_interleave(bk, -1)[..., : j1 - j0][:, :, None, :]
            m = evaluate_mod(mod, *index_tiles(bb, bh, i0, i1, j0, j1, device))
            if m.dtype != torch.bool:
                return
            m = m.cpu().expand(*m.shape[:2], i1 - i0, j1 - j0)  # a mod of kv alone: (…, 1, C)
            m = (cols == FULL) | ((cols == PARTIAL) & m)  # (bb, bh, R, C)
            m = _whole_blocks(m, bk)
            runs.add(m, i0, j0, bk)
    except Exception:  # the mod's own error surfaces where the generic plan evaluates it
        return
    _remember(bm, None, equivalent(runs, tq, tk), limits, bb)


def _remember(bm: BlockMask, fields: dict | None, twin, limits: tuple, b: int) -> None:
    """Record what ``bm`` was found to be — a ready mod's Visibility ``fields`` or a ``twin`` ready mod
    (its fields, or itself when it has none: prefix-LM), for calls within ``limits`` — together with a copy
    of its tables, so that a later change to them is seen; forget what an earlier look recorded."""
    LOOKED[bm] = Snapshot(bm)
    STRUCTURE.pop(bm, None)
    TWINS.pop(bm, None)
    key = (bm.mask_mod, tuple(bm.seq_lengths))
    if twin is not None:
        fields = visibility_fields(twin, *key[1])
        if fields is None:
            TWINS[bm] = (*key, twin, limits)
    if fields is not None and _tables_cover(fields, b):
        STRUCTURE[bm] = (*key, fields, limits)


def _reads(mod: Callable, probe_b: bool, probe_h: bool, q_len: int, k_len: int, device) -> tuple[bool, bool]:
    """Whether ``mod`` reads b / h: its traced code says so (:func:`~selfattention.mods.recognise.reads`),
    or, where ``probe_b`` / ``probe_h``, its values differ between b / h = 0 and 1 … 7 (:func:`_varies`)."""
    reads_b, reads_h = reads(mod)
    reads_b = reads_b or (probe_b and _varies(mod, 0, q_len, k_len, device))
    reads_h = reads_h or (probe_h and _varies(mod, 1, q_len, k_len, device))
    return reads_b, reads_h


def _known(table: weakref.WeakKeyDictionary, bm: BlockMask, b: int, h: int):
    """What ``table`` (STRUCTURE or TWINS) holds for ``bm`` if its mask_mod and lengths are unchanged and a
    function that reads b / h was evaluated for at least this call's batch / heads, else None (a mod that
    reads h, made for H = 2 and called with 4 heads: heads 2, 3 evaluate the mod itself). The tables are
    those of the record: :func:`visibility_of` looks again first where they changed."""
    mod, lens, known, (lim_b, lim_h) = table.get(bm, (None, None, None, (None, None)))
    if known is None or bm.mask_mod is not mod or tuple(bm.seq_lengths) != lens:
        return None
    if (lim_b is not None and b > lim_b) or (lim_h is not None and h > lim_h):
        return None
    return known


def block_kinds(bm: BlockMask) -> torch.Tensor:
    """int8 (b, h, n_q_blocks, n_kv_blocks) SKIP / FULL / PARTIAL from a BlockMask's tables."""
    idx, num = bm.kv_indices.cpu().long(), bm.kv_num_blocks.cpu()
    n = idx.shape[-1]
    kinds = torch.full((*idx.shape[:-1], n + 1), SKIP, dtype=torch.int8)  # one spare column for the unlisted

    def mark(num, idx, kind):
        listed = torch.arange(idx.shape[-1]) < num[..., None]
        kinds.scatter_(-1, torch.where(listed, idx, n), kind)
        kinds[..., n] = SKIP

    mark(num, idx, PARTIAL)
    if bm.full_kv_num_blocks is not None:
        mark(bm.full_kv_num_blocks.cpu(), bm.full_kv_indices.cpu().long(), FULL)
    return kinds[..., :n].contiguous()


def visibility_of(bm: BlockMask | None, b: int, h: int, tq: int, tk: int, device) -> tuple[Visibility, tuple]:
    """The Visibility of a block mask for canonical (B, H, Tq, Tk), and the plan's block sizes."""
    if bm is not None and not isinstance(bm, BlockMask):
        hint = (
            " (a dense mask goes to scaled_dot_product_attention's attn_mask, or make a BlockMask with "
            "create_block_mask)"
            if isinstance(bm, torch.Tensor)
            else ""
        )
        raise TypeError(
            f"block_mask must be a BlockMask (create_block_mask) or None, got {type(bm).__name__}{hint}"
        )
    if bm is None or tuple(bm.BLOCK_SIZE) == (LARGE, LARGE):
        return Visibility(tq, tk), (128, 128)
    if getattr(bm.mask_mod, "__name__", "") == "_sliced_mask_mod_error":
        raise RuntimeError("Cannot use mask_mod from a sliced BlockMask")
    if tuple(bm.seq_lengths) != (tq, tk):
        raise ValueError(
            f"block_mask was created for (Q_LEN, KV_LEN) = {tuple(bm.seq_lengths)} but query/key have "
            f"q_len={tq}, kv_len={tk}: create a new block mask for these lengths"
        )
    if bm.kv_indices.dim() != 4:
        raise ValueError(
            f"block_mask must have 4-D tables (B, H, rows, cols), got {tuple(bm.kv_indices.shape)}"
        )
    if bm.kv_num_blocks.device != device:
        raise RuntimeError(f"q/k/v are on {device} but the block_mask is on {bm.kv_num_blocks.device}")
    seen = LOOKED.get(bm)
    if seen is None or not seen.match(bm):  # torch's own BlockMask, or tables changed since the last look
        _look_at(bm)
    fields = _known(STRUCTURE, bm, b, h)
    if fields is not None:
        fields = {
            k: (_batch_rows(v, b, device.type).to(device) if isinstance(v, torch.Tensor) else v)
            for k, v in fields.items()
        }
        return Visibility(tq, tk, **fields), (128, 128)
    mod = None if bm.mask_mod is noop_mask else bm.mask_mod
    twin = _known(TWINS, bm, b, h)
    if twin is not None:
        mod = twin  # shows exactly what the function shows: planned as the ready mod (prefix-LM)
    kinds = block_kinds(bm)
    bb, bh = kinds.shape[:2]
    if bb not in (1, b) or bh not in (1, h):
        # as torch's kernel on this device reads the tables (table_entries): a mask made for the key/value
        # heads of a GQA call, or for another batch size, works there and here, with the same result
        kinds = kinds[table_entries(b, bb, device.type)][:, table_entries(h, bh, device.type)]
    pred = Predicate(mod, b, h, kinds, tuple(bm.BLOCK_SIZE), device=device)
    return Visibility(tq, tk, mod=pred), tuple(bm.BLOCK_SIZE)
