"""Opt-in capture of attention steps (used by :mod:`selfattention.trace`). Costs one lookup per call.

An attention call records one event: ``(steps, inputs)``. A module announces the input ``x`` its
projections start from with :func:`inputs` around its attention call; the steps recorded inside that
block get it, and it is forgotten when the block ends (so it never reaches a later call's trace).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

_recorders: ContextVar[tuple[list[Any], ...]] = ContextVar("selfattention_recorders", default=())
_pending_inputs: ContextVar[Any] = ContextVar("selfattention_pending_inputs", default=None)


def capturing() -> bool:
    """True inside a :func:`selfattention.capture` block (never while torch.compile traces: a compiled
    graph records no steps, and the compiler cannot read a ContextVar)."""
    if torch.compiler.is_compiling():
        return False
    return bool(_recorders.get())


def record(item: Any) -> None:
    """Record ``item`` in every active recorder (no-op when none is active).

    ``{"inputs": x}`` announces the inputs of the next steps recorded in this context; anything else (an
    :class:`~selfattention.functional.AttentionSteps`) is recorded as the event ``(item, inputs)``.
    """
    recorders = _recorders.get()
    if not recorders:
        return
    if isinstance(item, dict) and "inputs" in item:
        _pending_inputs.set(item["inputs"])
        return
    inputs = _pending_inputs.get()
    if inputs is not None:
        _pending_inputs.set(None)
    for rec in recorders:
        rec.append((item, inputs))


@contextmanager
def inputs(x: Any) -> Iterator[None]:
    """The steps recorded inside this block were computed from ``x`` (forgotten when the block ends)."""
    if not _recorders.get():
        yield
        return
    token = _pending_inputs.set(x)
    try:
        yield
    finally:
        _pending_inputs.reset(token)


@contextmanager
def muted() -> Iterator[None]:
    """Record nothing inside this block (a caller that records corrected steps itself)."""
    token = _recorders.set(())
    try:
        yield
    finally:
        _recorders.reset(token)


def push(rec: list[Any]) -> Any:
    token = _recorders.set((*_recorders.get(), rec))
    _pending_inputs.set(None)
    return token


def pop(token: Any) -> None:
    _recorders.reset(token)
