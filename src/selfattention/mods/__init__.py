"""Ready mask mods and score mods for :func:`selfattention.flex_attention` (torch's flex_attention vocabulary).

A **mask mod** is ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = attend); a **score mod** is
``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to the scaled score before masking. Indices are
the query row and the key column (flex's convention: ``causal_mask`` is top-left, query i sees keys 0 … i
whatever Tk is). Every mod here is a small dataclass: callable exactly like a plain function (on scalars
under ``torch.vmap``, or on broadcast index tensors), and carrying its structure, so that the block engine
recognises causal-at-an-offset, sliding windows and documents (also inside :func:`and_masks`) and keeps
its fast plans (one causal call, stacked window bands, one call per document) instead of evaluating the
predicate block by block. Anything else — prefix-LM, dilated windows, 2-D neighbourhoods, your own
functions — is classified per block (skip / full / partial) and evaluated only on partial blocks.

Tq = Tk = 4 (rows: queries, columns: keys)::

    causal_mask        causal_at(1)       sliding_window(1)   prefix_lm(2)     document_mask([0,0,1,1])
    1 0 0 0            1 1 0 0            1 0 0 0             1 1 0 0          1 1 0 0
    1 1 0 0            1 1 1 0            1 1 0 0             1 1 0 0          1 1 0 0
    1 1 1 0            1 1 1 1            0 1 1 0             1 1 1 0          0 0 1 1
    1 1 1 1            1 1 1 1            0 0 1 1             1 1 1 1          0 0 1 1

Attention sinks (gpt-oss; Xiao et al. 2023) are not a score mod: see :func:`attention_sink`.
"""

from __future__ import annotations

from .masks import (
    And,
    MaskMod,
    Or,
    and_masks,
    causal_at,
    causal_mask,
    dilated_sliding_window,
    document_mask,
    natten,
    noop_mask,
    or_masks,
    packed_sequences,
    prefix_lm,
    sink_tokens,
    sliding_window,
    visibility_fields,
)
from .scores import (
    ScoreMod,
    alibi,
    alibi_slopes,
    attention_sink,
    relative_position_bias,
    softcap,
    t5_bucket,
)

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
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "softcap",
    "relative_position_bias",
    "t5_bucket",
    "attention_sink",
]
