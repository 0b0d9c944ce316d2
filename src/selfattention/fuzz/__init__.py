"""Fuzz the public functions for a set time: only the documented errors, never NaN where math is finite.

Run it with ``selfattention fuzz --seconds 600`` or ``python -m selfattention.fuzz --seconds 600``.

Hypothesis draws inputs, good and bad, and feeds them to every public entry point:

* ``scaled_dot_product_attention`` on every registered backend, ``attention_weights``,
  ``simple_attention``, ``tiled_attention`` (with random block sizes), the modules (``SelfAttention``,
  ``MultiHeadAttention``) and the mask builders;
* inputs: dtypes float16/bfloat16/float32/float64 and now and then int64, bool or complex; ranks 1 to 5;
  every length from 0; mismatched head counts, head_dims and lengths; bool, float, 0/1-float, integer and
  wrongly shaped masks; NaN and ±inf sprinkled into queries, keys, values and masks (hidden or visible);
  values up to 1e4; scales None, 0.0, negative, NaN, strings; the meta device for one argument.

An input passes when the call either raises ``ValueError`` or ``TypeError`` with a one-line message, or
returns a result that (1) has the right shape and dtype, (2) is finite wherever the float64 spec is finite
and non-finite wherever it is not (NaN in → NaN out), (3) is close to the spec where the scores are of
moderate size, and (4) left every argument unchanged. Anything else (another exception type, a NaN, a
wrong number, a modified input) is a failure; hypothesis shrinks it to a small example, which is printed.

The result: :class:`FuzzReport` (inputs tried, errors seen by type and message, failures).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable

from .report import FuzzFailure, FuzzReport
from .targets import attention_example, module_example

__all__ = ["FuzzReport", "FuzzFailure", "run", "main", "format_report"]


# ------------------------------------------------------------------------------------------- driving


def run(
    seconds: float = 60.0,
    *,
    seed: int | None = None,
    batch: int = 40,
    progress: Callable[[FuzzReport], None] | None = None,
) -> FuzzReport:
    """Fuzz for about ``seconds`` (at least one batch of ``batch`` examples); return a :class:`FuzzReport`.

    ``seed`` makes the run reproducible (hypothesis ``derandomize`` per batch). Raises ``ValueError`` for
    ``seconds <= 0``; needs hypothesis (``pip install hypothesis``, part of the ``dev`` extra).

    >>> report = run(seconds=0.1, seed=0, batch=3)
    >>> report.inputs > 0, report.seconds > 0
    (True, True)
    """
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"seconds must be a positive number, got {seconds!r}")
    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import seed as hypothesis_seed
        from hypothesis import strategies as st
        from hypothesis.errors import HypothesisException
    except ImportError as e:  # pragma: no cover
        raise TypeError("the fuzzer needs hypothesis: pip install hypothesis") from e
    from ..backends import available_backends

    backends = available_backends()
    report = FuzzReport()
    start = time.monotonic()
    seen_failures: set[str] = set()
    repeats = report.repeats
    round_ = 0
    while True:
        round_ += 1

        @settings(
            max_examples=batch,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
        )
        @given(data=st.data(), which=st.sampled_from(["attention"] * 4 + ["modules"]))
        def one(data, which):
            try:
                if which == "attention":
                    attention_example(data, report, backends)
                else:
                    module_example(data, report, backends)
            except FuzzFailure as e:
                key = _failure_key(str(e))
                if key in seen_failures:  # a bug already reported: count it, do not shrink it again
                    repeats[key] += 1
                    return
                raise

        if seed is not None:
            one = hypothesis_seed(seed * 100_003 + round_)(one)
        try:
            one()
        except FuzzFailure as e:
            described = _describe(e)
            key = _failure_key(described)
            if key not in seen_failures:
                seen_failures.add(key)
                report.failures.append(described)
        except HypothesisException as e:  # pragma: no cover
            report.failures.append(f"hypothesis: {e}")
        except Exception as e:  # noqa: BLE001 — raised outside _call (e.g. in a backward): still a finding
            described = f"uncaught {type(e).__name__}: {str(e)[:300]}\n" + _describe(e).split("\n", 1)[-1]
            key = _failure_key(described)
            if key not in seen_failures:
                seen_failures.add(key)
                report.failures.append(described)
        report.seconds = time.monotonic() - start
        if progress is not None:
            progress(report)
        if report.seconds >= seconds:
            return report


def _failure_key(text: str) -> str:
    """The first line with numbers blanked: the same bug with other sizes is the same failure."""
    return re.sub(r"\d+", "#", text.split("\n")[0])


def _describe(e: BaseException) -> str:
    text = str(e)
    notes = getattr(e, "__notes__", [])
    example = "\n".join(n for n in notes if "Falsifying" not in n)
    return f"{text}\n{example}".strip()


def main(argv: list[str] | None = None) -> int:
    """``python -m selfattention.fuzz --seconds N [--seed S] [--json PATH]``; exit code 1 on failures."""
    p = argparse.ArgumentParser(prog="python -m selfattention.fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long to fuzz (default 60)")
    p.add_argument("--minutes", type=float, default=None, help="how long to fuzz, in minutes")
    p.add_argument("--seed", type=int, default=None, help="make the run reproducible")
    p.add_argument("--json", default=None, help="also write the report as JSON to this path")
    a = p.parse_args(argv)
    seconds = a.minutes * 60 if a.minutes is not None else a.seconds

    def progress(r: FuzzReport) -> None:
        print(
            f"[{r.seconds:7.1f}s] {r.inputs} inputs, {sum(r.errors.values())} documented errors, {len(r.failures)} failures",
            flush=True,
        )

    report = run(seconds, seed=a.seed, progress=progress)
    print(format_report(report))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report.as_dict(), f, indent=2)
    return 0 if report.ok else 1


def format_report(report: FuzzReport) -> str:
    """A plain-text summary (inputs, documented errors seen, failures), in the interface language (the
    errors themselves are the library's messages, as raised)."""
    from ..i18n import _

    by_target = ", ".join(f"{k} {v}" for k, v in report.by_target.most_common())
    lines = [
        _(
            "fuzzed {seconds:.0f} s: {inputs} inputs, {errors} documented ValueError/TypeError, "
            "{failures} failures"
        ).format(
            seconds=report.seconds,
            inputs=report.inputs,
            errors=sum(report.errors.values()),
            failures=len(report.failures),
        ),
        _("inputs by target: {targets}").format(targets=by_target),
        _("most common documented errors:"),
    ]
    lines += [f"  {n:6d}  {k}" for k, v in [(k, v) for k, v in report.errors.most_common(15)] for n in [v]]
    for f in report.failures:
        n = report.repeats.get(_failure_key(f), 0)
        seen = _("FAILURE (seen {times} times): {failure}") if n else _("FAILURE: {failure}")
        lines.append(seen.format(times=n + 1, failure=f))
    return "\n".join(lines)
