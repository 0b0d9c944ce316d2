"""How a sequence is split across ranks: contiguous or zig-zag slices, positions, shard/unshard/gather."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .._validation import check_positive_int

LAYOUTS = ("contiguous", "zigzag")


# ----------------------------------------------------------------------------------------------------
# Layouts: which global positions a rank holds
# ----------------------------------------------------------------------------------------------------


def _split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of :func:`torch.tensor_split` into ``parts``: the first ``total % parts`` are one longer."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def segments(lengths: Sequence[int], rank: int, layout: str) -> list[tuple[int, int, int]]:
    """The runs of consecutive global positions a rank holds: [(local_start, global_start, length)]."""
    n = len(lengths)
    if layout == "contiguous":
        length = lengths[rank]
        return [(0, sum(lengths[:rank]), length)] if length else []
    sizes = _split_sizes(sum(lengths), 2 * n)
    starts = [sum(sizes[:i]) for i in range(2 * n)]
    for r in range(n):
        if lengths[r] != sizes[r] + sizes[2 * n - 1 - r]:
            raise ValueError(
                f"zigzag layout: rank {r} holds {lengths[r]} positions, but a sequence of {sum(lengths)} "
                f"split into {2 * n} chunks gives it {sizes[r]} + {sizes[2 * n - 1 - r]}; shard with "
                "selfattention.distributed.shard_sequence(..., layout='zigzag')"
            )
    a, b = rank, 2 * n - 1 - rank
    segs = [(0, starts[a], sizes[a]), (sizes[a], starts[b], sizes[b])]
    return [s for s in segs if s[2] > 0]


def sequence_positions(total: int, world_size: int, rank: int, layout: str = "contiguous") -> torch.Tensor:
    """Global positions (int64, shape (T_local,)) of the rows that ``rank`` holds under ``layout``.

    >>> sequence_positions(10, 2, 0, "zigzag")
    tensor([0, 1, 2, 8, 9])
    >>> sequence_positions(10, 4, 3)
    tensor([8, 9])
    """
    check_layout(layout)
    lengths = _local_lengths(total, world_size, layout)
    segs = segments(lengths, rank, layout)
    if not segs:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(g, g + n) for _, g, n in segs])


def _local_lengths(total: int, world_size: int, layout: str) -> list[int]:
    if layout == "contiguous":
        return _split_sizes(total, world_size)
    sizes = _split_sizes(total, 2 * world_size)
    return [sizes[r] + sizes[2 * world_size - 1 - r] for r in range(world_size)]


def _check_world(world_size: int, rank: int | None = None) -> None:
    check_positive_int("world_size", world_size)
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


def shard_sequence(
    x: torch.Tensor, world_size: int, rank: int, layout: str = "contiguous", dim: int = -2
) -> torch.Tensor:
    """The part of the full sequence ``x`` that ``rank`` holds (a new tensor; ``x`` is not changed).

    Args:
        x: any tensor; ``dim`` is the sequence dim (``-2`` for the (B, H, T, D) layout).
        world_size, rank: the number of ranks and which one.
        layout: ``"contiguous"`` (rank r: the r-th of N slices) or ``"zigzag"`` (chunks r and 2N-1-r of
            2N); slices as :func:`torch.tensor_split`, so T need not be a multiple of N.

    >>> x = torch.arange(10).reshape(10, 1)
    >>> shard_sequence(x, 2, 0, "zigzag").flatten()
    tensor([0, 1, 2, 8, 9])
    >>> [shard_sequence(x, 4, r).flatten().tolist() for r in range(4)]
    [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_world(world_size, rank)
    check_layout(layout)
    if layout == "contiguous":
        return torch.tensor_split(x, world_size, dim=dim)[rank].clone()
    chunks = torch.tensor_split(x, 2 * world_size, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def unshard_sequence(
    parts: Sequence[torch.Tensor], layout: str = "contiguous", dim: int = -2
) -> torch.Tensor:
    """Reassemble the full sequence from every rank's part, given in rank order (inverse of
    :func:`shard_sequence`).

    >>> x = torch.arange(7).reshape(7, 1)
    >>> parts = [shard_sequence(x, 3, r, "zigzag") for r in range(3)]
    >>> torch.equal(unshard_sequence(parts, "zigzag"), x)
    True
    """
    check_layout(layout)
    if not isinstance(parts, Sequence) or not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        raise TypeError("parts must be a non-empty sequence of tensors, one per rank in rank order")
    if layout == "contiguous":
        return torch.cat(list(parts), dim=dim)
    n = len(parts)
    lengths = [p.shape[dim] for p in parts]
    sizes = _split_sizes(sum(lengths), 2 * n)
    segments(lengths, 0, "zigzag")  # validates the lengths
    chunks: list[torch.Tensor] = [parts[0]] * (2 * n)
    for r, p in enumerate(parts):
        chunks[r], chunks[2 * n - 1 - r] = torch.split(p, [sizes[r], sizes[2 * n - 1 - r]], dim=dim)
    return torch.cat(chunks, dim=dim)


def gather_sequence(
    local: torch.Tensor, group: dist.ProcessGroup | None = None, layout: str = "contiguous", dim: int = -2
) -> torch.Tensor:
    """Collective: every rank gets the full sequence from the local parts (lengths may differ by rank).

    Every other dim must agree across ranks. Costs a full copy of the sequence on every rank: meant for
    checking and for small outputs, not for the long sequences ring attention exists for.
    """
    check_layout(layout)
    world = dist.get_world_size(group)
    d = dim % local.dim()
    length = torch.tensor([local.shape[d]], dtype=torch.long, device=local.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(x.item()) for x in lengths]
    pad_shape = list(local.shape)
    pad_shape[d] = max(sizes) - local.shape[d]
    padded = torch.cat([local, local.new_zeros(pad_shape)], dim=d).contiguous()
    bufs = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(bufs, padded, group=group)
    parts = [b.narrow(d, 0, n) for b, n in zip(bufs, sizes, strict=True)]
    return unshard_sequence(parts, layout, dim=d)
