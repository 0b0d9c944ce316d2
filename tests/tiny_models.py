"""Tiny random-weight transformers models built from configs (no download), for the integration tests.

Each is at most hidden 32 and 2 layers, with the feature that matters switched on and sized to bite at
T = 9: grouped-query heads, a sliding window of 4, full and window layers mixed, logit soft-capping,
cross-attention, a relative position bias, attention sinks.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 99
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=None,
    eos_token_id=None,
)


def _configs():
    import transformers as tf

    return {
        "bert": (tf.BertModel, tf.BertConfig(**_COMMON)),
        "gpt2": (
            tf.GPT2LMHeadModel,
            tf.GPT2Config(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=64,
                pad_token_id=0,
                bos_token_id=None,
                eos_token_id=None,
            ),
        ),
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**_COMMON, num_key_value_heads=2)),
        "mistral": (
            tf.MistralForCausalLM,
            tf.MistralConfig(**_COMMON, num_key_value_heads=2, sliding_window=4),
        ),
        "qwen2": (
            tf.Qwen2ForCausalLM,
            tf.Qwen2Config(
                **_COMMON,
                num_key_value_heads=2,
                use_sliding_window=True,
                sliding_window=4,
                max_window_layers=1,
                layer_types=["full_attention", "sliding_attention"],
            ),
        ),
        "gemma2": (
            tf.Gemma2ForCausalLM,
            tf.Gemma2Config(
                **_COMMON,
                num_key_value_heads=2,
                head_dim=8,
                sliding_window=4,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=None,
                query_pre_attn_scalar=8,
            ),
        ),
        "bart": (
            tf.BartForConditionalGeneration,
            tf.BartConfig(
                vocab_size=VOCAB,
                d_model=32,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=37,
                decoder_ffn_dim=37,
                max_position_embeddings=64,
                pad_token_id=0,
                decoder_start_token_id=2,
            ),
        ),
        "t5": (
            tf.T5ForConditionalGeneration,
            tf.T5Config(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=37,
                num_layers=1,
                num_decoder_layers=1,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=0,
                decoder_start_token_id=0,
            ),
        ),
        "gpt_oss": (
            tf.GptOssForCausalLM,
            tf.GptOssConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                num_local_experts=2,
                num_experts_per_tok=1,
                sliding_window=4,
                max_position_embeddings=64,
                layer_types=["sliding_attention", "full_attention"],
                pad_token_id=0,
            ),
        ),
    }


NAMES = ["bert", "gpt2", "llama", "mistral", "qwen2", "gemma2", "bart", "t5", "gpt_oss"]
NO_SDPA = {"gemma2", "gpt_oss"}  # transformers has no sdpa path for them (softcap, sinks): eager only
ENCODER_DECODER = {"bart", "t5"}
DECODERS = {"gpt2", "llama", "mistral", "qwen2", "gemma2", "gpt_oss"}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """The tiny model ``name`` in eval mode, float32, random weights from ``seed``."""
    cls, config = _configs()[name]
    torch.manual_seed(seed)
    model = cls(config).eval()
    if name == "gpt_oss":  # sinks start at 0; give them values that matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
    if name == "t5":  # a relative position bias large enough to move the weights
        with torch.no_grad():
            for stack in (model.encoder, model.decoder):
                stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(20.0)
    return model


WORDS = "the animal did not cross street because it was too tired a cat sat on mat".split()


def save_checkpoint(name: str, folder: Path) -> Path:
    """Save the tiny model ``name`` with a word-level tokenizer over :data:`WORDS` into ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {w: i for i, w in enumerate([*specials, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    encoder = name == "bert"
    if encoder:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        **({"cls_token": "[CLS]", "sep_token": "[SEP]"} if encoder else {}),
        model_max_length=48,
    )
    build(name).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder
