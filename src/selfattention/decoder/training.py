"""Training the small decoder: by step count, seeded, on text every CPython install ships.

The text is the documentation prose of :mod:`pydoc_data.topics` (no download); the last 5 % is held
out. :func:`train` is plain next-token training (AdamW, linear warm-up, cosine decay, gradient clipping)
whose batches come from a seeded generator, so a run is a function of its arguments: the same seed,
steps, torch version, thread count and machine give the same weights (no wall-time cap decides when it
stops). :func:`train_recipe` trains the model that ships in the package (:data:`RECIPE`) and saves it.
"""

from __future__ import annotations

import math
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from .._validation import check_positive_int
from .checkpoint import save_checkpoint
from .model import CharTokenizer, Decoder, DecoderConfig

__all__ = [
    "Recipe",
    "RECIPE",
    "TrainResult",
    "training_text",
    "held_out_loss",
    "train",
    "train_recipe",
    "recipe_with",
]

HELD_OUT = 0.05  # the last 5 % of the text


def training_text() -> str:
    """The prose of CPython's ``pydoc_data.topics`` (help() topics), joined in sorted-key order.

    Present in every CPython install; ~0.45 M characters of English with code samples (the exact text
    depends on the Python version).
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


@dataclass(frozen=True)
class Recipe:
    """Everything that decides a training run of the shipped model (sizes, steps, batches, optimiser).

    ``threads`` is the torch thread count used while training: float sums may differ between thread
    counts, so it is part of the recipe.
    """

    context: int = 256
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 4
    steps: int = 3000
    batch_size: int = 8
    lr: float = 3e-3
    weight_decay: float = 0.1
    seed: int = 0
    threads: int = 2
    eval_every: int = 250

    def __post_init__(self) -> None:
        for name in ("context", "d_model", "num_heads", "num_layers", "steps", "batch_size", "threads"):
            check_positive_int(name, getattr(self, name))
        if not (isinstance(self.lr, int | float) and self.lr > 0):
            raise ValueError(f"lr must be a number > 0, got {self.lr!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    def config(self, vocab_size: int) -> DecoderConfig:
        return DecoderConfig(
            vocab_size=vocab_size,
            context=self.context,
            d_model=self.d_model,
            num_heads=self.num_heads,
            num_layers=self.num_layers,
        )


#: The recipe of the checkpoint that ships in the package (``selfattention train`` with no options).
RECIPE = Recipe()


@dataclass
class TrainResult:
    """What :func:`train` did: the steps run, wall seconds, the mean training loss of the last 5 % of
    the steps, the held-out loss at the end, every step's training loss and the held-out loss every
    ``eval_every`` steps (``[(step, loss), ...]``). Losses are in nats per token."""

    steps: int
    seconds: float
    train_loss: float
    val_loss: float
    losses: list[float] = field(default_factory=list)
    val_history: list[tuple[int, float]] = field(default_factory=list)


def _batches(
    data: torch.Tensor, batch: int, seq: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq + 1)  # (B, seq + 1)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def held_out_loss(model: Decoder, data: torch.Tensor, seq_len: int | None = None) -> float:
    """Mean next-token cross-entropy (nats/token) over ``data`` (int64 (N,)), in consecutive windows of
    ``seq_len`` tokens (default: the model's context); deterministic, every token but the last predicted
    once (a shorter last window included).

    >>> _ = torch.manual_seed(0)
    >>> m = Decoder(DecoderConfig(vocab_size=5, context=8, d_model=8, num_heads=2, num_layers=1))
    >>> round(held_out_loss(m, torch.arange(20) % 5), 1)  # an untrained model: about log(5) = 1.6
    1.6
    """
    seq = model.config.context if seq_len is None else seq_len
    if data.dim() != 1 or data.numel() < 2:
        raise ValueError(f"data must be a 1-D tensor of at least 2 token ids, got shape {tuple(data.shape)}")
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, data.numel() - 1, seq):
        x = data[start : start + seq][None]  # (1, ≤ seq)
        y = data[start + 1 : start + seq + 1][None]
        x = x[:, : y.shape[1]]
        logits = model(x)
        total += nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).double(), y.reshape(-1), reduction="sum"
        ).item()
        count += y.numel()
    model.train(was_training)
    return total / count


@contextmanager
def _reproducible(threads: int | None) -> Iterator[None]:
    """Fixed thread count and deterministic algorithms for the block; both restored afterwards."""
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    if threads is not None:
        torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old_det)
        torch.set_num_threads(old_threads)


def train(
    model: Decoder,
    data: torch.Tensor,
    *,
    steps: int,
    batch_size: int = 16,
    seq_len: int | None = None,
    lr: float = 3e-3,
    weight_decay: float = 0.01,
    seed: int = 0,
    eval_every: int | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> TrainResult:
    """Next-token training with AdamW, linear warm-up and cosine decay; runs exactly ``steps`` steps.

    ``data`` is a 1-D int64 tensor of token ids; the last 5 % is held out (:func:`held_out_loss` at the
    end, and every ``eval_every`` steps when given). Batches are ``batch_size`` windows of ``seq_len``
    tokens (default: the model's context, so every position embedding is trained) drawn from a
    generator seeded with ``seed``. ``progress(step, loss)`` is called after every step.
    Deterministic for a given seed, machine, torch version and thread count.
    """
    steps = check_positive_int("steps", steps)
    seq_len = model.config.context if seq_len is None else seq_len
    split = int(data.numel() * (1 - HELD_OUT))
    train_ids, val_ids = data[:split], data[split:]
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    warm = max(1, steps // 20)

    def lr_at(s: int) -> float:
        if s < warm:
            return lr * (s + 1) / warm
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))

    model.train()
    losses: list[float] = []
    history: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    for s in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        x, y = _batches(train_ids, batch_size, seq_len, gen)
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if eval_every and (s + 1) % eval_every == 0 and s + 1 < steps:
            history.append((s + 1, held_out_loss(model, val_ids)))
        if progress is not None:
            progress(s + 1, losses[-1])
    val = held_out_loss(model, val_ids)
    history.append((steps, val))
    seconds = time.perf_counter() - t0
    model.eval()
    tail = losses[-max(1, steps // 20) :]
    return TrainResult(steps, seconds, sum(tail) / len(tail), val, losses, history)


def train_recipe(
    path: str | Path,
    recipe: Recipe = RECIPE,
    *,
    command: str = "",
    progress: Callable[[int, float], None] | None = None,
) -> tuple[Decoder, CharTokenizer, dict]:
    """Train a decoder with ``recipe`` on :func:`training_text` and save it to ``path`` (+ ``.json``).

    Runs on ``recipe.threads`` torch threads with deterministic algorithms. Returns ``(model,
    tokenizer, info)``; ``info`` — the recipe, the command that ran it, train and held-out losses (the
    latter every ``eval_every`` steps), wall seconds, torch/Python versions and the machine — is also
    stored in the checkpoint's JSON.
    """
    text = training_text()
    tokenizer = CharTokenizer.from_text(text)
    data = torch.tensor(tokenizer.encode(text), dtype=torch.int64)
    with _reproducible(recipe.threads):
        torch.manual_seed(recipe.seed)  # the initial weights
        model = Decoder(recipe.config(tokenizer.vocab_size))
        result = train(
            model,
            data,
            steps=recipe.steps,
            batch_size=recipe.batch_size,
            lr=recipe.lr,
            weight_decay=recipe.weight_decay,
            seed=recipe.seed,
            eval_every=recipe.eval_every,
            progress=progress,
        )
    every = max(1, recipe.steps // 20)
    info = {
        "command": command,
        "text": "pydoc_data.topics (CPython documentation prose), last 5 % held out",
        "characters": len(text),
        "recipe": asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": result.steps,
        "train_loss": round(result.train_loss, 4),
        "held_out_loss": round(result.val_loss, 4),
        "loss_unit": "nats per character",
        "held_out_history": [[s, round(v, 4)] for s, v in result.val_history],
        "train_loss_curve": {
            "every": every,
            "losses": [round(x, 4) for x in result.losses[every - 1 :: every]],
        },
        "seconds": round(result.seconds, 1),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "machine": f"{platform.machine()}, {platform.system()}",
    }
    save_checkpoint(model, tokenizer, path, info)
    return model, tokenizer, info


def recipe_with(**changes: int | float) -> Recipe:
    """:data:`RECIPE` with some fields changed (``steps=…``, ``seed=…``); ``ValueError`` for unknown names."""
    unknown = sorted(set(changes) - set(asdict(RECIPE)))
    if unknown:
        raise ValueError(f"unknown recipe field(s): {', '.join(unknown)}")
    return replace(RECIPE, **changes)
