"""``indices``: DeepSeek sparse attention's selected keys (transformers 5.x DeepSeek V3.2, GLM-MoE-DSA,
Mistral Large 4, …: ``modeling_deepseek_v32.py`` passes the indexer's top-k as ``indices=`` to every
attention function but eager/sdpa, which AND them into the mask themselves). Before: a ``TypeError``
naming the argument. The oracle is torch's own SDPA with the mask built here by a loop."""

from __future__ import annotations

import math
import types

import pytest
import torch

pytest.importorskip("transformers")

from transformers import masking_utils as mu  # noqa: E402

from selfattention import hf  # noqa: E402


def _module():
    m = types.SimpleNamespace(is_causal=True, training=False, num_key_value_groups=2)
    m.config = types.SimpleNamespace(_attn_implementation="selfattention")
    return m


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 4, 9, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    idx = torch.stack([torch.randperm(9, generator=g)[:4] for _ in range(3 * 9)]).view(3, 9, 4).int()
    pad = torch.ones(3, 9, dtype=torch.bool)
    pad[0, :2] = False
    return q, k, v, idx, pad


def _oracle(q, k, v, idx, pad):
    keep = torch.zeros(3, 1, 9, 9, dtype=torch.bool)
    for b in range(3):
        for i in range(9):
            for j in idx[b, i].tolist():
                keep[b, 0, i, j] = j <= i and bool(pad[b, j])
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    # rows with no key: 0 (ours' convention); (context, rows with a key (B, Tq), keep (B, 1, Tq, Tk))
    return out.nan_to_num(0.0).transpose(1, 2), keep.any(-1)[:, 0], keep


@pytest.mark.parametrize("form", ["lazy", "bool", "float"])
def test_indices_and_the_mask_together(form):
    q, k, v, idx, pad = _case()
    mask = hf.attention_mask(3, 9, 9, mask_function=mu.causal_mask_function, attention_mask=pad)
    if form != "lazy":
        mask = mask.to_dense()
        if form == "float":
            mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf)
    ours, _ = hf.attention_forward(_module(), q, k, v, mask, indices=idx)
    theirs, rows, keep = _oracle(q, k, v, idx, pad)
    assert (ours - theirs)[rows].abs().max() <= 1e-12
    plain, _ = hf.attention_forward(_module(), q, k, v, mask)
    assert (plain - theirs)[rows].abs().max() > 1e-2  # the selection matters
    weighted, w = hf.attention_forward(_module(), q, k, v, mask, indices=idx, output_attentions=True)
    assert (weighted - ours).abs().max() <= 1e-12
    assert (w[~keep.expand_as(w)] == 0).all() and (w[keep.expand_as(w)] > 0).all()


def test_indices_get_gradients_through_the_kept_keys():
    q, k, v, idx, pad = _case(1)
    mask = hf.attention_mask(3, 9, 9, mask_function=mu.causal_mask_function, attention_mask=pad)
    q.requires_grad_(True)
    ours, _ = hf.attention_forward(_module(), q, k, v, mask, indices=idx)
    theirs, rows, _ = _oracle(q, k, v, idx, pad)
    (g_ours,) = torch.autograd.grad((ours[rows]).sum(), q)
    (g_theirs,) = torch.autograd.grad((theirs[rows]).sum(), q)
    assert (g_ours - g_theirs).abs().max() <= 1e-12 and g_theirs.abs().max() > 1e-3


@pytest.mark.parametrize(
    ("indices", "message"),
    [
        (torch.zeros(3, 9, 4), "integer tensor of shape"),
        (torch.zeros(3, 8, 4, dtype=torch.int32), r"\(3, 9, K\)"),
        (torch.zeros(9, 4, dtype=torch.int32), "integer tensor of shape"),
        (torch.full((3, 9, 4), 9, dtype=torch.int32), r"lie in \[0, 9\)"),
        (torch.full((3, 9, 4), -1, dtype=torch.int32), r"lie in \[0, 9\)"),
    ],
)
def test_bad_indices_are_refused_by_name(indices, message):
    q, k, v, _, pad = _case()
    mask = hf.attention_mask(3, 9, 9, attention_mask=pad)
    with pytest.raises(ValueError, match=message):
        hf.attention_forward(_module(), q, k, v, mask, indices=indices)


def test_indices_without_a_mask_are_refused():
    q, k, v, idx, _ = _case()
    with pytest.raises(ValueError, match="need the attention_mask"):
        hf.attention_forward(_module(), q, k, v, None, indices=idx)
