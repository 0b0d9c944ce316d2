"""CLI commands. Each submodule defines ``register(app)``; see :mod:`selfattention.cli`."""

from __future__ import annotations

from rich.console import Console

__all__ = ["UsageError", "console", "err_console"]

console = Console()
err_console = Console(stderr=True)


class UsageError(Exception):
    """A mistake the user can fix; the CLI prints the message and exits with code 2."""
