"""Comparing the time of two runs on a machine that may be busy: interleaved pairs, the median ratio.

Timing one run of A then one run of B measures the machine as much as A and B: a burst of load during
one of them flips the answer (``generate --check`` once printed "recomputing took 0.6× the time of the
cached run", 8.3 s cached against 1.0 s recomputed). :func:`compare` runs A, B, A, B, … so both see the
same load on average, takes the ratio B/A of each pair and reports the median; when the pairs disagree
about which is faster, or their ratios spread over more than a factor :data:`NOISY_SPREAD`, the
comparison says the machine was too noisy to tell instead of printing a number. A time budget caps the
work: once the pairs timed so far have taken ``budget_s`` seconds, no further pair starts (``cut_short``),
so a machine busy enough to make each run ten times slower costs one pair, not three.

>>> import itertools
>>> times = itertools.cycle([1.0, 3.0, 1.1, 3.3, 0.9, 2.7])  # A, B, A, B, A, B
>>> c = compare(lambda: ("a", next(times)), lambda: ("b", next(times)), rounds=3)
>>> round(c.median_ratio, 3), c.noisy, c.rounds
(3.0, False, 3)
>>> slow = compare(lambda: ("a", 70.0), lambda: ("b", 110.0), rounds=3, budget_s=60)
>>> slow.rounds, slow.cut_short
(1, True)
>>> noisy = itertools.cycle([1.0, 3.0, 8.3, 1.0, 1.0, 2.5])
>>> compare(lambda: ("a", next(noisy)), lambda: ("b", next(noisy)), rounds=3).noisy
True
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["NOISY_SPREAD", "Comparison", "compare"]

NOISY_SPREAD = 2.0
"""Pairs whose ratios B/A spread over more than this factor (largest / smallest) cannot be summarised."""


@dataclass(frozen=True)
class Comparison:
    """Interleaved timings of two runs: ``first`` (A) and ``second`` (B), one pair per round."""

    first_values: list[Any]
    second_values: list[Any]
    first_seconds: list[float]
    second_seconds: list[float]
    cut_short: bool = False
    """The time budget ran out before every asked-for pair was timed."""

    @property
    def rounds(self) -> int:
        return len(self.first_seconds)

    @property
    def ratios(self) -> list[float]:
        """B's time / A's time, per round."""
        return [b / max(a, 1e-12) for a, b in zip(self.first_seconds, self.second_seconds, strict=True)]

    @property
    def median_ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def noisy(self) -> bool:
        """The rounds disagree on which run is faster, or their ratios spread over > NOISY_SPREAD×."""
        lo, hi = min(self.ratios), max(self.ratios)
        return (lo < 1 < hi) or hi > NOISY_SPREAD * lo

    def median_seconds(self) -> tuple[float, float]:
        """The median time of A and of B."""
        return statistics.median(self.first_seconds), statistics.median(self.second_seconds)


def compare(
    first: Callable[[], tuple[Any, float]],
    second: Callable[[], tuple[Any, float]],
    rounds: int = 3,
    *,
    budget_s: float | None = None,
    on_run: Callable[[int, int, float], None] | None = None,
) -> Comparison:
    """Run ``first`` and ``second`` alternately up to ``rounds`` times each (A B A B …); each returns
    ``(value, seconds)``. ``on_run(round, which, seconds)`` (round from 1, which 0 = A, 1 = B) is called
    after every run (progress). With ``budget_s``, no new pair starts once the runs so far took that many
    seconds in all (at least one pair always runs; then ``cut_short`` is True).

    Raises:
        ValueError: ``rounds`` < 1, ``budget_s`` not > 0.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s must be > 0 seconds or None, got {budget_s}")
    values: tuple[list[Any], list[Any]] = ([], [])
    seconds: tuple[list[float], list[float]] = ([], [])
    for n in range(1, rounds + 1):
        for i, run in enumerate((first, second)):
            value, secs = run()
            values[i].append(value)
            seconds[i].append(float(secs))
            if on_run is not None:
                on_run(n, i, float(secs))
        spent = sum(seconds[0]) + sum(seconds[1])
        if budget_s is not None and n < rounds and spent >= budget_s:
            return Comparison(values[0], values[1], seconds[0], seconds[1], cut_short=True)
    return Comparison(values[0], values[1], seconds[0], seconds[1])
