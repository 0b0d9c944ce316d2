"""Opt-in capture of attention steps (used by :mod:`selfattention.trace`). Costs one lookup per call."""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

_recorders: ContextVar[tuple[list[Any], ...]] = ContextVar("selfattention_recorders", default=())


def record(item: Any) -> None:
    """Append ``item`` to every active recorder (no-op when none is active)."""
    for rec in _recorders.get():
        rec.append(item)


def push(rec: list[Any]) -> Any:
    return _recorders.set((*_recorders.get(), rec))


def pop(token: Any) -> None:
    _recorders.reset(token)
