"""Checkpoints of :class:`~selfattention.decoder.model.Decoder`: a ``.safetensors`` file of the weights
and a ``.json`` next to it (config, alphabet, and ``info``: how it was made).

The package ships one trained checkpoint, :func:`shipped_checkpoint` (``decoder/data/decoder.safetensors``),
made by ``selfattention train`` with the recipe in :mod:`selfattention.decoder.training`; its JSON records
the command, steps, seed, losses, wall time and torch version.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from ..i18n import _
from .model import CharTokenizer, Decoder, DecoderConfig

__all__ = [
    "FORMAT",
    "CheckpointError",
    "default_checkpoint",
    "shipped_checkpoint",
    "save_checkpoint",
    "check_state_dict",
    "load_checkpoint",
]

FORMAT = "selfattention-decoder/1"


class CheckpointError(ValueError):
    """A checkpoint that does not fit its config or the model (missing keys, wrong shapes, bad JSON)."""


def shipped_checkpoint() -> Path:
    """The trained checkpoint inside the installed package (``selfattention/decoder/data/decoder.safetensors``).

    The path is returned whether or not the file exists (a source tree where it was deleted).
    """
    return Path(str(resources.files(__package__) / "data" / "decoder.safetensors"))


def default_checkpoint() -> Path:
    """Where ``selfattention train`` writes by default: ``$XDG_CACHE_HOME/selfattention/decoder.safetensors``
    (``~/.cache/...`` when XDG_CACHE_HOME is not set)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "selfattention" / "decoder.safetensors"


def _config_path(path: Path) -> Path:
    return path.with_suffix(".json")


def save_checkpoint(
    model: Decoder, tokenizer: CharTokenizer, path: str | Path, info: dict | None = None
) -> tuple[Path, Path]:
    """Write the weights to ``path`` (safetensors) and config + alphabet + ``info`` to ``path.json``.

    Returns the two paths. Creates the parent directory.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": FORMAT})
    meta = {"format": FORMAT, "config": asdict(model.config), "alphabet": tokenizer.chars, "info": info or {}}
    cfg_path = _config_path(path)
    cfg_path.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path, cfg_path


def check_state_dict(model: nn.Module, tensors: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Raise :class:`CheckpointError` naming every missing/unexpected tensor and every shape mismatch."""
    expected = model.state_dict()
    problems = []
    for name, t in expected.items():
        if name not in tensors:
            problems.append(
                _("missing tensor {name!r} (the model expects shape {shape})").format(
                    name=name, shape=tuple(t.shape)
                )
            )
        elif tuple(tensors[name].shape) != tuple(t.shape):
            problems.append(
                _("tensor {name!r} has shape {got}, the model expects {want}").format(
                    name=name, got=tuple(tensors[name].shape), want=tuple(t.shape)
                )
            )
    for name in tensors:
        if name not in expected:
            problems.append(
                _("unexpected tensor {name!r} of shape {shape}").format(
                    name=name, shape=tuple(tensors[name].shape)
                )
            )
    if problems:
        more = _(" (and {n} more)").format(n=len(problems) - 5) if len(problems) > 5 else ""
        raise CheckpointError(
            _("{source} does not fit the model: {problems}{more}").format(
                source=source, problems=_("; ").join(problems[:5]), more=more
            )
        )


def load_checkpoint(path: str | Path) -> tuple[Decoder, CharTokenizer, dict]:
    """Load a checkpoint written by :func:`save_checkpoint`: ``(model in eval mode, tokenizer, info)``.

    Raises:
        FileNotFoundError: the ``.safetensors`` or its ``.json`` is missing.
        CheckpointError: bad JSON/config, or tensors missing, unexpected or of the wrong shape (each
            named with both shapes).
    """
    from safetensors.torch import load_file

    path = Path(path)
    cfg_path = _config_path(path)
    for p in (path, cfg_path):
        if not p.is_file():
            raise FileNotFoundError(_("checkpoint file not found: {path}").format(path=p))
    try:
        meta = json.loads(cfg_path.read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise CheckpointError(
                _("{path}: format {got!r}, expected {want!r}").format(
                    path=cfg_path, got=meta.get("format"), want=FORMAT
                )
            )
        config = DecoderConfig(**meta["config"])
        tokenizer = CharTokenizer(meta["alphabet"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        why = _("missing key {key!r}").format(key=e.args[0]) if isinstance(e, KeyError) else str(e)
        raise CheckpointError(
            _("{path} is not a valid decoder config: {error}").format(path=cfg_path, error=why)
        ) from None
    if tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(
            _("{path}: alphabet has {n} characters but vocab_size is {vocab}").format(
                path=cfg_path, n=tokenizer.vocab_size, vocab=config.vocab_size
            )
        )
    model = Decoder(config)
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(
            _("{path} is not a readable safetensors file: {error}").format(path=path, error=e)
        ) from None
    check_state_dict(model, tensors, source=str(path))
    model.load_state_dict(tensors, strict=True)
    return model.eval(), tokenizer, meta.get("info", {})
