"""The pieces every lesson shares: metadata, the result, the verdict, tables, figures, progress.

A lesson turns one claim (or exercise) of the lectures into numbers computed with this library's own
functions. Its verdict is computed from those numbers by a *pure* function, so tests can feed it
measurements under which the claim must fail.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "HOLDS",
    "FAILS",
    "ONLY_WHEN",
    "KINDS",
    "Verdict",
    "Lesson",
    "LessonResult",
    "ResultTable",
    "save_figure",
    "new_figure",
    "progress_steps",
    "timed",
]

HOLDS = "holds"
FAILS = "does not hold"
ONLY_WHEN = "holds only when"
STATUSES = (HOLDS, FAILS, ONLY_WHEN)

#: measured: the lesson measures the claim; exercise: one of lecture 003's 思考题; discussed: no honest
#: measurement exists (``reason`` says why); checker: a worked example, checked by ``selfattention check``.
KINDS = ("measured", "exercise", "discussed", "checker")

#: Longest ``Lesson.summary``: the one-line ``lesson list`` fits 80 columns with it.
SUMMARY_MAX = 33


@dataclass(frozen=True)
class Verdict:
    """A computed verdict: ``status`` is one of "holds", "does not hold", "holds only when".

    ``condition`` completes "holds only when …"; ``because`` gives the deciding numbers.

    >>> str(Verdict(ONLY_WHEN, "x = 1 in 3/3 cases", condition="the norms are equal"))
    'holds only when the norms are equal (x = 1 in 3/3 cases)'
    """

    status: str
    because: str
    condition: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if (self.status == ONLY_WHEN) != bool(self.condition):
            raise ValueError("a condition is given exactly when the status is 'holds only when'")

    @property
    def short(self) -> str:
        """The status with its condition, without the numbers."""
        return f"{self.status} {self.condition}" if self.condition else self.status

    def __str__(self) -> str:
        return f"{self.short} ({self.because})"


@dataclass
class ResultTable:
    """A small table of measurements: ``rows`` are lists of cells (numbers or strings)."""

    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)


@dataclass
class LessonResult:
    """What a lesson run produced: the deciding numbers, tables, the computed verdict, figure paths."""

    lesson: Lesson
    measurements: dict[str, Any]
    verdict: Verdict
    tables: list[ResultTable] = field(default_factory=list)
    figures: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class Lesson:
    """One claim or exercise of the lectures.

    Attributes:
        name: kebab-case name used on the command line.
        lecture: "000" (简化自注意力) or "003" (自注意力 Q/K/V).
        section: where in the lecture the claim is made.
        claim_zh: the claim as the lecture words it (quoted, Chinese).
        claim_en: the claim paraphrased in English.
        kind: one of :data:`KINDS`.
        module: dotted module (inside this package) whose ``run`` measures it; None when not runnable.
        reason: for "discussed"/"checker": why there is no measurement here, or where it is checked.
        needs_model: whether ``run`` loads all-MiniLM-L6-v2.
        budget: rough run time on 2 CPU cores, for ``lesson list`` ("seconds" or a short "2 min").
        summary: a few words for the one-line ``lesson list`` (at most :data:`SUMMARY_MAX` characters).
    """

    name: str
    lecture: str
    section: str
    claim_zh: str
    claim_en: str
    kind: str
    module: str | None = None
    reason: str = ""
    needs_model: bool = False
    budget: str = "seconds"
    summary: str = ""

    def __post_init__(self) -> None:
        if not 0 < len(self.summary) <= SUMMARY_MAX:
            raise ValueError(f"lesson {self.name}: summary must have 1 to {SUMMARY_MAX} characters")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if (self.module is None) != (self.kind in ("discussed", "checker")):
            raise ValueError(f"lesson {self.name}: runnable exactly when measured or exercise")

    @property
    def runnable(self) -> bool:
        return self.module is not None

    @property
    def status(self) -> str:
        """Short status for lists: ``run``, ``run, model``, ``run, 2 min``, ``checker`` or ``discussed``."""
        if not self.runnable:
            return self.kind
        extras = (["model"] if self.needs_model else []) + ([self.budget] if self.budget != "seconds" else [])
        return ", ".join(["run", *extras])

    def runner(self) -> Callable[..., LessonResult]:
        """The lesson module's ``run`` function (imported on demand)."""
        if self.module is None:
            raise ValueError(f"lesson {self.name!r} is {self.kind}, not runnable: {self.reason}")
        return importlib.import_module(f"selfattention.lessons.{self.module}").run


def new_figure(width: float = 6.4, height: float = 4.0, ncols: int = 1, nrows: int = 1):
    """A matplotlib ``Figure`` (object API, Agg canvas, never shown, Chinese glyphs drawn with a CJK font
    when one is installed: :func:`selfattention.fonts.new_figure`) and its axes."""
    from ..fonts import new_figure as cjk_figure

    fig = cjk_figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, (axes[0, 0] if nrows == ncols == 1 else axes.ravel())


def save_figure(fig: Any, out_dir: Path, name: str) -> Path:
    """Save ``fig`` as ``out_dir/name.png`` (creating the folder) and return the path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    return path


@contextmanager
def progress_steps(progress: Any, description: str, total: int) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n=1)``; with a rich ``Progress`` it drives a task bar, otherwise does nothing."""
    if progress is None:
        yield lambda n=1: None
        return
    task = progress.add_task(description, total=total)
    try:
        yield lambda n=1: progress.advance(task, n)
    finally:
        progress.update(task, completed=total, visible=False)


@contextmanager
def timed() -> Iterator[dict[str, float]]:
    """``with timed() as t: ...`` then ``t["seconds"]``: wall-clock seconds of the block."""
    box = {"seconds": 0.0}
    start = time.perf_counter()
    try:
        yield box
    finally:
        box["seconds"] = time.perf_counter() - start


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block on ``n`` torch threads (None: unchanged), restoring the setting afterwards.

    Lessons that time or train small tensors use 1 thread: on a shared 2-core machine, multi-threaded
    small ops mostly measure thread scheduling.
    """
    import torch

    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
