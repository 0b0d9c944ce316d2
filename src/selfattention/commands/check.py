"""``selfattention check FILE.toml``: recompute a worked example and judge every printed number."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from ..i18n import N_, _, ngettext
from ..worked import load_example
from . import UsageError, console
from .demo import show_example

_HELP = N_(
    "Recompute each printed number of a worked example: ok / within rounding / wrong.\n\n"
    "The file format: docs/worked-examples.md."
)


def check(
    files: list[Path] = typer.Argument(
        ..., help=N_("Worked-example TOML files (or shipped names: journey, two-token).")
    ),
    strict: bool = typer.Option(
        False, "--strict", help=N_("Exit with code 1 if any printed number is wrong.")
    ),
    decimals: int = typer.Option(4, help=N_("Decimals shown in the step tables.")),
) -> None:
    if not 0 <= decimals <= 12:
        raise UsageError(_("--decimals must be between 0 and 12, got {value}").format(value=decimals))
    total_wrong = 0
    for f in files:
        example = load_example(f)
        wrong = show_example(example, decimals)
        total_wrong += wrong
        n = len(example.printed)
        status = (
            "[red]{}[/red]".format(escape(_("{wrong} wrong").format(wrong=wrong)))
            if wrong
            else "[green]{}[/green]".format(escape(_("no wrong numbers")))
        )
        checked = ngettext("{n} printed number checked", "{n} printed numbers checked", n).format(n=n)
        console.print(
            _("{file}: {checked}, {status}").format(
                file=escape(str(f)), checked=escape(checked), status=status
            )
        )
    if strict and total_wrong:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("check", help=_HELP)(check)
