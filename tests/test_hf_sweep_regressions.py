"""Architectures a sweep of transformers' model types (541 of them, tiny random configs, 2026-12-02) found
broken on this backend while eager and sdpa agree; each is a regression test against transformers' own
eager attention on the real tokens of a padded batch.

* Inkling: keys/values from a short convolution are views whose last dim has stride T — the fused CPU
  kernel read them as contiguous (logits 25 % off, no error).
* Git, BigBird-Pegasus: their own eager code adds the mask transformers built for this attention to float
  scores; the lazy bool mask added 1 to visible scores and hid nothing (2.6 % / 4.8 % off).
* DeepSeek V4: its compressed layers extend the mask only when it is a tensor (ValueError before).
* GOT-OCR2: hands ``logits_to_keep`` down to every attention call (TypeError before).
* Qwen2-MoE with ``use_sliding_window=False`` (its released checkpoints): the config sets
  sliding_window = 0 and the model still builds the sliding mask nobody reads (ValueError before).
* MiniMax whose first layer is a linear-attention layer: while decoding, transformers sizes the full
  layers' mask against that layer's cache (Tk = 1); eager broadcasts it over the keys (ValueError before)."""

from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers")

from selfattention import hf  # noqa: E402

SMALL = dict(
    vocab_size=128, hidden_size=64, d_model=64, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=96, max_position_embeddings=128,
)  # fmt: skip

CASES = {
    "inkling_text": dict(
        num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2,
        swa_head_dim=16, layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "dense"],
        sliding_window_size=8,
    ),
    "git": dict(),
    "bigbird_pegasus": dict(
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=96, decoder_ffn_dim=96, attention_type="original_full",
    ),
    "deepseek_v4": dict(
        moe_intermediate_size=32, num_key_value_heads=2, head_dim=16, q_lora_rank=16, num_experts_per_tok=2,
        n_routed_experts=4, sliding_window=8, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
        index_topk=5, layer_types=["sliding_attention", "compressed_sparse_attention"],
        mlp_layer_types=["moe", "moe"],
    ),
    "qwen2_moe": dict(
        num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, use_sliding_window=False,
    ),
}  # fmt: skip


def _model(model_type: str):
    cfg = tf.AutoConfig.for_model(model_type, **SMALL, **CASES[model_type])
    torch.manual_seed(0)
    if model_type == "bigbird_pegasus":
        return tf.AutoModelForSeq2SeqLM.from_config(cfg).eval()
    return tf.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("model_type", list(CASES))
def test_matches_eager_on_real_tokens(model_type):
    hf.register()
    model = _model(model_type)
    ids = torch.randint(5, 128, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, -4:] = 0  # right padding: padded rows never feed a real one (ours gives them zeros, eager not)
    inputs = dict(input_ids=ids, attention_mask=mask)
    if model_type == "bigbird_pegasus":
        inputs["decoder_input_ids"] = ids[:, :5]
    out = {}
    for impl in ("eager", hf.NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            o = model(**inputs)
        out[impl] = (
            o.encoder_last_hidden_state[mask.bool()]
            if model_type == "bigbird_pegasus"
            else o.logits[mask.bool()]
        )
    scale = out["eager"].abs().max()
    assert scale > 1e-2
    assert (out[hf.NAME] - out["eager"]).abs().max() <= 1e-5 * scale


def test_lazy_mask_added_to_float_scores_is_eagers_additive_mask():
    """The rule behind Git's fix, on the mask alone: + and += with a float tensor give eager's 0 / finfo.min
    mask of that tensor's dtype; bool contexts keep the bool mask."""
    from transformers import masking_utils as mu

    lazy = hf.attention_mask(2, 5, 5, mask_function=mu.causal_mask_function)
    keep = lazy.to_dense()
    for dtype in (torch.float32, torch.bfloat16):
        scores = torch.randn(2, 4, 5, 5).to(dtype)
        want = torch.where(keep, scores, scores + torch.finfo(dtype).min)
        for got in (scores + lazy, lazy + scores, torch.add(scores, lazy), scores.clone().add_(lazy)):
            assert got.dtype == dtype and torch.equal(got, want)
        s = scores.clone()
        s += lazy
        assert torch.equal(s, want)
    assert torch.equal(torch.where(lazy, 1.0, 0.0).bool(), keep)
    assert torch.equal(~lazy, ~keep)


def test_the_add_rule_survives_slices_expands_methods_and_keywords():
    """``causal_mask = attention_mask[:, :, :, :k]`` then ``scores + causal_mask`` (the usual eager code),
    ``expand``, ``mask.add(scores)``, keyword forms, ``baddbmm`` with the mask as the added term: all give
    eager's additive mask (found by a breaker run: they added 1 and hid nothing). What changes the meaning
    (``~``, a comparison, ``float()``) is a plain tensor, as from a plain bool mask."""
    from transformers import masking_utils as mu

    from selfattention.hf_maskview import MaskView

    lazy = hf.attention_mask(1, 4, 4, mask_function=mu.causal_mask_function)
    keep = lazy.to_dense()
    sc = torch.randn(1, 2, 4, 4)
    low = torch.finfo(torch.float32).min
    want = torch.where(keep, sc, sc + low)
    cases = [
        sc + lazy[:, :, :, :4], lazy[:, :, :, :4] + sc, sc + lazy.expand(1, 2, 4, 4), lazy.add(sc),
        sc.add(other=lazy), torch.add(input=sc, other=lazy), torch.add(sc, lazy[0]), sc + (lazy & keep),
        sc + lazy.reshape(1, 1, 4, 4).contiguous(),
    ]  # fmt: skip
    for got in cases:
        assert type(got) is torch.Tensor and torch.equal(got, want)
    mats = torch.randn(2, 4, 3), torch.randn(2, 3, 4)
    assert torch.equal(torch.baddbmm(lazy[0], *mats), torch.where(keep[0], mats[0] @ mats[1], low))
    for meaning_changed in (~lazy, lazy == 0, lazy.float(), lazy[:, :, :2] != 0):
        assert type(meaning_changed) is torch.Tensor
    assert torch.equal(sc + lazy.float(), sc + keep.float())
    view = lazy[:, :, :, :4]
    assert isinstance(view, MaskView) and isinstance(view, torch.Tensor) and view.dtype == torch.bool
    module = torch.nn.Module()
    module.is_causal = True
    module.config = type("C", (), {"_attn_implementation": hf.NAME})()
    q = torch.randn(1, 2, 4, 8)
    a, _ = hf.attention_forward(module, q, q, q, view)  # a sliced mask handed on to the attention
    b, _ = hf.attention_forward(module, q, q, q, keep)
    assert torch.equal(a, b)


def test_logits_to_keep_is_ignored():
    q = torch.randn(1, 2, 5, 8)
    module = torch.nn.Module()
    module.is_causal = True
    module.config = type("C", (), {"_attn_implementation": hf.NAME})()
    lazy = hf.attention_mask(1, 5, 5)
    a, _ = hf.attention_forward(module, q, q, q, lazy, logits_to_keep=1)
    b, _ = hf.attention_forward(module, q, q, q, lazy)
    assert torch.equal(a, b)


def test_minimax_generates_when_its_first_layer_is_linear_attention():
    hf.register()
    cfg = tf.MiniMaxConfig(
        vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, block_size=4,
        layer_types=["linear_attention", "full_attention"], pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.MiniMaxForCausalLM(cfg).eval()
    ids = torch.randint(3, 99, (1, 11), generator=torch.Generator().manual_seed(2))
    tokens = {}
    for impl in ("eager", "selfattention"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            tokens[impl] = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(tokens["selfattention"], tokens["eager"])
