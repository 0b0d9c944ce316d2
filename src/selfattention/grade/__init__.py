"""Grade a learner's own attention code: run probes against the spec and name each mistake.

A learner implements one of the lectures' tasks (:data:`TASKS`)::

    simple_attention(X)                               lecture 000: softmax(X Xᵀ) X
    scaled_dot_product_attention(q, k, v, mask=None)  lecture 003: softmax(Q Kᵀ/√d_k) V, mask True = attend
    causal_mask(q_len, k_len)                         bool (Tq, Tk), True = attend, bottom-right aligned
    class SelfAttention(nn.Module)                    (d_in, d_out) with W_query, W_key, W_value
    split_heads(x, num_heads), merge_heads(x)         (B, T, H·D) ↔ (B, H, T, D)
    decode_step(q, k, v, k_cache, v_cache, pos)       one cached decode step

and :func:`grade` runs it on probes built so that every known mistake (:data:`MISTAKES`: wrong softmax
axis, missing or wrong scale, transposed scores, mask polarity, NaN or uniform rows, top-left causal, W_v
forgotten, heads in the wrong order, cache off by one, …) leaves its own signature, fits combinations of
those mistakes to the learner's outputs and reports the simplest one that reproduces them all, each
mistake with the lecture passage that covers it (:mod:`.mistakes`). Running the learner's code executes
it: grade only code you trust. Their exceptions become findings (with the traceback's last line).

>>> import torch
>>> def simple_attention(X):
...     return torch.softmax(X @ X.T, dim=0) @ X        # softmax over the wrong axis
>>> report = grade(simple_attention)
>>> report.passed, report.codes
(False, ['softmax_axis'])
>>> grade(lambda X: torch.softmax(X @ X.T, dim=-1) @ X, task="simple_attention").passed
True

The package itself is callable, so ``import selfattention; selfattention.grade(fn)`` works too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from ..i18n import _
from .attention_tasks import DECODE, MODULE, SDPA, SIMPLE
from .fit import (
    MUTATED,
    RTOL,
    NotGradable,
    Raised,
    Task,
    as_outputs,
    codes,
    guarded,
    last_line_of,
    matches,
    max_error,
    run_safely,
)
from .fit import fit as fit_mistakes  # the name `fit` stays the module (selfattention.grade.fit.TIME_LIMIT)
from .layout_tasks import CAUSAL, HEADS
from .loader import FileSyntaxError, detect_tasks, load_file, tasks_in_source
from .mistakes import MISTAKES, Mistake, cited, passage
from .report import Finding, ProbeResult, Report

__all__ = [
    "MISTAKES",
    "TASKS",
    "FileSyntaxError",
    "Finding",
    "Mistake",
    "ProbeResult",
    "Report",
    "Task",
    "detect_tasks",
    "grade",
    "grade_file",
    "load_file",
]

TASKS: dict[str, Task] = {t.name: t for t in (SIMPLE, SDPA, CAUSAL, MODULE, HEADS, DECODE)}
"""The gradable tasks by name (the ``--task`` values)."""

#: other names accepted for ``task=`` / ``--task``
ALIASES = {
    "simple": "simple_attention",
    "sdpa": "scaled_dot_product_attention",
    "causal": "causal_mask",
    "self_attention": "SelfAttention",
    "self-attention": "SelfAttention",
    "module": "SelfAttention",
    "split_heads": "heads",
    "merge_heads": "heads",
    "decode": "decode_step",
    "cache": "decode_step",
}


def resolve_task(name: str) -> Task:
    """The task called ``name`` (or one of its aliases); ValueError naming the choices otherwise."""
    key = ALIASES.get(name, name)
    if key not in TASKS:
        raise ValueError(
            _("unknown task {name!r}; the tasks are {names}").format(name=name, names=", ".join(TASKS))
        )
    return TASKS[key]


def _finding(code: str, detail: str = "", lecture: str | None = None) -> Finding:
    """The finding ``code``, citing the passage of the graded task's ``lecture`` where it has one."""
    mistake = MISTAKES[code]
    message = _(mistake.message)
    if "{detail}" in message:
        message = message.format(detail=detail)
    number = cited(mistake, lecture)[0]
    return Finding(
        code, message, number, passage(mistake, lecture), detail, _(mistake.note) if mistake.note else ""
    )


def _detect(obj: Any) -> Task:
    """The task of ``obj``: a function or class by its name, or the one task a namespace/dict defines."""
    name = getattr(obj, "__name__", None)
    if isinstance(obj, tuple | list):
        return HEADS
    if name is not None and not isinstance(obj, ModuleType | dict):
        for task in TASKS.values():
            if name in task.names and len(task.names) == 1:
                return task
        import torch

        if isinstance(obj, type) and issubclass(obj, torch.nn.Module) or isinstance(obj, torch.nn.Module):
            return MODULE
        raise ValueError(
            _("cannot tell the task of {name!r}: pass task= (one of {names})").format(
                name=name, names=", ".join(TASKS)
            )
        )
    namespace = obj if isinstance(obj, dict) else vars(obj)
    found = detect_tasks(namespace)
    if len(found) != 1:
        raise ValueError(
            _("found {found} tasks ({names}): pass task= to choose one").format(
                found=len(found), names=", ".join(found) or "-"
            )
        )
    return TASKS[found[0]]


def _pick(task: Task, obj: Any) -> Any:
    """From a namespace (module or dict), the object the task drives."""
    if task is HEADS or not isinstance(obj, ModuleType | dict):
        return obj
    get = obj.get if isinstance(obj, dict) else lambda n: getattr(obj, n, None)
    found = get(task.names[0])
    if found is None:
        raise ValueError(
            _("no {name} defined for the task {task}").format(name=task.names[0], task=task.name)
        )
    return found


def grade(obj: Any, task: str | None = None, *, file: str | None = None) -> Report:
    """Grade a learner's implementation of one of the lectures' tasks; never raises on their mistakes.

    Args:
        obj: the learner's function (``simple_attention``, ``scaled_dot_product_attention``,
            ``causal_mask``, ``decode_step``), their ``SelfAttention`` class (or an instance with
            ``d_in``/``d_out``), a ``(split_heads, merge_heads)`` pair, or a namespace (module, dict) that
            defines them.
        task: one of :data:`TASKS` (or an alias: sdpa, simple, causal, module, decode); None: detected
            from the names.
        file: where the code came from, for the report.

    Returns:
        a :class:`Report`: ``passed``, ``findings`` (each mistake's code, message, lecture passage),
        ``probes``. Messages are in the interface language (:func:`selfattention.i18n.set_language`).

    Raises:
        ValueError: the task cannot be told (or is unknown), or the namespace lacks the task's function.

    Running the learner's code executes it: grade only code you trust. Their exceptions are findings.
    """
    chosen = resolve_task(task) if task is not None else _detect(obj)
    target = _pick(chosen, obj)
    report = Report(
        task=chosen.name,
        signature=chosen.signature,
        lecture=chosen.lecture,
        contract=_(chosen.contract),
        file=file,
    )
    try:
        subject = chosen.prepare(target)
    except NotGradable as e:
        report.findings.append(_finding("not_gradable", str(e), chosen.lecture))
        return report
    except Exception as e:  # the learner's object misbehaving while it is set up (a __deepcopy__ …)
        report.findings.append(_finding("exception", last_line_of(e), chosen.lecture))
        return report
    probes = chosen.probes(subject)
    MUTATED.clear()
    learner: list = []
    for p in probes:
        # an endless loop is cut after TIME_LIMIT once; the other probes would each wait as long again
        if learner and isinstance(learner[-1], Raised) and learner[-1].kind == "TimeLimitExceeded":
            learner.append(learner[-1])
            continue
        learner.append(run_safely(lambda p=p: chosen.call(subject, p)))
    if MUTATED:  # whatever else is right or wrong, the caller's tensors must not change
        report.findings.append(_finding("mutates_input", ", ".join(MUTATED), chosen.lecture))
    spec = chosen.spec

    def reference(config: dict[str, str], i: int) -> Any:
        return run_reference(chosen, subject, config, probes[i])

    expected = [guarded(reference, spec, i) for i in range(len(probes))]
    for probe, got, want in zip(probes, learner, expected, strict=True):
        report.probes.append(
            ProbeResult(
                name=_(probe.name).format(**probe.info) if probe.info else _(probe.name),
                matches_spec=matches(got, want),
                raised=got.last_line if isinstance(got, Raised) else None,
                max_error=max_error(got, want),
            )
        )
    if all(p.matches_spec for p in report.probes):
        return report
    half = half_precision(learner)
    config = fit_mistakes(
        chosen.axes, learner, reference, chosen.max_mistakes, HALF_PRECISION if half else RTOL
    )
    if config is None:
        report.findings += _unexplained(report.probes, learner, expected, chosen.lecture)
    else:
        report.findings += [_finding(code, lecture=chosen.lecture) for code in codes(chosen.axes, config)]
        report.notes += _raised_notes(report.probes)
    if half:  # the outputs are half precision numbers: beside the mistakes fitted at its tolerance, or alone
        report.findings.append(_finding("low_precision", half, chosen.lecture))
    return report


def _raised_notes(probes: list[ProbeResult]) -> list[str]:
    """The note that the probes where the code raised are what the fitted mistakes predict: one note for
    all of them (each probe's error is already on its own line)."""
    raised = [p for p in probes if p.raised]
    if len(raised) == 1:
        return [
            _("on the probe “{probe}” your code raised {error}, as these mistakes predict").format(
                probe=raised[0].name, error=raised[0].raised
            )
        ]
    if raised:
        return [
            _(
                "on {n} of the {total} probes your code raised (their errors are above), as these mistakes predict"
            ).format(n=len(raised), total=len(probes))
        ]
    return []


def run_reference(task: Task, subject: Any, config: dict[str, str], probe: Any) -> Any:
    """The outputs of ``task``'s computation under ``config`` on ``probe`` (float64 tensors)."""
    return as_outputs(task.reference(subject, config, probe))


def _unexplained(
    probes: list[ProbeResult], learner: list[Any], expected: list[Any], lecture: str
) -> list[Finding]:
    """Findings when no combination of known mistakes explains the outputs: exceptions, shapes, the rest."""
    found: list[Finding] = []
    for p, got, want in zip(probes, learner, expected, strict=True):
        if p.matches_spec:
            continue
        if isinstance(got, Raised):
            if "exception" not in [f.code for f in found]:
                found.append(_finding("exception", f"{got.last_line} ({p.name})", lecture))
        elif not isinstance(want, Raised) and [tuple(t.shape) for t in got] != [tuple(t.shape) for t in want]:
            if "wrong_shape" not in [f.code for f in found]:
                shapes = _("expected {want}, got {got} ({probe})").format(
                    want=_shapes(want), got=_shapes(got), probe=p.name
                )
                found.append(_finding("wrong_shape", shapes, lecture))
        elif "unrecognised" not in [f.code for f in found]:
            detail = _("largest difference {value:.3g} on the probe “{probe}”").format(
                value=p.max_error if p.max_error is not None else float("nan"), probe=p.name
            )
            found.append(_finding("unrecognised", detail, lecture))
    return found


HALF_PRECISION = 2e-2
"""The tolerance (relative and ×1 absolute) of the fit when the outputs are half precision numbers:
float16 keeps 11 significant bits (unit roundoff 4.9e-4), bfloat16 8 (3.9e-3); the spec computed in
bfloat16 is off by 3e-3 … 6e-3 on the probes, in float16 by 4e-4 … 1.1e-3; the nearest mistake (√(d_k + 1)
for √d_k) by 2e-2 … 5e-2."""

_MIN_VALUES = 8


def half_precision(learner: list[Any]) -> str:
    """The format ("bfloat16" or "float16") of which every finite value of the first output (the
    attention's result; a decode step's caches are the caller's) of every probe that ran is a number, or
    "" — a float32 result is one by chance with odds ≈ 2⁻¹³ a value. At least :data:`_MIN_VALUES`
    distinct values that are not whole numbers are needed (ones, zeros and counts are numbers of every
    format). Such code computed, or rounded its result, in half precision."""
    import torch

    values = [o[0].flatten() for o in learner if not isinstance(o, Raised) and o and o[0].is_floating_point()]
    values = [v[torch.isfinite(v) & (v != v.round())].double() for v in values]
    if not values or torch.unique(torch.cat(values)).numel() < _MIN_VALUES:
        return ""
    narrower_first = (torch.bfloat16, torch.float16)  # bfloat16 numbers of |x| < 65504 are float16's too
    for dtype in narrower_first:
        if all(torch.equal(v.to(dtype).double(), v) for v in values):
            return str(dtype).removeprefix("torch.")
    return ""


def _shapes(outputs: tuple[Any, ...]) -> str:
    return ", ".join(str(tuple(t.shape)) for t in outputs)


def grade_file(path: str | Path, task: str | None = None) -> Report:
    """Load the learner's file (executing it) and grade the task it defines (``task`` or detected).

    An exception while the file runs is a finding (``exception``). Raises OSError for a file that cannot
    be read, :class:`FileSyntaxError` (a ValueError naming file, line and column) when it is not valid
    Python, ValueError when no task or several are found and ``task`` is None (for a file that raised
    while it ran, the task is read from the names its source defines).
    """
    path = Path(path)
    namespace, error = load_file(path)
    if task is None:
        found = tasks_in_source(path) if error is not None else detect_tasks(namespace)
        if not found:
            raise ValueError(
                _("{path} defines none of the tasks' names ({names}): use --task").format(
                    path=path, names=", ".join(n for t in TASKS.values() for n in t.names)
                )
            )
        if len(found) > 1:
            raise ValueError(
                _("{path} defines several tasks ({names}): choose one with --task").format(
                    path=path, names=", ".join(found)
                )
            )
        task = found[0]
    if error is not None:
        chosen = resolve_task(task)
        report = Report(
            task=chosen.name,
            signature=chosen.signature,
            lecture=chosen.lecture,
            contract=_(chosen.contract),
            file=str(path),
        )
        report.findings.append(_finding("exception", error, chosen.lecture))
        return report
    return grade(namespace, task, file=str(path))


class _CallableModule(ModuleType):
    """``selfattention.grade(fn, task=...)`` calls :func:`grade`; ``selfattention.grade.TASKS`` etc. stay."""

    def __call__(self, obj: Any, task: str | None = None, *, file: str | None = None) -> Report:
        return grade(obj, task, file=file)


sys.modules[__name__].__class__ = _CallableModule
