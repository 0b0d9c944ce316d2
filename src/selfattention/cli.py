"""The ``selfattention`` command: a thin typer app. Commands live in :mod:`selfattention.commands`.

Each module in ``COMMAND_MODULES`` defines ``register(app: typer.Typer) -> None``. Errors the user can
fix (bad input, missing file, malformed TOML) are raised as :class:`selfattention.commands.UsageError`
(or ValueError/TypeError/OSError) and become one red line on stderr and exit code 2, no traceback.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

import typer
from rich.markup import escape

from .commands import UsageError, err_console

COMMAND_MODULES = [
    "demo",
    "check",
    "explain",
    "report",
    "generate",
    "train",
    "lesson",
    "bench",
    "fuzz",
    "ring",
]

app = typer.Typer(
    name="selfattention",
    help="Self-attention as the lectures describe it: replay, explain, check, measure.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from .commands import console

        console.print(f"selfattention {package_version()}", highlight=False)
        raise typer.Exit(0)


def package_version() -> str:
    """The installed distribution's version (``importlib.metadata``), else ``selfattention.__version__``.

    >>> package_version().count(".") >= 2
    True
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("selfattention")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from . import __version__

        return __version__


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", callback=_version, is_eager=True
    ),
) -> None:
    """Self-attention as the lectures describe it: replay, explain, check, measure."""


for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(f".commands.{_name}", __package__)
    except ModuleNotFoundError as _e:  # a command still being written; tests/test_cli.py checks all load
        if _e.name != f"{__package__}.commands.{_name}":
            raise
        continue
    _module.register(app)


def _unwrap(text: str | None) -> str | None:
    """A docstring's paragraphs as single lines (typer's rich help keeps the source's line breaks)."""
    if not text:
        return text
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(text).split("\n\n"))


def _tidy_help(command: Any) -> None:
    """Help that reads well at 80 columns, for a command and its subcommands.

    Flags take no value, so none is shown (typer would print ``--check <bool>``, ``--help <bool>``), and
    docstring paragraphs are re-flowed instead of breaking where the source lines break.
    """
    command.help = _unwrap(command.help)
    # the help option is made on demand and cached per command: make it now, with a bare context
    help_option = command.get_help_option(command.context_class(command))
    for param in [*command.params, *([help_option] if help_option is not None else [])]:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        _tidy_help(sub)


def command() -> Any:
    """The click command behind ``app`` with the help fixes applied (what :func:`main` runs)."""
    cmd = typer.main.get_command(app)
    _tidy_help(cmd)
    return cmd


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``selfattention`` script; returns the exit code."""
    try:
        rc = command().main(args=argv, prog_name="selfattention", standalone_mode=False)
    except typer.Exit as e:
        return e.exit_code
    except typer.Abort:
        err_console.print("[red]aborted[/red]")
        return 1
    except (UsageError, ValueError, TypeError, OSError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        err_console.print(f"[bold red]error:[/bold red] {escape(str(msg))}", highlight=False)
        return 2
    except Exception as e:  # click's own usage errors (bad option values, unknown options)
        # typer >= 0.2x vendors click as ``typer._click``: its exceptions are not ``click``'s, so match
        # on the ClickException interface (show() + exit_code) rather than on the class
        show, code = getattr(e, "show", None), getattr(e, "exit_code", None)
        if callable(show) and isinstance(code, int):
            show()
            return code
        raise
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
