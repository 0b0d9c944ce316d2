"""The ``selfattention`` command: a thin typer app. Commands live in :mod:`selfattention.commands`.

Each module in ``COMMAND_MODULES`` defines ``register(app: typer.Typer) -> None``. Errors the user can
fix (bad input, missing file, malformed TOML) are raised as :class:`selfattention.commands.UsageError`
(or ValueError/TypeError/OSError) and become one red line on stderr and exit code 2, no traceback.
"""

from __future__ import annotations

import importlib
import sys

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

for _name in COMMAND_MODULES:
    try:
        _module = importlib.import_module(f".commands.{_name}", __package__)
    except ModuleNotFoundError as _e:  # a command still being written; tests/test_cli.py checks all load
        if _e.name != f"{__package__}.commands.{_name}":
            raise
        continue
    _module.register(app)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``selfattention`` script; returns the exit code."""
    try:
        rc = app(args=argv, prog_name="selfattention", standalone_mode=False)
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
