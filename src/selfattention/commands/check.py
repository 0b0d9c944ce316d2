"""``selfattention check FILE.toml``: recompute a worked example and judge every printed number."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from ..worked import load_example
from . import UsageError, console
from .demo import show_example


def check(
    files: list[Path] = typer.Argument(
        ..., help="Worked-example TOML files (or shipped names: journey, two-token)."
    ),
    strict: bool = typer.Option(False, "--strict", help="Exit with code 1 if any printed number is wrong."),
    decimals: int = typer.Option(4, help="Decimals shown in the step tables."),
) -> None:
    """Recompute each printed number of a worked example: ok / within rounding / wrong.

    The file format: docs/worked-examples.md."""
    if not 0 <= decimals <= 12:
        raise UsageError(f"--decimals must be between 0 and 12, got {decimals}")
    total_wrong = 0
    for f in files:
        example = load_example(f)
        wrong = show_example(example, decimals)
        total_wrong += wrong
        n = len(example.printed)
        status = f"[red]{wrong} wrong[/red]" if wrong else "[green]no wrong numbers[/green]"
        console.print(f"{escape(str(f))}: {n} printed number{'' if n == 1 else 's'} checked, {status}")
    if strict and total_wrong:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("check")(check)
