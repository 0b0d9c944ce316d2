"""``selfattention train``: train the small character-level decoder and save it (safetensors + JSON)."""

from __future__ import annotations

from pathlib import Path

import typer

from ..decoder import TRAIN_BATCH, TRAIN_MAX_SECONDS, TRAIN_STEPS
from . import console


def train_with_progress(path: Path, steps: int, max_seconds: float | None):
    """Train the default decoder with a rich progress bar and save it to ``path``; returns
    ``(model, tokenizer, info)``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..decoder import train_default

    console.print(
        f"[bold]training[/bold] a small causal decoder on CPython's pydoc_data.topics ({steps} steps, "
        f"at most {max_seconds:.0f} s) → {path}"
        if max_seconds
        else f"[bold]training[/bold] a small causal decoder on CPython's pydoc_data.topics ({steps} steps) → {path}"
    )
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("training", total=steps, loss=float("nan"))
        model, tok, info = train_default(
            path,
            steps=steps,
            max_seconds=max_seconds,
            progress=lambda s, loss: bar.update(task, completed=s, loss=loss),
        )
    console.print(
        f"trained {info['steps']} steps in {info['seconds']} s: train loss {info['train_loss']:.3f}, "
        f"held-out loss {info['val_loss']:.3f} (nats/character); saved {path} and {path.with_suffix('.json')}"
    )
    if info["steps"] < info["steps_planned"]:
        console.print(
            f"[yellow]stopped early after {info['steps']} of {info['steps_planned']} steps (time cap; is the machine "
            "busy?): the model is undertrained. Retrain with `selfattention train --max-seconds 0`.[/yellow]"
        )
    return model, tok, info


def train(
    checkpoint: Path = typer.Option(
        None,
        "--checkpoint",
        help="Where to save (.safetensors; a .json config goes next to it). "
        "Default: ~/.cache/selfattention/decoder.safetensors",
    ),
    steps: int = typer.Option(
        TRAIN_STEPS, "--steps", min=1, help=f"Training steps (batches of {TRAIN_BATCH} × 256 characters)."
    ),
    max_seconds: float = typer.Option(
        TRAIN_MAX_SECONDS, "--max-seconds", help="Stop early after this long (0 = no cap)."
    ),
) -> None:
    """Train the small decoder (token + position embeddings, MultiHeadAttention blocks) on text every
    Python ships, deterministically (seed 0), and save it with safetensors."""
    from ..decoder import default_checkpoint

    path = Path(checkpoint) if checkpoint is not None else default_checkpoint()
    train_with_progress(path, steps, max_seconds or None)


def register(app: typer.Typer) -> None:
    app.command("train")(train)
