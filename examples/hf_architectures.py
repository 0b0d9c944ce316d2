"""Sweep: many transformers architectures on selfattention.hf, each against its own eager attention.

For each model type a tiny random-weight model is built from its default config shrunk to hidden 32,
2 layers, 4 heads (2 key/value heads where the architecture has them), window 4; a batch of two
9-token sequences, the first left-padded by 3, runs with ``attn_implementation="eager"`` and with
``"selfattention"`` (the lazy-mask engine route, and again inside ``recording()``); the script prints the
largest difference of the last hidden state over real tokens (of the two runs), and how many
attention calls reached our backend (0 would mean the architecture bypasses transformers' interface).
No download: configs only. (The architectures the test suite checks in depth are in
tests/test_hf.py; this is the wider, shallower look.)

    .venv/bin/python examples/hf_architectures.py [model_type ...]
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import nullcontext

import torch

TYPES = [
    "bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "mpnet", "deberta-v2", "modernbert",
    "gpt2", "gpt_bigcode", "gpt_neox", "opt", "bloom", "falcon", "phi", "phi3", "llama", "llama4_text",
    "mistral", "ministral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "olmo2", "olmo3", "stablelm", "cohere", "starcoder2", "granite", "glm", "helium", "ernie4_5", "exaone4",
    "seed_oss", "hunyuan_v1_dense", "smollm3", "jetmoe", "nemotron", "persimmon", "biogpt", "xglm", "bitnet",
]  # fmt: skip

SMALL = dict(
    vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, head_dim=8, pad_token_id=0, bos_token_id=None,
    eos_token_id=None, n_embd=32, n_layer=2, n_head=4, dim=32, n_layers=2, n_heads=4, hidden_dim=40,
    d_model=32, ffn_dim=40, num_layers=2, num_heads=4, embedding_size=32, num_experts=2,
    num_local_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, sliding_window=4,
)  # fmt: skip


def check(model_type: str) -> str:
    from transformers import AutoConfig, AutoModel

    import selfattention.hf

    config = AutoConfig.for_model(model_type)
    for name, value in SMALL.items():
        if hasattr(config, name):
            try:
                setattr(config, name, value)
            except (AttributeError, ValueError, TypeError):
                pass
    if getattr(config, "layer_types", None) is not None:  # one layer of each kind, two layers in all
        kinds = sorted(set(config.layer_types))
        config.layer_types = (kinds * 2)[:2]
    torch.manual_seed(0)
    model = AutoModel.from_config(config).eval()
    ids = torch.randint(3, 99, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0
    out = {}
    for impl in ("eager", "selfattention", "recorded"):
        model.set_attn_implementation("eager" if impl == "eager" else "selfattention")
        with torch.no_grad(), selfattention.hf.recording() if impl == "recorded" else nullcontext() as calls:
            out[impl] = model(input_ids=ids, attention_mask=mask).last_hidden_state
    if not calls:
        raise RuntimeError(
            "no attention call reached selfattention.hf (not routed through AttentionInterface)"
        )
    # the plain run takes the lazy-mask engine route; the recorded one materialises softcap/sinks
    diff = max(float((out["eager"] - out[k])[mask.bool()].abs().max()) for k in ("selfattention", "recorded"))
    return f"{diff:.1e} | {len(calls)}"


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import selfattention.hf

    selfattention.hf.register()
    from transformers.utils import logging

    logging.set_verbosity_error()
    print("| model type | max abs difference of the last hidden state vs eager (float32) | our calls |")
    print("| --- | --- | --- |")
    worst, ran = 0.0, 0
    for model_type in argv or TYPES:
        try:
            result = check(model_type)
            worst = max(worst, float(result.split(" | ")[0]))
            ran += 1
        except Exception as e:  # a config this sweep cannot shrink: say so, go on
            result = f"not run: {type(e).__name__}: {str(e).splitlines()[0][:90]} | –"
        print(f"| {model_type} | {result} |", flush=True)
    if ran == 0:
        print("nothing ran: no model type of the list could be built and routed through selfattention.hf")
        return 1
    print(f"largest difference over the {ran} that ran: {worst:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
