"""Lesson ``n-squared-bill`` (lecture 003 §4, exercise 5): the score table costs n².

Going from 1000 to 4000 tokens (4×) multiplies the number of scores by 16. What is measured, at several
T, with one head of float32 queries, keys and values of head_dim d:

* **FLOPs**, counted exactly: the scores Q Kᵀ take 2·T²·d (a multiply and an add per term), and so does
  weights · V — 16× from 1000 to 4000 tokens by arithmetic, on any machine;
* **memory**: the bytes actually held by the (T, T) tensors of the library's materialising reference path
  (:func:`selfattention.functional.attention_steps`: scores, scaled scores, weights);
* **bytes moved** by that path, estimated by counting its passes over (T, T) tables
  (:data:`TABLE_PASSES`), against the size of the last-level CPU cache;
* **time** of one forward call on that path *and* on the tiled path
  (:func:`selfattention.tiled.tiled_attention`), which never holds a (T, T) table.

Why both times: once the materialised path's (T, T) tensors outgrow the cache, each of its passes runs at
memory speed and its time grows faster than n²; the tiled path keeps its tiles in the cache and stays
compute-bound, so its time follows the FLOPs (≈ 16×). That is the lecture's n² bill, and why long context
needs kernels with O(n) memory (lecture 23: FlashAttention-style tiling), in one table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..functional import attention_steps
from ..i18n import N_, _
from ._base import FAILS, HOLDS, ONLY_WHEN, Lesson, LessonResult, ResultTable, Verdict, progress_steps
from .three_steps import median_seconds as _timed_median

LESSON = Lesson(
    name="n-squared-bill",
    summary=N_("1000 → 4000 tokens costs 16× (n²)"),
    lecture="003",
    section="四、这一讲机制自带的代价；思考题 5",
    claim_zh="序列长度翻倍，需要计算和存储的分数数量变成 4 倍……从 1000 个 token 增加到 4000 个 token，打分表的计算量大概会变成原来的多少倍？",
    claim_en=N_(
        "Exercise 5: the n × n score table makes memory and compute grow as n²: 1000 → 4000 tokens "
        "costs about 16×."
    ),
    kind="exercise",
    module="n_squared",
)

#: Passes of attention_steps over a (T, T) float32 table in one forward call without a mask: writes of
#: the scores, the scaled scores, (scaled − row max), its exp and the weights (5); reads for the scaling,
#: the row max, the subtraction, the exp, the row sum, the division and weights · V (7).
TABLE_PASSES = 12


def score_flops(t_q: int, t_k: int, d: int) -> int:
    """FLOPs of the scores Q Kᵀ: ``2 · Tq · Tk · d`` (one multiply and one add per term).

    >>> score_flops(4000, 4000, 64) / score_flops(1000, 1000, 64)
    16.0
    """
    return 2 * t_q * t_k * d


def moved_bytes(t: int, d: int, itemsize: int = 4) -> int:
    """Estimated bytes the materialising path moves in one forward call: :data:`TABLE_PASSES` passes over a
    (T, T) table plus reading Q, K, V and writing the output, (T, d) each.

    >>> round(moved_bytes(4000, 64) / 2**20)  # 12 passes over 61 MiB
    736
    """
    return (TABLE_PASSES * t * t + 4 * t * d) * itemsize


def last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache of cpu0 (Linux sysfs), or None where it cannot be read."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (entry / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if unit != 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


def table_bytes(steps: Any, t_q: int, t_k: int) -> int:
    """Bytes held by the distinct (…, Tq, Tk) tensors among the steps (shared storage counted once)."""
    seen: dict[int, int] = {}
    for value in steps.as_dict().values():
        if isinstance(value, torch.Tensor) and value.shape[-2:] == (t_q, t_k) and value.stride(-1) != 0:
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}" if n >= 10 * 2**20 else f"{n / 2**20:.1f}"


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure. ``small``/``large`` T; measured ratios large/small: ``flops_ratio``, ``memory_ratio``,
    ``time_ratio`` (materialising path), ``tiled_time_ratio``; ``table_bytes_large``/``table_bytes_small``
    (the (T, T) tensors held) and ``cache_bytes`` (None if unknown) to explain the materialised time."""
    small, large = m["small"], m["large"]
    expected = (large / small) ** 2
    flops, mem = m["flops_ratio"], m["memory_ratio"]
    full, tiled = m["time_ratio"], m["tiled_time_ratio"]
    if abs(flops / expected - 1) > 1e-9 or abs(mem / expected - 1) > 0.1:
        return Verdict(
            FAILS,
            _("FLOPs grew {flops:.1f}× and memory {mem:.1f}×, not ≈ {expected:.0f}×").format(
                flops=flops, mem=mem, expected=expected
            ),
        )
    head = _("{small} → {large} tokens: score FLOPs {flops:.0f}× (counted), (T, T) memory {mem:.1f}×").format(
        small=small, large=large, flops=flops, mem=mem
    )
    within = expected / 2 <= full <= expected * 2
    cache = m.get("cache_bytes")
    if within:
        why = _("materialised time {full:.1f}× too").format(full=full)
    elif cache and m["table_bytes_large"] > cache >= m["table_bytes_small"]:
        why = _(
            "the materialised path took {full:.1f}×: at T = {large} its (T, T) tensors ({mib} MiB) no longer fit the {mib2} MiB cache, so it is memory-bound"
        ).format(full=full, large=large, mib=_mib(m["table_bytes_large"]), mib2=_mib(cache))
    else:
        why = _(
            "the materialised path took {full:.1f}× (it moves ≈ {TABLE_PASSES} (T, T) tables per call)"
        ).format(full=full, TABLE_PASSES=TABLE_PASSES)
    if expected / 2 <= tiled <= expected * 2:
        return Verdict(
            HOLDS,
            _("{head}; tiled time {tiled:.1f}× (compute-bound); {why}").format(
                head=head, tiled=tiled, why=why
            ),
        )
    return Verdict(
        ONLY_WHEN,
        _(
            "{head}; but tiled time {tiled:.1f}× and materialised {full:.1f}× (n² predicts {expected:.0f}×)"
        ).format(head=head, tiled=tiled, full=full, expected=expected),
        condition=_("counting FLOPs and memory; neither path's measured time grew as n²"),
    )


def median_seconds(fn: Any, repeats: int) -> float:
    fn()  # warm-up: allocator and caches
    return _timed_median(fn, repeats)


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
    from ..tiled import tiled_attention

    gen = torch.Generator().manual_seed(seed)
    old = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    mem, full, tiled = {}, {}, {}
    try:
        with progress_steps(progress, _("n² bill"), len(sizes)) as advance, torch.no_grad():
            for t in sizes:
                q, k, v = (torch.randn(t, d, generator=gen) for _ in range(3))
                steps = attention_steps(q, k, v)
                mem[t] = table_bytes(steps, t, t)
                expected = steps.context
                del steps
                q4, k4, v4 = (x[None, None] for x in (q, k, v))  # (1, 1, T, d)
                torch.testing.assert_close(tiled_attention(q4, k4, v4)[0, 0], expected, rtol=1e-4, atol=1e-5)
                full[t] = median_seconds(lambda q=q, k=k, v=v: attention_steps(q, k, v), repeats)
                tiled[t] = median_seconds(lambda q=q4, k=k4, v=v4: tiled_attention(q, k, v), repeats)
                advance()
    finally:
        torch.set_num_threads(old)
    cache = last_level_cache_bytes()
    m = {
        "small": small,
        "large": large,
        "d": d,
        "flops_ratio": score_flops(large, large, d) / score_flops(small, small, d),
        "memory_ratio": mem[large] / mem[small],
        "time_ratio": full[large] / full[small],
        "tiled_time_ratio": tiled[large] / tiled[small],
        "table_bytes_small": mem[small],
        "table_bytes_large": mem[large],
        "cache_bytes": cache,
        "bytes": mem,
        "seconds": full,
        "tiled_seconds": tiled,
    }
    rows = [
        [
            t,
            f"{score_flops(t, t, d) / 1e9:.3g}",
            _mib(mem[t]),
            _mib(moved_bytes(t, d)),
            f"{full[t] * 1000:.1f}",
            f"{tiled[t] * 1000:.1f}",
        ]
        for t in sizes
    ]
    rows.append(
        [
            f"{large} / {small}",
            f"{m['flops_ratio']:.1f}×",
            f"{m['memory_ratio']:.1f}×",
            f"{moved_bytes(large, d) / moved_bytes(small, d):.1f}×",
            f"{m['time_ratio']:.1f}×",
            f"{m['tiled_time_ratio']:.1f}×",
        ]
    )
    rows.append([_("n² predicts"), *[f"{(large / small) ** 2:.0f}×"] * 5])
    n_threads = threads or torch.get_num_threads()
    table = ResultTable(
        _(
            "one head, float32, d = {d}, {n_threads} thread(s), median of {repeats}; last-level cache {value}"
        ).format(
            d=d, n_threads=n_threads, repeats=repeats, value=_mib(cache) + " MiB" if cache else "unknown"
        ),
        ["T", _("score GFLOP"), _("(T,T) MiB held"), _("MiB moved"), _("materialised ms"), _("tiled ms")],
        rows,
    )
    figures = []
    if out_dir is not None:
        from ._base import new_figure, save_figure

        fig, ax = new_figure()
        ts = list(sizes)
        ax.loglog(ts, [mem[t] / mem[ts[0]] for t in ts], "o-", label=_("memory of the (T,T) tensors"))
        ax.loglog(ts, [full[t] / full[ts[0]] for t in ts], "s-", label=_("time, materialised"))
        ax.loglog(ts, [tiled[t] / tiled[ts[0]] for t in ts], "^-", label=_("time, tiled (O(T) memory)"))
        ax.loglog(
            ts, [(t / ts[0]) ** 2 for t in ts], "--", color="black", lw=1.6, zorder=5, label="(T/T₀)² = FLOPs"
        )
        if cache:
            fits = [t for t in ts if mem[t] <= cache]
            if fits and fits[-1] != ts[-1]:
                ax.axvline(fits[-1], color="grey", lw=0.8, ls=":")
                ax.text(
                    fits[-1], ax.get_ylim()[1], _(" (T,T) tensors\n fit the cache ←"), va="top", fontsize=8
                )
        ax.set_xlabel(_("T (tokens)"))
        ax.set_ylabel(_("relative to T₀ = {t0}").format(t0=ts[0]))
        ax.set_title(_("lecture 003: the n² bill"))
        ax.legend(fontsize=8)
        figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(
        LESSON,
        m,
        verdict(m),
        tables=[table],
        figures=figures,
        notes=[
            _(
                "score GFLOP = 2·T²·d for Q Kᵀ (weights · V costs the same again); MiB moved = {TABLE_PASSES} passes of the materialising path over a (T, T) float32 table (an estimate from counting them, not a measurement)."
            ).format(TABLE_PASSES=TABLE_PASSES),
            _(
                "Both paths do the same FLOPs. The materialised one also streams its (T, T) tables through "
                "memory; once they outgrow the cache that traffic, not the arithmetic, sets its time. The "
                "tiled path never holds the table, so its memory grows as T and its time as the FLOPs: why "
                "long context needs O(n)-memory kernels (lecture 23)."
            ),
            _(
                "Finer tokenization means more tokens, and the bill grows with their square (lecture 7's "
                "point): text that splits into 2× as many tokens costs ≈ 4× in attention."
            ),
        ],
    )
