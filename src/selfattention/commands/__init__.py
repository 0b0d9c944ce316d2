"""CLI commands. Each submodule defines ``register(app)``; see :mod:`selfattention.cli`."""

from __future__ import annotations

from rich.console import Console

from ._wrap import install as _install_cjk_wrap

__all__ = ["UsageError", "console", "err_console"]

_install_cjk_wrap()  # Chinese lines break between characters, never cut with "…"
console = Console()
err_console = Console(stderr=True)


class UsageError(Exception):
    """A mistake the user can fix; the CLI prints the message and exits with code 2."""
