"""Every claim and exercise of the two lectures as a runnable lesson.

Each lesson module defines ``LESSON`` (a :class:`Lesson`: name, lecture, section, the claim quoted and
paraphrased, kind), a pure ``verdict(measurements) -> Verdict`` and
``run(out_dir=None, progress=None, **sizes) -> LessonResult``, which measures with this library's own
functions (:mod:`selfattention.functional`, :mod:`selfattention.modules`, :mod:`selfattention.pretrained`)
and writes figures to ``out_dir`` when one is given. Claims with no honest measurement are listed as
"discussed" with the reason (:mod:`.discussed`).

>>> names = [lesson.name for lesson in all_lessons()]
>>> "similar-means-attend" in names and "symmetric-scores" in names
True
>>> get("single-token").kind
'exercise'
"""

from __future__ import annotations

import importlib

from ..i18n import _
from ._base import (
    FAILS,
    HOLDS,
    KINDS,
    ONLY_WHEN,
    Lesson,
    LessonResult,
    ResultTable,
    Verdict,
)

__all__ = [
    "FAILS",
    "HOLDS",
    "KINDS",
    "ONLY_WHEN",
    "Lesson",
    "LessonResult",
    "ResultTable",
    "Verdict",
    "all_lessons",
    "get",
    "run",
]

#: Lesson modules, in the order of the lectures (000 first, then 003).
MODULES = (
    "three_steps",
    "similar_attend",
    "symmetric_scores",
    "limitations_training",
    "distance_one_hop",
    "similarity_heads",
    "weights_distribution",
    "value_scaling",
    "why_scale",
    "set_operation",
    "single_token",
    "polysemy",
    "n_squared",
    "no_locality_prior",
    "kv_reuse",
    "one_aggregation",
    "weights_not_explanation",
)


def all_lessons() -> list[Lesson]:
    """Every lesson, runnable ones first (lecture order), then the discussed/checked claims."""
    from .discussed import DISCUSSED

    runnable = [importlib.import_module(f"{__name__}.{m}").LESSON for m in MODULES]
    return runnable + list(DISCUSSED)


def get(name: str) -> Lesson:
    """The lesson called ``name``; ``KeyError`` listing the names when there is none."""
    lessons = {lesson.name: lesson for lesson in all_lessons()}
    if name not in lessons:
        raise KeyError(
            _("no lesson named {name!r}; lessons are: {names}").format(name=name, names=", ".join(lessons))
        )
    return lessons[name]


def run(name: str, out_dir=None, progress=None, **sizes) -> LessonResult:
    """Run lesson ``name`` (see :func:`get`) and time it; returns its :class:`LessonResult`."""
    import time

    lesson = get(name)
    start = time.perf_counter()
    result = lesson.runner()(out_dir=out_dir, progress=progress, **sizes)
    result.seconds = time.perf_counter() - start
    return result
