"""Loading a checkpoint into transformers, offline, with our attention or the model's own — cached.

:func:`load_model` gives the model with **our** attention (``attn_implementation="selfattention"``,
registered by :func:`selfattention.hf.register`), :func:`load_reference_model` the same weights with
transformers' ``eager`` or ``sdpa`` attention. Both read with ``local_files_only=True`` (never the network),
in eval mode and float32, and keep the :data:`LOADED_MAX` most recently used (model, attention) pairs.
The folder comes from :func:`selfattention.pretrained_files.resolve_model`. :mod:`selfattention.pretrained`
re-exports both functions and :data:`LOADED_MAX` (its ``__all__`` lists them).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from . import hf
from .pretrained_files import resolve_model

#: Loaded (model, tokenizer) pairs kept for reuse, most recent last: a few, not every model ever loaded
#: (each holds its weights); an evicted model lives on only as long as the caller holds it. Change it here:
#: ``selfattention.pretrained.LOADED_MAX`` is a re-exported copy.
LOADED_MAX = 4
_loaded: OrderedDict[tuple[str, str], tuple[Any, Any]] = OrderedDict()
_loaded_lock = threading.Lock()


def _load(path: str, attn_implementation: str) -> tuple[Any, Any]:
    key = (path, attn_implementation)
    with _loaded_lock:
        if key in _loaded:
            _loaded.move_to_end(key)
            return _loaded[key]
    pair = _read(path, attn_implementation)
    with _loaded_lock:
        pair = _loaded.setdefault(key, pair)  # another thread may have loaded it meanwhile: one copy
        _loaded.move_to_end(key)
        while len(_loaded) > LOADED_MAX:
            _loaded.popitem(last=False)
    return pair


def _read(path: str, attn_implementation: str) -> tuple[Any, Any]:
    hf.register()
    from transformers import AutoConfig, AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"the model in {path} is an encoder-decoder ({config.model_type}); explain and report read "
            "encoders and decoders. For an encoder-decoder use selfattention.hf with the model directly"
        )
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the middle of our output
    verbosity = hf_logging.get_verbosity()
    # a decoder saved with its language-model head loads into the base model: transformers reports the
    # unused head weights, which says nothing about the attention
    hf_logging.set_verbosity_error()
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(_tokenizer_error(path, e)) from None
        model = AutoModel.from_pretrained(
            path, local_files_only=True, attn_implementation=attn_implementation, dtype=torch.float32
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar_was_on:
            hf_logging.enable_progress_bar()
    model.eval()
    return model, tokenizer


def load_model(model: str | Path | None = None) -> tuple[Any, Any]:
    """The model with **our** attention: ``(model, tokenizer)``, loaded once and kept among the
    :data:`LOADED_MAX` most recently used (model, attention) pairs.

    ``model``: ``None`` for the bundled all-MiniLM-L6-v2 (a ``BertModel``), or a local checkpoint folder
    (loaded with ``AutoModel``: the base model, without a task head). Eval mode, float32,
    ``attn_implementation="selfattention"``. Offline: never the network.

    Raises:
        ImportError: transformers or the model package is missing.
        ValueError: not a checkpoint folder, no tokenizer in it, or an encoder-decoder.
    """
    return _load(str(resolve_model(model)), hf.NAME)


def load_reference_model(
    attn_implementation: str = "eager", model: str | Path | None = None
) -> tuple[Any, Any]:
    """The same weights with transformers' **own** attention (``"eager"`` or ``"sdpa"``), loaded apart
    and cached. ``eager`` is the model's plain softmax(QKᵀ·scale + mask)·V and returns weights, ``sdpa``
    is torch's fused kernel (no weights)."""
    if attn_implementation not in ("eager", "sdpa"):
        raise ValueError(f"attn_implementation must be 'eager' or 'sdpa', got {attn_implementation!r}")
    return _load(str(resolve_model(model)), attn_implementation)


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
"""Files one of which a folder that transformers can read a tokenizer from holds."""


def _tokenizer_error(path, error: Exception) -> str:
    """The message for a folder AutoTokenizer cannot read: which files are missing when none is there,
    else transformers' own reason on one line (it spreads it over several, and its first ends in "one of:")."""
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).exists() for name in TOKENIZER_FILES):
        return (
            f"cannot read a tokenizer from {path}: the folder holds no tokenizer files (none of "
            f"{', '.join(TOKENIZER_FILES)}); save the model's tokenizer beside it "
            f"(tokenizer.save_pretrained({str(path)!r}))"
        )
    reason = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"cannot read a tokenizer from {path}: {reason}"
