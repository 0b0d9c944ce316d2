"""Lesson ``n-squared-bill`` (lecture 003 §4, exercise 5): the score table costs n².

Going from 1000 to 4000 tokens (4×) multiplies the number of scores by 16. Measured with the library's
materialising reference path (:func:`selfattention.functional.attention_steps`): the bytes actually held
by its (T, T) tensors (scores, scaled scores, weights) and the wall time of one forward call, at several
T; the ratio 4000 / 1000 is read off the measurements.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..functional import attention_steps
from ._base import FAILS, HOLDS, ONLY_WHEN, Lesson, LessonResult, ResultTable, Verdict, progress_steps

LESSON = Lesson(
    name="n-squared-bill",
    lecture="003",
    section="四、这一讲机制自带的代价；思考题 5",
    claim_zh="序列长度翻倍，需要计算和存储的分数数量变成 4 倍……从 1000 个 token 增加到 4000 个 token，打分表的计算量大概会变成原来的多少倍？",
    claim_en="Exercise 5: the n × n score table makes memory and compute grow as n²: 1000 → 4000 tokens "
    "costs about 16×.",
    kind="exercise",
    module="n_squared",
)


def table_bytes(steps: Any, t_q: int, t_k: int) -> int:
    """Bytes held by the distinct (…, Tq, Tk) tensors among the steps (shared storage counted once)."""
    seen: dict[int, int] = {}
    for value in steps.as_dict().values():
        if isinstance(value, torch.Tensor) and value.shape[-2:] == (t_q, t_k) and value.stride(-1) != 0:
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``memory_ratio`` and ``time_ratio`` measured between ``small`` and ``large`` T."""
    expected = (m["large"] / m["small"]) ** 2
    mem, tim = m["memory_ratio"], m["time_ratio"]
    if abs(mem / expected - 1) > 0.1:
        return Verdict(FAILS, f"memory grew {mem:.1f}×, not ≈ {expected:.0f}×")
    if expected / 2 <= tim <= expected * 2:
        return Verdict(
            HOLDS,
            f"{m['small']} → {m['large']} tokens: memory {mem:.1f}×, time {tim:.1f}× (n² predicts {expected:.0f}×)",
        )
    return Verdict(
        ONLY_WHEN,
        f"memory {mem:.1f}×, but time {tim:.1f}× (n² predicts {expected:.0f}×)",
        condition="counting memory; the measured time ratio is off (overheads or a noisy machine)",
    )


def run(
    out_dir: Path | None = None,
    progress: Any = None,
    *,
    sizes: tuple[int, ...] = (500, 1000, 2000, 4000),
    small: int = 1000,
    large: int = 4000,
    d: int = 64,
    repeats: int = 3,
    threads: int | None = 1,
    seed: int = 0,
) -> LessonResult:
    """One head, float32, head_dim ``d``; timing on ``threads`` torch threads (1: stable on a shared box)."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    rows, mem, tim = [], {}, {}
    try:
        with progress_steps(progress, "n² bill", len(sizes)) as advance:
            for t in sizes:
                q, k, v = (torch.randn(t, d, generator=gen) for _ in range(3))
                steps = attention_steps(q, k, v)
                mem[t] = table_bytes(steps, t, t)
                del steps
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    attention_steps(q, k, v)
                    times.append(time.perf_counter() - start)
                tim[t] = statistics.median(times)
                rows.append([t, f"{t * t:,}", f"{mem[t] / 2**20:.1f}", f"{tim[t] * 1000:.1f}"])
                advance()
    finally:
        torch.set_num_threads(old)
    m = {
        "small": small,
        "large": large,
        "memory_ratio": mem[large] / mem[small],
        "time_ratio": tim[large] / tim[small],
        "bytes": mem,
        "seconds": tim,
    }
    table = ResultTable(
        f"attention_steps, one head, float32, d = {d}, {threads or torch.get_num_threads()} thread(s), median of {repeats}",
        ["T", "scores", "(T,T) tensors held (MiB)", "forward time (ms)"],
        rows,
    )
    ratio = ResultTable(
        f"{large} / {small} tokens",
        ["quantity", "measured ratio", "n² predicts"],
        [
            ["memory", f"{m['memory_ratio']:.2f}×", f"{(large / small) ** 2:.0f}×"],
            ["time", f"{m['time_ratio']:.2f}×", f"{(large / small) ** 2:.0f}×"],
        ],
    )
    figures = []
    if out_dir is not None:
        from ._base import new_figure, save_figure

        fig, ax = new_figure()
        ts = list(sizes)
        ax.loglog(ts, [mem[t] / mem[ts[0]] for t in ts], "o-", label="memory of the (T,T) tensors")
        ax.loglog(ts, [tim[t] / tim[ts[0]] for t in ts], "s-", label="forward time")
        ax.loglog(ts, [(t / ts[0]) ** 2 for t in ts], "--", color="grey", label="(T/T₀)²")
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel(f"relative to T₀ = {ts[0]}")
        ax.set_title("lecture 003: the n² bill")
        ax.legend()
        figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(
        LESSON,
        m,
        verdict(m),
        tables=[table, ratio],
        figures=figures,
        notes=[
            "Finer tokenization means more tokens, and the bill grows with their square (lecture 7's "
            "point): text that splits into 2× as many tokens costs ≈ 4× in attention."
        ],
    )
