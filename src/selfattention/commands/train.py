"""``selfattention train``: train the small character-level decoder by step count and save it."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

from ..decoder.training import RECIPE
from ..i18n import N_, _, ngettext
from . import UsageError, console
from ._notes import output_folder


def _command_line(argv: list[str]) -> str:
    """The command as a person would retype it (recorded in the checkpoint's JSON)."""
    return shlex.join(["selfattention", *argv])


_HELP = N_(
    "Train the small decoder on the prose every Python ships, deterministically, and save it.\n\n"
    "The defaults are the recipe of the checkpoint that ships in the package; its .json records the "
    "command, steps, seed, losses and wall time. A run takes minutes (several thousand steps)."
)


def train_cmd(
    checkpoint: Path = typer.Option(
        None,
        "--checkpoint",
        help=N_(
            "Where to save (.safetensors; a .json goes next to it). "
            "Default: ~/.cache/selfattention/decoder.safetensors (the shipped model is never overwritten "
            "unless named here)."
        ),
    ),
    steps: int = typer.Option(
        RECIPE.steps,
        "--steps",
        min=1,
        help=N_("Training steps, each a batch of {batch} × {context} characters."),
    ),
    seed: int = typer.Option(
        RECIPE.seed, "--seed", help=N_("Seed of the initial weights and of the batches.")
    ),
    threads: int = typer.Option(
        RECIPE.threads,
        "--threads",
        min=1,
        help=N_("torch threads while training (part of what makes a run)."),
    ),
) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..decoder import default_checkpoint, recipe_with, train_recipe

    path = Path(checkpoint) if checkpoint is not None else default_checkpoint()
    if path.suffix != ".safetensors":
        raise UsageError(_("--checkpoint must name a .safetensors file, got {path}").format(path=path))
    output_folder("--checkpoint", path.parent if str(path.parent) else Path("."))  # before the training
    recipe = recipe_with(steps=steps, seed=seed, threads=threads)
    console.print(
        ngettext(
            "[bold]training[/bold] a small causal decoder on CPython's pydoc_data.topics: {steps} step, "
            "seed {seed}, {threads} thread(s) → {path}",
            "[bold]training[/bold] a small causal decoder on CPython's pydoc_data.topics: {steps} steps, "
            "seed {seed}, {threads} thread(s) → {path}",
            recipe.steps,
        ).format(steps=recipe.steps, seed=recipe.seed, threads=recipe.threads, path=path),
        highlight=False,
    )
    argv = sys.argv[1:] if sys.argv and Path(sys.argv[0]).name == "selfattention" else ["train"]
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(_("loss") + " {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task(_("training"), total=recipe.steps, loss=float("nan"))
        _model, _tok, info = train_recipe(
            path,
            recipe,
            command=_command_line(argv),
            progress=lambda s, loss: bar.update(task, completed=s, loss=loss),
        )
    console.print(
        ngettext(
            "trained {steps} step in {seconds} s: train loss {train:.3f}, held-out loss {held:.3f} "
            "nats/character; saved {path} and {json}",
            "trained {steps} steps in {seconds} s: train loss {train:.3f}, held-out loss {held:.3f} "
            "nats/character; saved {path} and {json}",
            info["steps"],
        ).format(
            steps=info["steps"],
            seconds=info["seconds"],
            train=info["train_loss"],
            held=info["held_out_loss"],
            path=path,
            json=path.with_suffix(".json"),
        ),
        highlight=False,
    )


train_cmd.help_values = {"batch": RECIPE.batch_size, "context": RECIPE.context}  # type: ignore[attr-defined]


def register(app: typer.Typer) -> None:
    app.command("train", help=_HELP)(train_cmd)
