"""A LazyMask that a model's own code computes with becomes exactly transformers' dense ``sdpa_mask``.

Doge (transformers 5.x ``modeling_doge.py``, ``prepare_dynamic_mask``) turns the 4-D mask into an additive
one with ``torch.where``, slices it and compares it before its attention call; with a lazy mask that was a
``TypeError``. Every torch function, Tensor method, index and operator now sees the dense mask — checked
here against transformers' own ``sdpa_mask`` of the same recipe (the independent oracle).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import masking_utils as mu  # noqa: E402

from selfattention import hf  # noqa: E402
from selfattention.hf_recipe import LazyMask  # noqa: E402


def _pair(window: int = 3):
    """(our LazyMask, transformers' bool sdpa_mask) for a causal window over 3 rows padded 2, 1, 0."""
    pad = torch.ones(3, 7, dtype=torch.bool)
    pad[0, :2] = False
    pad[1, :1] = False
    fn = mu.sliding_window_causal_mask_function(window)
    lazy = hf.attention_mask(3, 7, 7, mask_function=fn, attention_mask=pad)
    dense = mu.sdpa_mask(3, 7, 7, mask_function=fn, attention_mask=pad, allow_is_causal_skip=False)
    assert isinstance(lazy, LazyMask) and dense.dtype == torch.bool
    return lazy, dense


def test_torch_functions_see_the_dense_mask():
    lazy, dense = _pair()
    low = torch.finfo(torch.float32).min
    assert torch.equal(torch.where(lazy, 0.0, low), torch.where(dense, 0.0, low))
    scores = torch.randn(3, 2, 7, 7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(scores.masked_fill(~lazy, low), scores.masked_fill(~dense, low))
    assert torch.equal(torch.cat([lazy, lazy], dim=1), torch.cat([dense, dense], dim=1))


def test_indexing_operators_and_methods_see_the_dense_mask():
    lazy, dense = _pair()
    assert torch.equal(lazy[:, :, :, :5], dense[:, :, :, :5])
    assert torch.equal(lazy != 0, dense != 0) and torch.equal(lazy == 1, dense == 1)
    assert torch.equal(~lazy, ~dense) and torch.equal(lazy & dense, dense)
    zeros = torch.zeros(3, 1, 7, 7)
    # added to float scores it is eager's additive mask (a bool mask would add 1 and hide nothing)
    additive = torch.zeros(3, 1, 7, 7).masked_fill(~dense, torch.finfo(torch.float32).min)
    assert torch.equal(zeros + lazy, additive) and torch.equal(lazy * 2.0, dense * 2.0)
    assert torch.equal(lazy.float(), dense.float()) and torch.equal(lazy.to(torch.int8), dense.to(torch.int8))
    assert lazy.shape == dense.shape and lazy.dtype == dense.dtype and lazy.dim() == 4


def test_it_stays_lazy_where_nothing_computes_with_it():
    lazy, _ = _pair()
    assert isinstance(copy.deepcopy(lazy), LazyMask) and isinstance(copy.copy(lazy), LazyMask)
    assert hash(lazy) == hash(lazy) and lazy is not None
    with pytest.raises(AttributeError, match="no attribute 'not_a_tensor_method'"):
        lazy.not_a_tensor_method  # noqa: B018


def test_a_dense_mask_made_by_the_model_gives_the_same_attention():
    """What Doge passes after computing with the mask (an additive float (B, H, Tq, Tk) mask) and the lazy
    mask itself give the same attention, and the same as transformers' sdpa with the dense mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    lazy, dense = _pair()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    additive = torch.where(lazy, 0.0, -torch.inf).to(torch.float64).expand(3, 2, 7, 7)
    ours_lazy, _ = hf.attention_forward(module, q, k, v, lazy)
    ours_dense, _ = hf.attention_forward(module, q, k, v, additive)
    theirs, _ = sdpa_attention_forward(module, q, k, v, dense)
    assert (ours_lazy - theirs).abs().max() <= 1e-12
    assert (ours_dense - theirs).abs().max() <= 1e-12
