"""Attention traces: one call's named steps, captured on request, printable as the lectures' tables.

Nothing is recorded unless a :func:`capture` block is active, so the fast paths pay one context-variable
lookup per call. Inside the block every attention call (functional, module or transformers backend)
appends one :class:`AttentionTrace` with the steps of lecture 003 §3, in order:

    inputs → query, key, value → scores (Q Kᵀ) → scaled_scores (· 1/√d_k) → masked_scores → weights
    (softmax) → context (weights · V)

>>> from selfattention import SelfAttention
>>> _ = torch.manual_seed(0)
>>> with capture() as traces:
...     _ = SelfAttention(4, 2)(torch.randn(3, 4))
>>> [name for name in traces[0].step_names()][:4]
['inputs', 'query', 'key', 'value']
>>> traces[0]["weights"].sum(-1)
tensor([1.0000, 1.0000, 1.0000])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import _hooks
from .functional import AttentionSteps

__all__ = ["AttentionTrace", "capture", "matrix_table", "STEP_NAMES"]

STEP_NAMES = (
    "inputs",
    "query",
    "key",
    "value",
    "scores",
    "scaled_scores",
    "masked_scores",
    "weights",
    "context",
)

_TITLES = {
    "inputs": "inputs X (one row per token)",
    "query": "query Q = X·W_q",
    "key": "key K = X·W_k",
    "value": "value V = X·W_v",
    "scores": "attention scores ω = Q Kᵀ",
    "scaled_scores": "scaled scores ω · scale",
    "masked_scores": "masked scores (hidden keys = -inf)",
    "weights": "attention weights α = softmax(scores) (rows sum to 1)",
    "context": "context vectors z = α · V",
}


@dataclass
class AttentionTrace:
    """The named steps of one attention call.

    ``trace["weights"]`` etc. give the full tensors (batch and head dims included); :meth:`tables`
    renders one batch item and head as rich tables. ``labels`` name the tokens (rows/columns).
    """

    steps: AttentionSteps
    inputs: torch.Tensor | None = None
    labels: list[str] | None = None
    key_labels: list[str] | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    def step_names(self) -> list[str]:
        """Names of the steps present, in computation order."""
        names = [n for n in STEP_NAMES if n != "inputs" or self.inputs is not None]
        return names + list(self.extra)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == "inputs":
            if self.inputs is None:
                raise KeyError("this trace has no inputs (the call was made on query/key/value directly)")
            return self.inputs.detach()
        if name in self.extra:
            return self.extra[name]
        if name not in STEP_NAMES:
            raise KeyError(f"unknown step {name!r}; steps are {self.step_names()}")
        value = getattr(self.steps, name)
        return value.detach() if isinstance(value, torch.Tensor) else value

    def select(self, name: str, index: Sequence[int] = ()) -> torch.Tensor:
        """Step ``name`` reduced to a 2-D matrix: ``index`` picks the leading (batch, head) dims; any
        leading dims left over default to index 0."""
        t = self[name].detach()
        for i in index:
            if t.dim() <= 2:
                break
            t = t[i]
        while t.dim() > 2:
            t = t[0]
        return t

    def tables(
        self, index: Sequence[int] = (), decimals: int = 4, names: Sequence[str] | None = None
    ) -> list[Table]:
        """Rich tables of the chosen steps (default: all) for batch/head ``index``."""
        out = []
        for name in names or self.step_names():
            m = self.select(name, index)
            rows = self.labels if name not in ("key", "value") else (self.key_labels or self.labels)
            cols = None
            if name in ("scores", "scaled_scores", "masked_scores", "weights"):
                cols = self.key_labels or self.labels
            out.append(
                matrix_table(
                    m, title=_TITLES.get(name, name), row_labels=rows, col_labels=cols, decimals=decimals
                )
            )
        return out

    def print(
        self,
        console: Console | None = None,
        index: Sequence[int] = (),
        decimals: int = 4,
        names: Sequence[str] | None = None,
    ) -> None:
        """Print :meth:`tables` to ``console`` (a new rich Console by default)."""
        console = console or Console()
        for t in self.tables(index, decimals, names):
            console.print(t)


def matrix_table(
    m: torch.Tensor,
    title: str = "",
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    decimals: int = 4,
) -> Table:
    """A 2-D tensor as a rich Table with optional row/column labels."""
    if m.dim() == 1:
        m = m[None, :]
    table = Table(
        title=escape(title), title_justify="left", show_header=True, box=box.SIMPLE_HEAD, padding=(0, 1)
    )
    table.add_column("", style="bold")
    n_cols = m.shape[-1]
    for j in range(n_cols):
        table.add_column(
            str(col_labels[j]) if col_labels and j < len(col_labels) else f"[{j}]", justify="right"
        )
    for i, row in enumerate(m.tolist()):
        label = escape(str(row_labels[i])) if row_labels and i < len(row_labels) else f"\\[{i}]"
        table.add_row(label, *(_fmt(v, decimals) for v in row))
    return table


def _fmt(v: float | bool, decimals: int) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if v == float("-inf"):
        return "-inf"
    return f"{v:.{decimals}f}"


@contextmanager
def capture(labels: list[str] | None = None) -> Iterator[list[AttentionTrace]]:
    """Record every attention call made inside the block that computes its steps.

    Yields a list that fills with one :class:`AttentionTrace` per call, in call order: the reference
    path (:func:`~selfattention.functional.attention_steps`), the modules (which take the reference path
    while a capture is active, and attach their input ``x`` as ``inputs``) and the transformers backend
    :mod:`selfattention.hf`. ``labels`` (token strings) are attached to every trace.
    """
    raw: list[tuple[AttentionSteps, torch.Tensor | None]] = []
    traces: list[AttentionTrace] = []
    token = _hooks.push(raw)
    try:
        yield traces
    finally:
        _hooks.pop(token)
        for steps, inputs in raw:
            traces.append(AttentionTrace(steps=steps, inputs=inputs, labels=labels))
