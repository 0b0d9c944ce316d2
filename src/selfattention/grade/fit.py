"""Fitting mistakes to a learner's outputs: the machinery every task shares.

A task describes its computation as *axes* of choices, the first option of each being the spec and every
other option one known mistake (a mutation of the spec). The grader runs the learner's code and every
combination of options on the same probes and reports the combination that reproduces the learner's
outputs on all probes, preferring the fewest mistakes (the simplest explanation). Probes are built so that
each mistake leaves a distinct signature (d_model ≠ d_k, Tq ≠ Tk, d_k ≠ d_v, a fully masked row, a fully
visible one), and the gallery tests that each known wrong implementation is diagnosed exactly.

A probe whose computation *fails* (a shape error, e.g. K Qᵀ with Tq ≠ Tk) matches a learner whose code
raises on that probe: the mutation explains the exception.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..i18n import _

__all__ = [
    "Axis",
    "NotGradable",
    "Outcome",
    "Probe",
    "Raised",
    "TIME_LIMIT",
    "Task",
    "TimeLimitExceeded",
    "as_outputs",
    "codes",
    "last_line_of",
    "first_output",
    "quiet",
    "required_count",
    "fit",
    "guarded",
    "matches",
    "max_error",
    "positional_count",
    "run_safely",
    "time_limit",
]

#: Outputs are compared in float64 with these tolerances (the learner computes in float32).
RTOL = 1e-4
ATOL = 1e-4


@dataclass(frozen=True)
class Axis:
    """One choice in a computation: ``options[0]`` is the spec, each other option maps to a mistake code.

    ``options`` is a sequence of ``(option name, mistake code or None)``; several options may share one code
    (variants of one mistake, e.g. three ways of getting the cache index wrong).
    """

    name: str
    options: tuple[tuple[str, str | None], ...]

    @property
    def default(self) -> str:
        return self.options[0][0]

    def code(self, option: str) -> str | None:
        return dict(self.options)[option]


@dataclass
class Probe:
    """One input the learner's code is run on: ``name`` (English message id, shown translated), the
    positional ``args``/keyword ``kwargs`` of the call, and ``info`` (sizes the references need)."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Raised:
    """An exception raised by the learner's code (or by a mutation that cannot run on a probe)."""

    kind: str
    last_line: str


Outcome = tuple[torch.Tensor, ...] | Raised
"""What one run produced: a tuple of float64 tensors, or the exception it raised."""


def as_outputs(value: Any) -> tuple[torch.Tensor, ...]:
    """A result as a tuple of float64 CPU tensors (numpy arrays, lists and bools accepted)."""
    items = value if isinstance(value, tuple) else (value,)
    out = []
    for item in items:
        if not isinstance(item, torch.Tensor):
            item = torch.as_tensor(item)
        item = item.detach().cpu()
        out.append(item.to(torch.float64) if item.dtype != torch.bool else item)
    return tuple(out)


def positional_count(fn: Any) -> int | None:
    """How many positional parameters ``fn`` accepts (None: any number, or not inspectable)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def required_count(fn: Any) -> int:
    """How many positional parameters ``fn`` requires (no default); 0 when not inspectable."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 0
    return sum(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params
    )


MUTATED: list[str] = []
"""Names of the arguments the learner's code changed in place since :func:`grade` last cleared it."""


def call_watched(fn: Callable[..., Any], args: tuple[Any, ...], names: tuple[str, ...]) -> Any:
    """``fn(*args)``, noting in :data:`MUTATED` the name of every tensor argument the call changed in place:
    torch's version counter moved (``div_``, ``x /= …``, ``x[...] = …``) or its values differ from a copy
    taken before the call (``x.data.div_``, ``x.numpy()[...] /= …`` bypass the counter)."""
    versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
    copies = [a.detach().clone() if isinstance(a, torch.Tensor) else None for a in args]
    try:
        return fn(*args)
    finally:
        for name, a, before, copy in zip(names, args, versions, copies, strict=False):
            if before is None or name in MUTATED:
                continue
            if a._version != before or not _same(a.detach(), copy):
                MUTATED.append(name)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit the same values, NaN where NaN (``torch.equal`` sees NaN ≠ NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))
    return torch.equal(a, b)


def first_output(result: Any) -> Any:
    """A learner's result: its first element when it returns (output, weights, …); a nested list of numbers
    (``out.tolist()``, or a loop's list of 0-d tensors) is the output itself."""
    if isinstance(result, tuple | list) and result and not _scalar(result[0]):
        if isinstance(result, list) and _numeric_rows(result):
            return result
        return result[0]
    return result


def _scalar(x: object) -> bool:
    """A number (not a bool), or a 0-d tensor / numpy scalar (what a loop over tensor entries sums to)."""
    if isinstance(x, bool):
        return False
    return isinstance(x, int | float) or getattr(x, "ndim", None) == 0


def _numeric_rows(rows: list) -> bool:
    """Whether ``rows`` is a nested list of numbers (every row a non-empty list of numbers or of such lists)."""
    return all(isinstance(r, list) and r and (all(map(_scalar, r)) or _numeric_rows(r)) for r in rows)


def last_line_of(e: BaseException) -> str:
    """The last line of the traceback of ``e``: ``ValueError: ...``."""
    lines = traceback.format_exception_only(type(e), e)
    return lines[-1].strip() if lines else type(e).__name__


class HardExit(SystemExit):
    """``os._exit`` called by the learner's code: a finding, not the end of the grader (the real one would
    end the process with no report, and exit code 0 reads as success to an autograder)."""


def _hard_exit(code: int = 0) -> None:
    raise HardExit(f"os._exit({code}) called")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Run learner code with its prints sent to stderr (stdout may carry a JSON report), warnings off and
    ``os._exit`` raising :class:`HardExit` instead of ending the process."""
    real_exit = os._exit
    os._exit = _hard_exit  # type: ignore[assignment]
    try:
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        os._exit = real_exit


#: seconds one call of the learner's code may take (where a timer can interrupt it: the main thread of a
#: POSIX process); None: no limit
TIME_LIMIT: float | None = 20.0


class TimeLimitExceeded(Exception):
    """The learner's code ran longer than :data:`TIME_LIMIT` seconds on one call."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Interrupt the block with :class:`TimeLimitExceeded` after ``seconds`` (a no-op where no interval
    timer can be armed: another thread, Windows, ``seconds`` None)."""
    if (
        seconds is None
        or not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def _expired(_signum: int, _frame: Any) -> None:
        raise TimeLimitExceeded(_("the code ran longer than {seconds:g} s").format(seconds=seconds))

    previous = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_safely(fn: Callable[[], Any]) -> Outcome:
    """``fn()`` as outputs, or the :class:`Raised` it raised (an endless loop: after :data:`TIME_LIMIT`
    seconds, where a timer can interrupt it); never raises (but for KeyboardInterrupt). A ``sys.exit`` in
    the learner's code is a finding too (``SystemExit``), not the end of the grader."""
    try:
        with quiet(), torch.no_grad(), time_limit(TIME_LIMIT):
            return as_outputs(fn())
    except KeyboardInterrupt:
        raise
    except (
        BaseException
    ) as e:  # the learner's exceptions (sys.exit, os._exit too) are findings, never crashes
        return Raised(type(e).__name__, last_line_of(e))


SHAPE_ERRORS = frozenset({"RuntimeError", "ValueError", "IndexError"})
"""What torch (RuntimeError), numpy (ValueError) and indexing raise for operands of the wrong shapes: the
kinds a mutation that cannot run on a probe is matched against."""


def matches(a: Outcome, b: Outcome, tolerance: float = RTOL) -> bool:
    """Whether two outcomes agree: both raised a shape error (:data:`SHAPE_ERRORS`; a NameError or a
    TypeError is explained by no mutation), or same shapes and values within ``tolerance`` (relative and
    absolute; NaN where NaN, ±inf alike)."""
    if isinstance(a, Raised) or isinstance(b, Raised):
        return isinstance(a, Raised) and isinstance(b, Raised) and {a.kind, b.kind} <= SHAPE_ERRORS
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            return False
        if x.dtype == torch.bool or y.dtype == torch.bool:
            if not torch.equal(x.to(torch.bool), y.to(torch.bool)):
                return False
        elif not torch.allclose(x, y, rtol=tolerance, atol=tolerance * ATOL / RTOL, equal_nan=True):
            return False
    return True


def max_error(a: Outcome, b: Outcome) -> float | None:
    """Largest |a − b| over comparable outputs (None when shapes differ or either raised)."""
    if isinstance(a, Raised) or isinstance(b, Raised) or len(a) != len(b):
        return None
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            return None
        d = (x.to(torch.float64) - y.to(torch.float64)).abs()
        d = torch.where(torch.isnan(x.double()) & torch.isnan(y.double()), 0.0, d)
        worst = max(worst, float(d.nan_to_num(nan=float("inf")).max()) if d.numel() else 0.0)
    return worst


def configs(axes: Sequence[Axis], max_mistakes: int) -> Iterator[dict[str, str]]:
    """Every combination of options, fewest mistakes first (0, 1, 2, …), each level in axis order."""
    for level in range(max_mistakes + 1):
        for wrong in itertools.combinations(range(len(axes)), level):
            choices = [axes[i].options[1:] if i in wrong else axes[i].options[:1] for i in range(len(axes))]
            for combo in itertools.product(*choices):
                yield {axis.name: opt for axis, (opt, _code) in zip(axes, combo, strict=True)}


def fit(
    axes: Sequence[Axis],
    learner: Sequence[Outcome],
    reference: Callable[[dict[str, str], int], Outcome],
    max_mistakes: int = 3,
    tolerance: float = RTOL,
) -> dict[str, str] | None:
    """The simplest combination of options whose outputs match ``learner`` on every probe, or None.

    ``reference(config, i)`` computes probe ``i`` under ``config`` (an outcome; exceptions count as
    :class:`Raised`). Probes are checked in order and a combination is dropped at its first mismatch.
    A learner whose code raised on every probe is explained by nothing (None): exceptions alone do not
    tell one shape mistake from another. ``tolerance``: see :func:`matches`.
    """
    if all(isinstance(o, Raised) for o in learner):
        return None
    for config in configs(axes, max_mistakes):
        if all(matches(learner[i], guarded(reference, config, i), tolerance) for i in range(len(learner))):
            return config
    return None


def guarded(reference: Callable[[dict[str, str], int], Outcome], config: dict[str, str], i: int) -> Outcome:
    """``reference(config, i)``, or the :class:`Raised` of a mutation that cannot run on probe ``i``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return reference(config, i)
    except (RuntimeError, IndexError, ValueError) as e:  # the mutation cannot run here: a shape error
        return Raised(type(e).__name__, last_line_of(e))


def codes(axes: Sequence[Axis], config: dict[str, str]) -> list[str]:
    """The mistake codes of ``config``, in axis order, each once."""
    found: list[str] = []
    for axis in axes:
        code = axis.code(config[axis.name])
        if code is not None and code not in found:
            found.append(code)
    return found


class NotGradable(Exception):
    """The learner's code has no shape the grader can drive (a missing W_q, a constructor it cannot call);
    the message says what is missing. Reported as the finding ``not_gradable``, never raised to the user."""


@dataclass(frozen=True)
class Task:
    """One of the lectures' tasks, as the grader drives it.

    Attributes:
        name: the ``--task`` name.
        signature: what the learner writes (shown in reports and docs).
        contract: the shapes and conventions (English message id, shown translated).
        lecture: "000" or "003".
        names: names in a learner's file that select this task (auto-detection), all required.
        axes: the computation's choices (spec first; see :class:`Axis`).
        probes: ``probes(subject)`` → the probes (deterministic).
        call: ``call(subject, probe)`` → the learner's result on ``probe`` (may raise).
        reference: ``reference(subject, config, probe)`` → the outputs under ``config`` (may raise).
        prepare: ``prepare(obj)`` → the subject the other callables get (may raise :class:`NotGradable`).
        max_mistakes: largest combination of mistakes searched.
    """

    name: str
    signature: str
    contract: str
    lecture: str
    names: tuple[str, ...]
    axes: tuple[Axis, ...]
    probes: Callable[[Any], list[Probe]]
    call: Callable[[Any, Probe], Any]
    reference: Callable[[Any, dict[str, str], Probe], Any]
    prepare: Callable[[Any], Any] = lambda obj: obj
    max_mistakes: int = 3

    @property
    def spec(self) -> dict[str, str]:
        """The configuration with every axis at its spec option."""
        return {axis.name: axis.default for axis in self.axes}
