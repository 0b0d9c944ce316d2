"""Lesson ``three-steps-one-matmul`` (lecture 000): the per-position loop equals one matrix product.

The lecture computes z_i position by position (score, softmax, weighted sum) and then claims the matrix
form Z = softmax(X Xᵀ) X computes all positions at once, so "the sequence dimension is fully parallel".
Here the per-position form is the library's attention with one query row at a time
(``attention_steps(x[i:i+1], X, X, scale=1)``), the matrix form is ``simple_attention(X)``.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..functional import attention_steps, simple_attention
from ..i18n import N_, _
from ._base import FAILS, HOLDS, ONLY_WHEN, Lesson, LessonResult, ResultTable, Verdict, progress_steps

LESSON = Lesson(
    name="three-steps-one-matmul",
    summary=N_("loop over positions = one matmul"),
    lecture="000",
    section="矩阵形式：一次算完整个序列",
    claim_zh="所有位置的输出在一次矩阵乘里同时算完，没有 RNN 那种“必须等前一步”的数据依赖（序列维全并行）",
    claim_en=N_(
        "Computing z_i position by position gives exactly Z = softmax(X Xᵀ) X, which computes every "
        "position in one matrix product: the sequence dimension is fully parallel."
    ),
    kind="measured",
    module="three_steps",
)

#: float64 agreement the verdict demands between loop and matrix form.
TOLERANCE = 1e-12


def per_position(x: torch.Tensor, positions: range | None = None) -> torch.Tensor:
    """z_i for one position at a time: query row i against all keys, scale 1 (lecture 000, eqs. 1–3).

    x (T, d) → (len(positions), d); ``positions`` defaults to all T.
    """
    positions = range(x.shape[0]) if positions is None else positions
    rows = [attention_steps(x[i : i + 1], x, x, scale=1.0).context for i in positions]
    return torch.cat(rows, dim=0)


def median_seconds(fn: Any, repeats: int) -> float:
    times = []
    for _step in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: from ``max_abs_diff`` (float64 loop vs matrix, all sizes) and ``speedup_at_largest``."""
    err, speedup = m["max_abs_diff"], m["speedup_at_largest"]
    if not err <= TOLERANCE:
        return Verdict(
            FAILS,
            _("loop and matrix form differ by {err:.3g} > {TOLERANCE:g}").format(
                err=err, TOLERANCE=TOLERANCE
            ),
        )
    if speedup >= 2.0:
        return Verdict(
            HOLDS,
            _(
                "max |loop − matrix| = {err:.2g} in float64; one matrix product is {speedup:.0f}× faster than the loop at T = {largest_T}"
            ).format(err=err, speedup=speedup, largest_T=m["largest_T"]),
        )
    return Verdict(
        ONLY_WHEN,
        _("max |loop − matrix| = {err:.2g}, but the matrix form was only {speedup:.1f}× faster").format(
            err=err, speedup=speedup
        ),
        condition=_("counting data dependencies, not wall time on this machine"),
    )


def run(
    out_dir: Path | None = None,
    progress: Any = None,
    *,
    agree_sizes: tuple[int, ...] = (1, 7, 97, 1025),
    time_sizes: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096),
    d: int = 64,
    repeats: int = 3,
    timed_positions: int = 64,
    threads: int | None = 1,
    seed: int = 0,
) -> LessonResult:
    """Agreement for ``agree_sizes`` (float64, d = 59), timing for ``time_sizes`` (float32, ``d``).

    Every position costs the same in the loop, so for T > ``timed_positions`` the loop is timed over
    ``timed_positions`` evenly spread positions and scaled by T / timed_positions (said in the table).
    The lesson runs on ``threads`` torch threads (default 1: on a shared machine, multi-threaded small ops
    measure thread scheduling, not the loop); ``None`` keeps torch's setting.
    """
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(out_dir, progress, agree_sizes, time_sizes, d, repeats, timed_positions, threads, seed)
    finally:
        torch.set_num_threads(old_threads)


def _run(
    out_dir, progress, agree_sizes, time_sizes, d, repeats, timed_positions, threads, seed
) -> LessonResult:
    gen = torch.Generator().manual_seed(seed)
    agree = ResultTable(_("loop vs matrix form, float64, d = 59"), ["T", _("max |loop − matrix|")])
    worst = 0.0
    for t in agree_sizes:
        x = torch.randn(t, 59, generator=gen, dtype=torch.float64) / 59**0.5 * 2
        diff = (per_position(x) - simple_attention(x)).abs().max().item()
        worst = max(worst, diff)
        agree.rows.append([t, f"{diff:.2e}"])

    timing = ResultTable(
        _(
            "time, float32, d = {d} ({value} thread(s), median of {repeats}; loop timed on ≤ {timed_positions} positions × T/n)"
        ).format(
            d=d,
            value=torch.get_num_threads() if threads is None else threads,
            repeats=repeats,
            timed_positions=timed_positions,
        ),
        ["T", _("loop (s)"), _("matrix (s)"), _("loop / matrix")],
    )
    ratios = []
    with progress_steps(progress, _("timing loop vs matrix"), len(time_sizes)) as advance:
        for t in time_sizes:
            x = torch.randn(t, d, generator=gen) / d**0.5
            simple_attention(x)  # warm-up
            n = min(t, timed_positions)
            sample = range(0, t, max(1, t // n))[:n]
            loop_s = median_seconds(lambda x=x, s=sample: per_position(x, s), repeats) * t / len(sample)
            mat_s = median_seconds(lambda x=x: simple_attention(x), repeats)
            ratios.append(loop_s / mat_s)
            timing.rows.append([t, f"{loop_s:.4f}", f"{mat_s:.5f}", f"{loop_s / mat_s:.1f}×"])
            advance()

    m = {
        "max_abs_diff": worst,
        "largest_T": time_sizes[-1],
        "speedup_at_largest": ratios[-1],
        "speedups": dict(zip(time_sizes, ratios, strict=True)),
    }
    figures = []
    if out_dir is not None:
        from ._base import new_figure, save_figure

        fig, ax = new_figure()
        ax.loglog(time_sizes, ratios, "o-")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel(_("sequence length T"))
        ax.set_ylabel(_("time(loop over positions) / time(one matrix product)"))
        ax.set_title(_("lecture 000: Z = softmax(X Xᵀ) X computes all positions at once"))
        figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(
        LESSON,
        m,
        verdict(m),
        tables=[agree, timing],
        figures=figures,
        notes=[
            _(
                "The loop calls the same library function once per query row; the ratio is the price of "
                "the sequential dependency the matrix form does not have (Python overhead included). It "
                "peaks at moderate T and falls for large T, where each loop step is itself a big "
                "(1 × T) product and the per-call overhead matters less; both forms do O(T²·d) work."
            )
        ],
    )
