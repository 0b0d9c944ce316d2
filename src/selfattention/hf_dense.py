"""The materialising route of :mod:`selfattention.hf` (the weights path, recordings, other backends): Gemma 2's soft-capped scores, T5's bias and gpt-oss' sinks written into one dense float
mask (a sink as one more key with a zero value). The fast route needs none of this (see
:func:`selfattention.hf_masks.engine_attention`)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .functional import AttentionSteps

__all__ = ["softcapped_scores", "additive_mask", "with_sink", "honest_steps", "model_scale", "selected_keys"]


def softcapped_scores(
    query: torch.Tensor, key: torch.Tensor, scaling: float | None, softcap: float
) -> torch.Tensor:
    """softcap · tanh(Q Kᵀ · scale / softcap), (B, H, Tq, Tk), float32 at least; GQA key heads repeated."""
    acc = torch.promote_types(query.dtype, torch.float32)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else float(scaling)
    if key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(
            query.shape[-3] // key.shape[-3], dim=-3
        )  # (B, Hkv, Tk, D) -> (B, H, Tk, D)
    scores = query.to(acc) @ key.to(acc).transpose(-2, -1) * scale
    return torch.tanh(scores / softcap) * softcap


def additive_mask(
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    causal: bool,
    q_len: int,
    k_len: int,
    device: torch.device,
) -> torch.Tensor:
    """One float mask: ``bias`` (or 0) where ``mask`` lets a query attend, -inf where it hides the key.
    ``causal`` (Tq == Tk here) is written into it too, so the mask alone says everything."""
    if bias is None:
        dtype = mask.dtype if mask is not None and mask.is_floating_point() else torch.float32
        bias = torch.zeros((), dtype=dtype, device=device)
    if mask is not None and mask.dtype == torch.bool:
        out = torch.where(mask, bias, torch.full((), -math.inf, dtype=bias.dtype, device=device))
    elif mask is not None:
        out = bias + mask
    else:
        out = bias
    if causal:
        tri = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()
        out = torch.where(tri, out, torch.full((), -math.inf, dtype=out.dtype, device=device))
    return out if out.dim() >= 2 else out.expand(q_len, k_len)


def with_sink(
    mask: torch.Tensor,
    sink: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_len: int,
    k_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sink is one more key that every query sees, with score ``sink`` and a zero value: append a zero
    key/value and a mask column holding the sink logits."""
    lead = torch.broadcast_shapes(mask.shape[:-2], sink.shape[:-2])
    dtype = torch.promote_types(mask.dtype, sink.dtype)
    body = mask.to(dtype).expand(*lead, q_len, k_len)
    column = sink.to(dtype).expand(*lead, q_len, 1)
    zeros_k = key.new_zeros((*key.shape[:-2], 1, key.shape[-1]))
    zeros_v = value.new_zeros((*value.shape[:-2], 1, value.shape[-1]))
    return (
        torch.cat([body, column], dim=-1),  # (..., Tq, Tk + 1)
        torch.cat([key, zeros_k], dim=-2),  # (B, Hkv, Tk + 1, D)
        torch.cat([value, zeros_v], dim=-2),
    )


def honest_steps(
    steps: AttentionSteps, softcap: float | None, scaling: float | None, has_sink: bool, k_len: int
) -> AttentionSteps:
    """The steps as a trace should show them: the sink column dropped (its weight is what the row lacks
    from 1), and with softcap the capped scores as ``scaled_scores`` and the model's scale."""
    if softcap is not None:
        capped = steps.masked_scores  # bias (capped scores) plus the mask, before -inf
        steps = replace(
            steps,
            scaled_scores=torch.tanh(steps.scores * model_scale(scaling, steps) / softcap) * softcap,
            masked_scores=capped,
            scale=model_scale(scaling, steps),
        )
    if has_sink:
        cut = {
            name: getattr(steps, name)[..., :k_len]
            for name in ("scores", "scaled_scores", "masked_scores", "visible", "weights")
        }
        steps = replace(steps, key=steps.key[..., :k_len, :], value=steps.value[..., :k_len, :], **cut)
    return steps


def model_scale(scaling: float | None, steps: AttentionSteps) -> float:
    return 1.0 / math.sqrt(steps.query.shape[-1]) if scaling is None else float(scaling)


def _integers(t: object, dims: int) -> bool:
    """Whether ``t`` is an integer (not bool) tensor of ``dims`` dimensions."""
    return (
        isinstance(t, torch.Tensor)
        and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)
        and t.dim() == dims
    )


def _described(t: object) -> object:
    return (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t


def selected_keys(
    indices: torch.Tensor, batch: int, q_len: int, k_len: int, device: torch.device
) -> torch.Tensor:
    """Bool (1 or B, 1, Tq, Tk), True at the keys ``indices`` (1 or B, Tq, K) names for each query
    (DeepSeek sparse attention's top-k); every index must lie in [0, Tk)."""
    if not _integers(indices, 3) or indices.shape[0] not in (1, batch) or indices.shape[1] != q_len:
        raise ValueError(
            f"indices must be an integer tensor of shape (B, Tq, K) = ({batch}, {q_len}, K), got "
            f"{_described(indices)}"
        )
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= k_len):
        raise ValueError(
            f"indices must lie in [0, {k_len}) (the keys), got {int(indices.min())} … {int(indices.max())}"
        )
    keep = torch.zeros(indices.shape[0], q_len, k_len, dtype=torch.bool, device=device)
    return keep.scatter_(-1, indices.to(device=device, dtype=torch.long), True).unsqueeze(1)


def index_block_size(module: torch.nn.Module) -> int:
    """Keys per block of a block-sparse indexer's selection: the calling layer's ``indexer.block_size``, else
    its config's ``index_block_size`` (transformers' MiniMax M3)."""
    size = getattr(getattr(module, "indexer", None), "block_size", None)
    if size is None:
        size = getattr(getattr(module, "config", None), "index_block_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(
            f"block_indices need the key block size: {type(module).__name__} has no indexer.block_size or "
            f"config.index_block_size (a positive int), got {size!r}"
        )
    return size


def selected_blocks(
    block_indices: torch.Tensor,
    block_size: int,
    heads: int,
    batch: int,
    q_len: int,
    k_len: int,
    device: torch.device,
) -> torch.Tensor:
    """Bool (1 or B, H, Tq, Tk), True at the keys of the key blocks ``block_indices`` (1 or B, H_idx, Tq, K)
    names for each query: block n is keys n·size … (n + 1)·size − 1 (the last one cut at Tk), −1 names no
    block, and index head i serves query heads i·H/H_idx … (i + 1)·H/H_idx − 1 (MiniMax M3's sparse
    attention, ``MiniMaxM3VLIndexer.build_block_mask``). Block size 2, Tk = 5, one query, blocks [2, 0]::

        1 1 0 0 1
    """
    n_blocks = -(-k_len // block_size)
    sel = block_indices
    if (
        not _integers(sel, 4)
        or sel.shape[0] not in (1, batch)
        or sel.shape[1] == 0
        or heads % sel.shape[1] != 0
        or sel.shape[2] != q_len
    ):
        raise ValueError(
            f"block_indices must be an integer tensor of shape (B, H_idx, Tq, K) = ({batch}, H_idx, {q_len}, "
            f"K) with H_idx dividing the {heads} query heads, got {_described(sel)}"
        )
    if sel.numel() and (int(sel.min()) < -1 or int(sel.max()) >= n_blocks):
        raise ValueError(
            f"block_indices must lie in [-1, {n_blocks}) (key blocks of {block_size}; -1 = none), got "
            f"{int(sel.min())} … {int(sel.max())}"
        )
    sel = sel.to(device=device, dtype=torch.long)
    blocks = torch.zeros((*sel.shape[:3], n_blocks + 1), dtype=torch.bool, device=device)
    blocks.scatter_(-1, sel.masked_fill(sel < 0, n_blocks), True)  # −1 lands in a column dropped below
    keep = blocks[..., :n_blocks].repeat_interleave(block_size, dim=-1)[..., :k_len]
    return keep.repeat_interleave(heads // sel.shape[1], dim=1)
