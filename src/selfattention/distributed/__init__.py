"""Sequence-parallel (ring) attention on ``torch.distributed``: a sequence too long for one process.

Each of N processes (ranks) holds a slice of the sequence's queries, keys and values. The key/value
blocks travel around a ring — rank r sends to r+1 and receives from r-1 — and after N-1 hops every rank
has seen every block. Each block is computed by the same block engine as the tiled path
(:mod:`selfattention.kernels`: torch's fused kernel, which returns the log-sum-exp; the exact kernel for
inputs holding NaN/inf) and each rank merges the partial results with the engine's log-sum-exp rule
(:func:`selfattention.kernels.merge.merge_into`)::

    ℓ = log(exp ℓ₁ + exp ℓ₂)          O = exp(ℓ₁ - ℓ) O₁ + exp(ℓ₂ - ℓ) O₂

so the result equals single-process attention (lecture 003: softmax(QKᵀ/√dₖ)·V) up to float rounding.
The backward runs the ring again (FlashAttention-2's Algorithm 2 per block): dQ stays home and
accumulates; each block's dK, dV accumulate as they travel and arrive back at their owner after N hops.
The communication of the next block overlaps with the computation of the current one (``isend``/
``irecv`` through :func:`torch.distributed.batch_isend_irecv`).

Sources: Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"; Dao 2023, "FlashAttention-2" (Algorithms 1 and 2); Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax"; the zig-zag layout as used by Brandon et al. 2023 ("Striped
Attention") and the open ring-flash-attention implementations (facts only).

Layouts (the sequence dim, ``dim=-2``, of length T split across N ranks)::

    contiguous (default; what torchrun users expect): rank r holds the r-th slice
        T = 10, N = 4 →  rank 0: 0 1 2 | rank 1: 3 4 5 | rank 2: 6 7 | rank 3: 8 9
    zigzag (balances causal work): 2N chunks, rank r holds chunks r and 2N-1-r
        T = 10, N = 2 →  chunks 0 1 2 | 3 4 5 | 6 7 | 8 9 ;  rank 0: 0 1 2 8 9 | rank 1: 3 4 5 6 7

Slices follow :func:`torch.tensor_split` (the first ``T mod parts`` slices are one longer), so T need
not be divisible by N. With the contiguous layout any split works (ranks exchange their lengths); a rank
may even hold nothing. Causal attention is bottom-right aligned over the *global* positions, as in
:func:`selfattention.scaled_dot_product_attention`; blocks that are entirely in the future are skipped.

Running: ``torchrun --nproc-per-node N examples/ring_attention.py`` (gloo on CPU, NCCL when the tensors
are on a GPU — the backend follows the process group; this module has no transport of its own).
"""

from __future__ import annotations

import torch.distributed as dist

from .layout import LAYOUTS, gather_sequence, sequence_positions, shard_sequence, unshard_sequence
from .process import DistributedInitError, init_distributed
from .ring import RingStats, ring_attention

__all__ = [
    "LAYOUTS",
    "DistributedInitError",
    "RingStats",
    "init_distributed",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
    "gather_sequence",
    "sequence_positions",
    "dist",
]
