"""Tiny random-weight models of many transformers architectures, built offline from configs.

Every model: hidden 32, 2 layers (1 + 1 for encoder-decoders), 4 heads of 8 (2 key/value heads where the
architecture groups them), vocabulary 99, random weights from ``torch.manual_seed``. The feature that
distinguishes the architecture is switched on and sized to bite at T = 11: sliding windows of 4 (full and
window layers mixed where the model mixes them), Llama 4's chunks of 4, Gemma 2's soft-cap, T5's relative
bias (scaled up), gpt-oss' sinks (random), GPTBigCode's single key/value head, Granite's attention
multiplier, ModernBERT's local (bidirectional) window.

Used by tests/test_hf_archs.py. The eight models tests/tiny_models.py holds are the ones tests/test_hf.py
checks in depth; this is the wide sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

VOCAB = 99
WINDOW = 4

# the common shrink, given to every config (a config ignores what it has no field for: stored, unread)
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, n_embd=32, n_layer=2,
    n_head=4, n_positions=64, d_model=32, ffn_dim=40, tie_word_embeddings=False,
)  # fmt: skip
GQA = dict(num_key_value_heads=2, head_dim=8)
SEQ2SEQ = dict(
    encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=40, decoder_ffn_dim=40, decoder_start_token_id=2,
)  # fmt: skip
T5 = dict(d_kv=8, d_ff=40, num_layers=1, num_decoder_layers=1, num_heads=4, relative_attention_num_buckets=8)
MOE = dict(num_local_experts=2, num_experts=2, num_experts_per_tok=2, moe_intermediate_size=16)
MLA = dict(
    num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
    n_routed_experts=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
)  # fmt: skip
GEMMA4 = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, global_head_dim=16)
MIXED = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])


@dataclass(frozen=True)
class Arch:
    """``model_type`` for ``AutoConfig.for_model``; ``kind``: decoder, encoder, seq2seq or speech (Whisper);
    ``config``: what differs from :data:`SMALL`; ``sdpa``: transformers has an sdpa path for it;
    ``auto``: the ``transformers`` Auto class, where the kind's default (causal LM, masked LM, seq2seq LM)
    does not fit (a bidirectional decoder's base model); ``embeds``: it runs from ``inputs_embeds``."""

    model_type: str
    kind: str = "decoder"
    config: dict = field(default_factory=dict)
    sdpa: bool = True
    auto: str | None = None
    embeds: bool = True


ARCHS: dict[str, Arch] = {
    # decoders
    "llama": Arch("llama", config=GQA),
    "mistral": Arch("mistral", config={**GQA, "sliding_window": WINDOW}),
    "ministral": Arch("ministral", config={**GQA, **MIXED}),
    "mixtral": Arch("mixtral", config={**GQA, **MOE, "sliding_window": WINDOW}),
    "qwen2": Arch("qwen2", config={**GQA, **MIXED, "use_sliding_window": True, "max_window_layers": 1}),
    "qwen3": Arch("qwen3", config={**GQA, **MIXED, "use_sliding_window": True, "max_window_layers": 1}),
    "qwen3_moe": Arch("qwen3_moe", config={**GQA, **MOE, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "gemma": Arch("gemma", config=GQA),
    "gemma2": Arch(
        "gemma2",
        config={**GQA, **MIXED, "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 8},
        sdpa=False,
    ),
    "gemma3_text": Arch("gemma3_text", config={**GQA, **MIXED, "query_pre_attn_scalar": 8}),
    "cohere2": Arch("cohere2", config={**GQA, **MIXED}),
    "phi": Arch("phi", config={"partial_rotary_factor": 0.5}),
    "phi3": Arch("phi3", config={**GQA, "sliding_window": WINDOW}),
    "gpt2": Arch("gpt2"),
    "gpt_bigcode": Arch("gpt_bigcode", config={"multi_query": True}),  # one key/value head
    "gpt_neox": Arch("gpt_neox", config={"rotary_pct": 0.5}),
    "gptj": Arch("gptj", config={"rotary_dim": 4}),
    "codegen": Arch("codegen", config={"rotary_dim": 4, "n_ctx": 64}),
    "opt": Arch("opt", config={"word_embed_proj_dim": 32}),
    "biogpt": Arch("biogpt"),
    "starcoder2": Arch("starcoder2", config={**GQA, "sliding_window": WINDOW}),
    "cohere": Arch("cohere", config=GQA),
    "olmo2": Arch("olmo2", config=GQA),
    "olmo3": Arch("olmo3", config={**GQA, **MIXED}),
    "stablelm": Arch("stablelm", config={**GQA, "partial_rotary_factor": 0.5, "qk_layernorm": True}),
    "persimmon": Arch("persimmon", config={"qk_layernorm": True, "partial_rotary_factor": 0.5}),
    "granite": Arch("granite", config={**GQA, "attention_multiplier": 0.5}),  # scaling ≠ 1/√d
    "nemotron": Arch("nemotron", config={**GQA, "partial_rotary_factor": 0.5}),
    "exaone4": Arch("exaone4", config={**GQA, **MIXED}),
    "smollm3": Arch(
        "smollm3", config={**GQA, "no_rope_layers": [1, 0], "use_sliding_window": True, "sliding_window": 4}
    ),
    "llama4_text": Arch(
        "llama4_text",
        config={
            **GQA,
            **MOE,
            "attention_chunk_size": WINDOW,
            "no_rope_layers": [1, 0],
            "layer_types": ["chunked_attention", "full_attention"],
            "intermediate_size_mlp": 40,
            "interleave_moe_layer_step": 2,
            "attn_temperature_tuning": True,
            "floor_scale": 4,
        },
    ),  # fmt: skip
    "gpt_oss": Arch("gpt_oss", config={**GQA, **MOE, **MIXED}, sdpa=False),
    "deepseek_v3": Arch("deepseek_v3", config={**MOE, **MLA, "q_lora_rank": 16}),  # value dim 6 ≠ key dim 12
    "deepseek_v32": Arch(
        "deepseek_v32",
        config={
            **MOE,
            **MLA,
            "q_lora_rank": 16,
            "index_topk": 5,
            "index_head_dim": 8,
            "index_n_heads": 2,
            "head_dim": 4,
            "mlp_layer_types": ["dense", "dense"],
        },
    ),  # DeepSeek sparse attention: each query sees only the 5 keys its indexer picks  # fmt: skip
    "deepseek_v2": Arch("deepseek_v2", config={**MOE, **MLA, "q_lora_rank": None}),
    "olmoe": Arch("olmoe", config={**GQA, **MOE}),
    "phimoe": Arch("phimoe", config={**GQA, **MOE, "sliding_window": WINDOW}),
    "qwen2_moe": Arch(
        "qwen2_moe",
        config={
            **GQA,
            **MOE,
            **MIXED,
            "shared_expert_intermediate_size": 16,
            "use_sliding_window": True,
            "max_window_layers": 1,
        },
    ),  # fmt: skip
    "granitemoe": Arch("granitemoe", config={**GQA, **MOE, "attention_multiplier": 0.5}),
    "jetmoe": Arch(
        "jetmoe", config={"num_key_value_heads": 2, "kv_channels": 8, **MOE, "num_experts_per_tok": 1}
    ),
    "glm4": Arch("glm4", config={**GQA, "partial_rotary_factor": 0.5}),
    "helium": Arch("helium", config=GQA),
    "seed_oss": Arch("seed_oss", config=GQA),
    "bitnet": Arch("bitnet", config=GQA),
    "vaultgemma": Arch(
        "vaultgemma",
        config={**GQA, **MIXED, "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 8},
        sdpa=False,
    ),
    # Doge computes its own dynamic mask from the 4-D one (keeps the 6 strongest keys of 11)
    "doge": Arch("doge", config={**GQA, "keep_window_size": 6}),
    "lfm2": Arch("lfm2", config={**GQA, "layer_types": ["conv", "full_attention"]}),  # one attention layer
    # not routed through transformers' attention interface (they refuse the name; checked by the test)
    "bloom": Arch("bloom"),
    "falcon": Arch("falcon", config={"num_kv_heads": 2, "alibi": True, "new_decoder_architecture": False}),
    "mpt": Arch("mpt", config={"d_model": 32, "n_heads": 4, "n_layers": 2, "expansion_ratio": 1}),
    "xglm": Arch("xglm"),
    "gpt_neo": Arch("gpt_neo", config={"attention_types": [[["global", "local"], 1]], "window_size": WINDOW}),
    # transformers itself fails to build it offline (checked, and skipped with its error, by the test)
    "dbrx": Arch(
        "dbrx",
        config={
            "d_model": 32,
            "n_heads": 4,
            "n_layers": 2,
            "max_seq_len": 64,
            "attn_config": {"kv_n_heads": 2},
            "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 2, "moe_top_k": 1},
        },
    ),  # fmt: skip
    "gemma3n_text": Arch(
        "gemma3n_text",
        config={
            **GQA,
            **MIXED,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": VOCAB,
            "num_kv_shared_layers": 0,
            "laurel_rank": 4,
            "altup_num_inputs": 2,
            "activation_sparsity_pattern": [0.0, 0.0],
        },
        embeds=False,
    ),  # fmt: skip
    "dots1": Arch(
        "dots1",
        config={**GQA, **MOE, "n_routed_experts": 2, "n_shared_experts": 1, "first_k_dense_replace": 1},
    ),
    "minicpm3": Arch("minicpm3", config={**MLA, "num_key_value_heads": 4, "q_lora_rank": 16}),
    "modernbert-decoder": Arch(
        "modernbert-decoder", config={"local_attention": 2 * WINDOW, "global_attn_every_n_layers": 2}
    ),
    "gemma4_text": Arch(
        "gemma4_text", config={**GQA, **MIXED, **GEMMA4}, embeds=False
    ),  # the full layers' heads: 16 wide
    "gemma4_shared_kv": Arch(
        "gemma4_text",
        config={
            **GQA,
            **GEMMA4,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "full_attention"],
            "sliding_window": WINDOW,
            "num_kv_shared_layers": 1,
            "attention_k_eq_v": True,
        },
        embeds=False,
    ),  # the last layer reuses an earlier layer's keys and values; keys are the values  # fmt: skip
    # encoders
    "gemma3_bidirectional": Arch(
        "gemma3_text",
        kind="encoder",
        auto="AutoModel",
        config={**GQA, **MIXED, "query_pre_attn_scalar": 8, "use_bidirectional_attention": True},
    ),  # EmbeddingGemma: a bidirectional window  # fmt: skip
    "gemma4_bidirectional": Arch(
        "gemma4_text",
        kind="encoder",
        auto="AutoModel",
        config={**GQA, **MIXED, **GEMMA4, "use_bidirectional_attention": "all"},
        embeds=False,
    ),  # fmt: skip
    "embedding_gemma2_text": Arch(
        "embedding_gemma2_text",
        kind="encoder",
        auto="AutoModel",
        config={**GQA, **MIXED, **GEMMA4},
        embeds=False,
    ),
    "bert": Arch("bert", kind="encoder"),
    "roberta": Arch("roberta", kind="encoder", config={"pad_token_id": 1, "max_position_embeddings": 80}),
    "xlm-roberta": Arch(
        "xlm-roberta", kind="encoder", config={"pad_token_id": 1, "max_position_embeddings": 80}
    ),
    "distilbert": Arch(
        "distilbert", kind="encoder", config={"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 40}
    ),
    "albert": Arch("albert", kind="encoder", config={"embedding_size": 16}),
    "electra": Arch("electra", kind="encoder", config={"embedding_size": 16}),
    "modernbert": Arch(
        "modernbert", kind="encoder", config={"local_attention": 2 * WINDOW, "global_attn_every_n_layers": 2}
    ),  # layer 0 global, layer 1 a local window of ±4
    # encoder-decoders
    "longt5": Arch(
        "longt5", kind="seq2seq", config={**T5, "decoder_start_token_id": 0, "local_radius": 2}, sdpa=False
    ),
    "switch_transformers": Arch(
        "switch_transformers",
        kind="seq2seq",
        config={
            **T5,
            "decoder_start_token_id": 0,
            "num_experts": 2,
            "num_sparse_encoder_layers": 1,
            "num_sparse_decoder_layers": 1,
        },
        sdpa=False,
    ),  # fmt: skip
    "t5": Arch("t5", kind="seq2seq", config={**T5, "decoder_start_token_id": 0}),
    "mt5": Arch("mt5", kind="seq2seq", config={**T5, "decoder_start_token_id": 0}),
    "umt5": Arch("umt5", kind="seq2seq", config={**T5, "decoder_start_token_id": 0}),  # a bias per layer
    "bart": Arch("bart", kind="seq2seq", config=SEQ2SEQ),
    "blenderbot-small": Arch("blenderbot-small", kind="seq2seq", config=SEQ2SEQ),
    "plbart": Arch("plbart", kind="seq2seq", config=SEQ2SEQ),
    "mbart": Arch("mbart", kind="seq2seq", config=SEQ2SEQ),
    "marian": Arch("marian", kind="seq2seq", config={**SEQ2SEQ, "decoder_vocab_size": VOCAB}),
    "pegasus": Arch("pegasus", kind="seq2seq", config=SEQ2SEQ),
    "m2m_100": Arch("m2m_100", kind="seq2seq", config=SEQ2SEQ),
    "blenderbot": Arch("blenderbot", kind="seq2seq", config=SEQ2SEQ),
    "whisper": Arch(
        "whisper",
        kind="speech",
        config={
            **SEQ2SEQ,
            "num_mel_bins": 8,
            "max_source_positions": 8,
            "max_target_positions": 32,
            "suppress_tokens": None,
            "begin_suppress_tokens": None,
        },
    ),  # fmt: skip
}
NOT_ROUTED = ("bloom", "falcon", "mpt", "xglm", "gpt_neo")
BROKEN = ("dbrx",)  # transformers 5.24: DbrxAttentionConfig has no rope_theta (its own model cannot build)
DECODERS = [n for n, a in ARCHS.items() if a.kind == "decoder" and n not in NOT_ROUTED + BROKEN]
ENCODERS = [n for n, a in ARCHS.items() if a.kind == "encoder"]
SEQ2SEQS = [n for n, a in ARCHS.items() if a.kind in ("seq2seq", "speech")]
ROUTED = DECODERS + ENCODERS + SEQ2SEQS


def config(name: str, **extra):
    """The tiny config of ``name`` (no download), with ``extra`` fields on top."""
    from transformers import AutoConfig

    arch = ARCHS[name]
    kwargs = {**SMALL, **arch.config, **extra}
    return AutoConfig.for_model(arch.model_type, **kwargs)


def model_class(name: str):
    import transformers as tf

    kind = ARCHS[name].kind
    if ARCHS[name].auto is not None:
        return getattr(tf, ARCHS[name].auto)
    if kind == "encoder":
        return tf.AutoModelForMaskedLM
    if kind == "speech":
        return tf.WhisperForConditionalGeneration
    return tf.AutoModelForSeq2SeqLM if kind == "seq2seq" else tf.AutoModelForCausalLM


def build(name: str, seed: int = 0, impl: str = "eager", **extra) -> torch.nn.Module:
    """The tiny model ``name`` with its LM head, eval mode, float32, random weights from ``seed``; the
    features that start at 0 (gpt-oss' sinks) or small (T5's relative bias) made to matter. ``extra``:
    config fields on top of the architecture's."""
    cfg = config(name, **extra)
    torch.manual_seed(seed)
    cls = model_class(name)
    # experts as a loop of matmuls: torch's grouped matmul has no float64
    model = cls(cfg) if ARCHS[name].kind == "speech" else cls.from_config(cfg, experts_implementation="eager")
    model.eval()
    model.set_attn_implementation(impl)
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            if hasattr(module, "sinks") and isinstance(module.sinks, torch.nn.Parameter):
                module.sinks.normal_(0.0, 1.0)
            if mod_name.endswith("relative_attention_bias"):
                module.weight.mul_(20.0)
    return model


def batch(name: str, side: str, t: int = 11, seed: int = 1) -> dict[str, torch.Tensor]:
    """Three sequences of ``t`` tokens, the first padded by 3 and the second by 1 on ``side`` ("left",
    "right"; "none": no ``attention_mask`` at all); encoder-decoders get 6 decoder tokens (Whisper: 16
    frames of 8 mel bins as the encoder's input)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, t), generator=g)
    mask = torch.ones(3, t, dtype=torch.long)
    for row, n in enumerate((3, 1)):
        if side == "left":
            mask[row, :n] = 0
        elif side == "right":
            mask[row, -n:] = 0
    pad = config_pad(name)
    ids[mask == 0] = pad
    kind = ARCHS[name].kind
    if kind == "speech":
        feats = torch.randn(3, 8, 16, generator=g)
        out = {
            "input_features": feats,
            "decoder_input_ids": ids[:, :6],
            "decoder_attention_mask": mask[:, :6],
        }
        return out if side != "none" else {k: v for k, v in out.items() if k != "decoder_attention_mask"}
    out = {"input_ids": ids, "attention_mask": mask} if side != "none" else {"input_ids": ids}
    if kind == "seq2seq":
        out["decoder_input_ids"] = torch.randint(3, VOCAB, (3, 6), generator=g)
    return out


def config_pad(name: str) -> int:
    return int(ARCHS[name].config.get("pad_token_id", SMALL["pad_token_id"]))


def real(name: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Bool (B, T_out): the output positions that are defined (real tokens; every decoder position of an
    encoder-decoder, whose queries are never padding here — Whisper's decoder: its real tokens)."""
    kind = ARCHS[name].kind
    ids = inputs["decoder_input_ids"] if kind in ("seq2seq", "speech") else inputs.get("input_ids")
    mask = inputs.get("decoder_attention_mask" if kind == "speech" else "attention_mask")
    if kind == "seq2seq" or mask is None:
        return torch.ones((ids if ids is not None else inputs["inputs_embeds"]).shape[:2], dtype=torch.bool)
    return mask.bool()


IMAGE_TOKEN = 110


def build_gemma3_vision(seed: int = 0) -> torch.nn.Module:
    """Gemma 3 with a vision tower (SigLIP, 1 layer, 16 × 16 images in 4 × 4 patches, 4 tokens per image)
    over the ``gemma3_text`` model above: image tokens attend to each other both ways (an or-mask of the
    causal recipe, a generic predicate for the engine), the vision tower bidirectionally."""
    import transformers as tf

    text = config("gemma3_text", vocab_size=120).to_dict()
    vision = dict(
        hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, image_size=16,
        patch_size=4,
    )  # fmt: skip
    cfg = tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN,
        boi_token_index=IMAGE_TOKEN + 1, eoi_token_index=IMAGE_TOKEN + 2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return tf.Gemma3ForConditionalGeneration(cfg).eval()


def gemma3_vision_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    """Three prompts of 14 tokens with one image each (begin, 4 image tokens, end at 3 … 8), rows
    left-padded by 2, 1, 0; random pixels."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 14), generator=g)
    ids[:, 3], ids[:, 4:8], ids[:, 8] = IMAGE_TOKEN + 1, IMAGE_TOKEN, IMAGE_TOKEN + 2
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[1, :1] = 0
    ids[mask == 0] = 0
    pixels = torch.randn(3, 3, 16, 16, generator=g)
    return {
        "input_ids": ids, "attention_mask": mask, "pixel_values": pixels,
        "token_type_ids": (ids == IMAGE_TOKEN).long(),
    }  # fmt: skip
