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


def _qkv_pad(g: torch.Generator, tk: int, padded: int):
    """q (3, 4, 9, 8), k/v (3, 2, tk, 8) float64, and a padding row (3, tk) whose batch row 0 starts with
    ``padded`` padding keys."""
    q = torch.randn(3, 4, 9, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, tk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    pad = torch.ones(3, tk, dtype=torch.bool)
    pad[0, :padded] = False
    return q, k, v, pad


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, pad = _qkv_pad(g, 9, 2)
    idx = torch.stack([torch.randperm(9, generator=g)[:4] for _ in range(3 * 9)]).view(3, 9, 4).int()
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


def _causal_padding_mask(form: str, tq: int, tk: int, pad: torch.Tensor):
    """The causal + padding mask of (3, tq, tk) as our mask function's LazyMask, its bool or float form."""
    mask = hf.attention_mask(3, tq, tk, mask_function=mu.causal_mask_function, attention_mask=pad)
    if form != "lazy":
        mask = mask.to_dense()
        if form == "float":
            mask = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, -math.inf)
    return mask


@pytest.mark.parametrize("form", ["lazy", "bool", "float"])
@pytest.mark.parametrize("name", ["indices", "block_indices"])
def test_selection_and_the_mask_together(form, name):
    case, oracle, tk = (_case, _oracle, 9) if name == "indices" else (_block_case, _block_oracle, 11)
    q, k, v, sel, pad = case()
    mask = _causal_padding_mask(form, 9, tk, pad)
    ours, _ = hf.attention_forward(_block_module(), q, k, v, mask, **{name: sel})
    theirs, rows, keep = oracle(q, k, v, sel, pad)
    assert rows.any() and not rows.all()
    assert (ours - theirs)[rows].abs().max() <= 1e-12
    assert (ours[~rows] == 0).all()
    plain, _ = hf.attention_forward(_block_module(), q, k, v, mask)
    assert (plain - theirs)[rows].abs().max() > 1e-2  # the selection matters
    weighted, w = hf.attention_forward(_block_module(), q, k, v, mask, output_attentions=True, **{name: sel})
    assert (weighted - ours).abs().max() <= 1e-12
    assert (w[~keep.expand_as(w)] == 0).all() and (w[keep.expand_as(w)] > 0).all()
    q.requires_grad_(True)
    ours, _ = hf.attention_forward(_block_module(), q, k, v, mask, **{name: sel})
    theirs, rows, _ = oracle(q, k, v, sel, pad)
    (g_ours,) = torch.autograd.grad(ours[rows].sum(), q)
    (g_theirs,) = torch.autograd.grad(theirs[rows].sum(), q)
    assert (g_ours - g_theirs).abs().max() <= 1e-12 and g_theirs.abs().max() > 1e-3


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("indices", torch.zeros(3, 9, 4), "integer tensor of shape"),
        ("indices", torch.zeros(3, 8, 4, dtype=torch.int32), r"\(3, 9, K\)"),
        ("indices", torch.zeros(9, 4, dtype=torch.int32), "integer tensor of shape"),
        ("indices", torch.full((3, 9, 4), 9, dtype=torch.int32), r"lie in \[0, 9\)"),
        ("indices", torch.full((3, 9, 4), -1, dtype=torch.int32), r"lie in \[0, 9\)"),
        ("block_indices", torch.zeros(3, 2, 9, 3), "integer tensor of shape"),
        ("block_indices", torch.zeros(3, 3, 9, 3, dtype=torch.long), "H_idx dividing the 4 query heads"),
        ("block_indices", torch.zeros(3, 2, 8, 3, dtype=torch.long), "integer tensor of shape"),
        ("block_indices", torch.full((3, 2, 9, 3), 5, dtype=torch.long), r"lie in \[-1, 5\)"),
        ("block_indices", torch.full((3, 2, 9, 3), -2, dtype=torch.long), r"lie in \[-1, 5\)"),
    ],
)
def test_bad_indices_are_refused_by_name(name, bad, message):
    """(Blocks of 2 keys over Tk = 9: 5 blocks.)"""
    q, k, v, _, pad = _case()
    mask = hf.attention_mask(3, 9, 9, attention_mask=pad)
    with pytest.raises(ValueError, match=message):
        hf.attention_forward(_block_module(), q, k, v, mask, **{name: bad})


@pytest.mark.parametrize("name", ["indices", "block_indices"])
@pytest.mark.parametrize("causal", [True, False])
def test_a_selection_without_a_mask_takes_the_mask_less_rule(name, causal):
    """No mask (under torch.compile transformers' sdpa_mask gives None for an unpadded causal batch): the
    mask-less call's rule — causal top-left from module.is_causal, or every key — ANDed with the selection
    (before: a ValueError)."""
    q, k, v, sel, _ = _case() if name == "indices" else _block_case()
    tk = k.shape[-2]
    module = _block_module()
    module.is_causal = causal
    rule = torch.ones(9, tk, dtype=torch.bool)
    if causal:
        rule = rule.tril()
    ours, _ = hf.attention_forward(module, q, k, v, None, **{name: sel})
    want, _ = hf.attention_forward(module, q, k, v, rule[None, None].expand(3, 1, 9, tk), **{name: sel})
    assert torch.equal(ours, want)


# --- block_indices: MiniMax M3's block-sparse indexer (transformers' modeling_minimax_m3_vl.py) -----------


def _block_module(block_size: int = 2):
    m = _module()
    m.indexer = types.SimpleNamespace(block_size=block_size)
    return m


def _block_case(seed: int = 0):
    """q (3, 4, 9, 8), k/v (3, 2, 11, 8): Tq < Tk (the mask's queries at positions 0 … 8), blocks of 2 keys (6
    blocks, the last one cut to 1 key), 2 index heads for 4 query heads, 3 blocks a query, some -1."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, pad = _qkv_pad(g, 11, 3)
    sel = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(3 * 2 * 9)]).view(3, 2, 9, 3)
    sel[1, :, :, 2] = -1
    return q, k, v, sel, pad


def _block_oracle(q, k, v, sel, pad):
    keep = torch.zeros(3, 4, 9, 11, dtype=torch.bool)
    for b in range(3):
        for h in range(4):
            for i in range(9):
                for n in sel[b, h // 2, i].tolist():
                    for j in range(2 * n, min(2 * n + 2, 11)) if n >= 0 else ():
                        keep[b, h, i, j] = j <= i and bool(pad[b, j])  # causal from position 0
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    return out.nan_to_num(0.0).transpose(1, 2), keep.any(-1).transpose(1, 2), keep


def test_block_indices_need_a_block_size():
    q, k, v, sel, pad = _block_case()
    mask = hf.attention_mask(3, 9, 11, attention_mask=pad)
    with pytest.raises(ValueError, match="block size"):
        hf.attention_forward(_module(), q, k, v, mask, block_indices=sel)


def test_a_minimax_m3_model_matches_eager():
    """A tiny random MiniMax M3 (both layers block-sparse, blocks of 4 keys, 3 blocks a query, MoE), batch
    of 2 with right padding: logits of ours vs transformers' eager. (Left padding differs at real tokens
    after the first layer under every implementation that zeroes padded query rows, as ours does: the
    model's indexer max-pools the padded rows' hidden states into its block scores.)"""
    mm3 = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    hf.register()
    cfg = MiniMaxM3VLTextConfig(
        vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=4, num_experts_per_tok=2,
        dense_intermediate_size=64, shared_intermediate_size=64, index_n_heads=2, index_head_dim=16,
        index_block_size=4, index_topk_blocks=3, index_local_blocks=1,
        layer_types=["minimax_m3_sparse"] * 2, mlp_layer_types=["dense", "sparse"],
        max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = mm3.MiniMaxM3VLForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (2, 37))
    am = torch.ones(2, 37, dtype=torch.long)
    am[0, -5:] = 0
    logits = {}
    for impl in ("eager", hf.NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(input_ids=ids, attention_mask=am).logits
    real = am.bool()
    assert (logits[hf.NAME] - logits["eager"])[real].abs().max() <= 1e-5
