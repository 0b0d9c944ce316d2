"""The programmable part of the one predicate: flex_attention's ``mask_mod`` / ``score_mod`` on index tiles.

A :class:`Predicate` rides in a :class:`~selfattention.visibility.Visibility` (its ``mod`` field): a
``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend), optionally with torch's ``BlockMask`` tables
of full / partial / empty blocks, and an additive score bias. :meth:`Visibility.tile
<selfattention.visibility.Visibility.tile>` asks it for the entries of a block; the plan asks it for the
kinds of blocks. Mods are evaluated on broadcast index tensors (:func:`index_tiles`), or element by
element under ``torch.vmap`` when they are not broadcast-friendly (:func:`evaluate_mod`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["SKIP", "FULL", "PARTIAL", "index_tiles", "evaluate_mod", "Predicate"]

SKIP, FULL, PARTIAL = 0, 1, 2
"""Block kinds: no visible key (never computed), every key visible with no bias (no mask work), mixed."""


def index_tiles(
    batch: int, heads: int, i0: int, i1: int, j0: int, j1: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The broadcast index tensors of a tile: b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, R, 1) for rows
    i0 … i1 − 1, kv_idx (1, 1, 1, C) for keys j0 … j1 − 1 (int64)."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(i0, i1, device=device).view(1, 1, -1, 1)
    kv = torch.arange(j0, j1, device=device).view(1, 1, 1, -1)
    return b, h, q, kv


_VMAP_DIMS = ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None))


def evaluate_mod(
    fn: Callable, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, score=None
) -> torch.Tensor:
    """``fn(b, h, q_idx, kv_idx)`` (a mask_mod) or ``fn(score, b, h, q_idx, kv_idx)`` (a score_mod) on the
    index tensors of :func:`index_tiles`: 4-D, broadcastable to (B, H, R, C).

    A mod written with element-wise tensor ops runs once on the broadcast tensors; one that is not
    broadcast-friendly (Python control flow on a value, ``.item()``, a result of the wrong shape) is run
    element by element under ``torch.vmap``, as torch's own ``create_mask`` does."""
    shape = (b.shape[0], h.shape[1], q.shape[2], kv.shape[3])
    args = (b, h, q, kv) if score is None else (score, b, h, q, kv)
    try:
        out = fn(*args)
        if isinstance(out, torch.Tensor) and out.dim() <= 4:
            if torch.broadcast_shapes(out.shape, shape) == shape:
                return out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))
    except Exception:  # not broadcast-friendly: element by element below (a real error re-raises there)
        pass
    f = fn
    prefix = () if score is None else (0,)
    for dims in _VMAP_DIMS:
        f = torch.vmap(f, in_dims=prefix + dims)
    flat = (b.flatten(), h.flatten(), q.flatten(), kv.flatten())
    if score is None:
        return f(*flat)
    return f(score.expand(shape), *flat)


@dataclass(frozen=True, eq=False)
class Predicate:
    """A programmable part of a :class:`Visibility`: flex_attention's ``mask_mod`` and an additive score
    bias, on absolute indices (b over the flattened batch, h over the query heads, q_idx the query row,
    kv_idx the key).

    Args:
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` (True = attend), or None.
        batch, heads: B and H of the index tensors handed to the mods.
        block_kinds: int8 (b, h, n_q_blocks, n_kv_blocks) of :data:`SKIP` / :data:`FULL` / :data:`PARTIAL`
            (torch's ``BlockMask`` tables; b ∈ {1, B}, h ∈ {1, H}): an entry is visible iff its block is
            FULL, or PARTIAL and ``mask_mod`` says so (the meaning of a ``BlockMask`` in torch's kernels).
        block_size: (rows, keys) of those blocks.
        score_bias: ``(b, h, q_idx, kv_idx) -> float`` added to the scaled scores, or None.
        device: where the index tensors live when the blocks are classified (the mods' tensors' device).
    """

    mask_mod: Callable | None = None
    batch: int = 1
    heads: int = 1
    block_kinds: torch.Tensor | None = field(default=None, repr=False)
    block_size: tuple[int, int] = (128, 128)
    score_bias: Callable | None = None
    device: torch.device | str | None = None

    def _indices(self, i0: int, i1: int, j0: int, j1: int, device):
        return index_tiles(self.batch, self.heads, i0, i1, j0, j1, device)

    def shown(self, i0: int, i1: int, j0: int, j1: int, device) -> torch.Tensor | None:
        """Bool (b, h, R, C) broadcastable to (B, H, R, C): True where the tile's entries are visible;
        None when nothing is hidden by this predicate."""
        out = None
        if self.mask_mod is not None:
            out = evaluate_mod(self.mask_mod, *self._indices(i0, i1, j0, j1, device))
            if out.dtype != torch.bool:
                raise TypeError(f"mask_mod must return a bool tensor, got dtype {out.dtype}")
        if self.block_kinds is not None:
            bq, bk = self.block_size
            kinds = self.block_kinds.to(device)
            rows = torch.arange(i0, i1, device=device) // bq
            cols = torch.arange(j0, j1, device=device) // bk
            kinds = kinds[:, :, rows][..., cols]  # (b, h, R, C)
            full = kinds == FULL
            part = kinds == PARTIAL
            out = full | part if out is None else full | (part & out)
        return out

    def bias(self, i0: int, i1: int, j0: int, j1: int, dtype: torch.dtype, device) -> torch.Tensor | None:
        """The additive score bias of the tile, (b, h, R, C) broadcastable to (B, H, R, C), or None."""
        if self.score_bias is None:
            return None
        return evaluate_mod(self.score_bias, *self._indices(i0, i1, j0, j1, device)).to(dtype)

    def kinds(
        self, row_blocks: list[tuple[int, int]], col_blocks: list[tuple[int, int]], device
    ) -> torch.Tensor:
        """Kinds (n_row_blocks, n_col_blocks) int8 over every batch entry and head of the mask part
        (the score bias does not count here)."""
        kinds = torch.full((len(row_blocks), len(col_blocks)), FULL, dtype=torch.int8)
        device = self.device if self.device is not None else device
        if self.mask_mod is None and self.block_kinds is None:
            return kinds
        bq, bk = self.block_size
        tk = col_blocks[-1][1] if col_blocks else 0
        if self.block_kinds is not None and _on_grid(row_blocks, bq) and _on_grid(col_blocks, bk):
            t = self.block_kinds
            skip, full = (t == SKIP).flatten(0, 1).all(0), (t == FULL).flatten(0, 1).all(0)
            ri = [i0 // bq for i0, _ in row_blocks]
            ci = [j0 // bk for j0, _ in col_blocks]
            skip, full = skip[ri][:, ci], full[ri][:, ci]
            kinds = torch.where(full, FULL, torch.where(skip, SKIP, PARTIAL)).to(torch.int8)
            return kinds
        step = max(1, (1 << 22) // max(1, (row_blocks[0][1] - row_blocks[0][0]) * self.batch * self.heads))
        for a, (i0, i1) in enumerate(row_blocks):
            anyc = torch.zeros(tk, dtype=torch.bool)
            allc = torch.zeros(tk, dtype=torch.bool)
            for j0 in range(0, tk, step):
                j1 = min(tk, j0 + step)
                m = self.shown(i0, i1, j0, j1, device)
                m = m.expand(self.batch, self.heads, i1 - i0, j1 - j0)
                anyc[j0:j1] = m.any(dim=(0, 1, 2)).cpu()
                allc[j0:j1] = m.all(dim=(0, 1, 2)).cpu()
            for c, (j0, j1) in enumerate(col_blocks):
                if not bool(anyc[j0:j1].any()):
                    kinds[a, c] = SKIP
                elif not bool(allc[j0:j1].all()):
                    kinds[a, c] = PARTIAL
        return kinds


def _on_grid(blocks: list[tuple[int, int]], size: int) -> bool:
    """Whether the blocks are exactly the grid of ``size`` (the last one may be short)."""
    return all(a == n * size and (b - a == size or n == len(blocks) - 1) for n, (a, b) in enumerate(blocks))
