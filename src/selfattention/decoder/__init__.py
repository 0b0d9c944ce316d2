"""A small GPT-like causal decoder on :class:`~selfattention.mha.MultiHeadAttention`, shipped trained, that
generates with or without the KV cache: its purpose is to show that the cache changes nothing but speed.

* :mod:`.model` — :class:`CharTokenizer` (one token per character), :class:`DecoderConfig`,
  :class:`Decoder` (token + learned position embeddings, pre-LayerNorm blocks, as GPT-2).
* :mod:`.sampling` — :func:`generate`: greedy or sampled (:class:`Sampling`: temperature, top-k, top-p,
  seed), with the cache (one single-token step per new token) or without (recompute everything); the
  same tokens either way.
* :mod:`.batch` — :func:`generate_batch`: several prompts of different lengths decoded together on
  ragged (optionally paged) caches, each sequence finishing on its own, each the same tokens as alone.
* :mod:`.training` — :func:`train` by step count, seeded, on CPython's own documentation prose
  (:func:`training_text`, no download); :data:`RECIPE` and :func:`train_recipe` make the shipped model.
* :mod:`.checkpoint` — ``.safetensors`` weights + ``.json`` config; :func:`shipped_checkpoint` is the
  trained one inside the package, which ``selfattention generate`` loads at once (it never trains).

>>> model, tokenizer, info = load_checkpoint(shipped_checkpoint())
>>> info["held_out_loss"] <= 1.6   # nats per character on the held-out 5 % of the text
True
>>> ids = tokenizer.encode("The ")
>>> cached = generate(model, ids, 20, sampling=Sampling(temperature=0.8, seed=1))
>>> uncached = generate(model, ids, 20, sampling=Sampling(temperature=0.8, seed=1), use_cache=False)
>>> cached.tolist() == uncached.tolist()
True
"""

from .batch import generate_batch, sequence_sampling
from .checkpoint import (
    FORMAT,
    CheckpointError,
    check_state_dict,
    default_checkpoint,
    load_checkpoint,
    save_checkpoint,
    shipped_checkpoint,
)
from .model import CharTokenizer, Decoder, DecoderConfig
from .sampling import GREEDY, Sampling, generate, next_tokens
from .training import (
    RECIPE,
    Recipe,
    TrainResult,
    held_out_loss,
    recipe_with,
    train,
    train_recipe,
    training_text,
)

__all__ = [
    "FORMAT",
    "GREEDY",
    "RECIPE",
    "CharTokenizer",
    "CheckpointError",
    "Decoder",
    "DecoderConfig",
    "Recipe",
    "Sampling",
    "TrainResult",
    "check_state_dict",
    "default_checkpoint",
    "generate",
    "generate_batch",
    "sequence_sampling",
    "held_out_loss",
    "load_checkpoint",
    "next_tokens",
    "recipe_with",
    "save_checkpoint",
    "shipped_checkpoint",
    "train",
    "train_recipe",
    "training_text",
]
