"""selfattention: self-attention exactly as the lectures describe it, made into real software.

The spec lives in :mod:`selfattention.functional`; masks in :mod:`selfattention.masks`; modules in
:mod:`selfattention.modules`; traces of the named steps in :mod:`selfattention.trace`.
"""

from . import grade, masks, mods  # grade: callable, selfattention.grade(fn, task=...) (docs/grade.md)
from ._validation import FloatMaskWarning
from .backends import scaled_dot_product_attention
from .flex import BlockMask, and_masks, create_block_mask, create_mask, flex_attention, noop_mask, or_masks
from .functional import (
    AttentionSteps,
    attention_steps,
    attention_weights,
    simple_attention,
    simple_attention_steps,
)
from .kernels.merge import merge_states
from .kv_cache import KVCache
from .mha import MultiHeadAttention
from .modules import SelfAttention, SimpleSelfAttention
from .trace import AttentionTrace, capture
from .visibility import Visibility

__version__ = "0.1.0"

__all__ = [
    "AttentionSteps",
    "BlockMask",
    "AttentionTrace",
    "FloatMaskWarning",
    "KVCache",
    "MultiHeadAttention",
    "SelfAttention",
    "SimpleSelfAttention",
    "Visibility",
    "and_masks",
    "attention_steps",
    "attention_weights",
    "capture",
    "create_block_mask",
    "create_mask",
    "flex_attention",
    "grade",
    "masks",
    "merge_states",
    "mods",
    "noop_mask",
    "or_masks",
    "scaled_dot_product_attention",
    "simple_attention",
    "simple_attention_steps",
]
