"""The benchmark behind ``selfattention bench``: the tiled path against its peers, in the same run.

Peers: torch SDPA (the same fused kernel, with ``is_causal`` or the equivalent bool mask), flex_attention
compiled with ``torch.compile`` (forward only: it has no CPU backward; its compile time is reported on its
own), and the materialising reference at small T. Cases (B = 1, H = 8, D = 64, float32 by default):

* dense and causal, forward and forward + backward, at each ``sizes`` T;
* a sliding window W = 512 and packed documents (8 of T/8) at T = 16384;
* statistics (log-sum-exp, entropy, top-4 keys, column sums), causal, against SDPA's causal forward;
* opt-in (``--long``): causal forward + backward at T = 65536 with H = 1 — time and memory.

Each case runs in a fresh child process (``python -m selfattention.bench --child SPEC``) that prints one
JSON line per implementation. Inside a child, **memory** first: freed heap is returned to the OS
(``malloc_trim``), the peak-RSS mark is reset (``/proc/self/clear_refs``), one call runs, and peak extra
memory = VmHWM − VmRSS before the call (that call is also the warm-up, and flex's compile); then **time**:
``repeats`` rounds that call every implementation in turn (interleaved, so a noisy neighbour slows them
alike); the median is reported. Threads: torch's default unless ``threads`` is set. Every tiled row
records which kernel and plan strategy ran (:func:`selfattention.tiled.describe`), and why.

**Contended** (``contended=True``, ``selfattention bench --contended``): the child also starts a bounded
background load — one process spinning on one core (pinned to the last CPU where the OS allows it; it
exits by itself after :data:`~selfattention.bench_measure.SPIN_LIMIT_S` and is killed at the end) — and
every round times each implementation twice, once with the spinner stopped (SIGSTOP) and once with it running (SIGCONT), so the
quiet and the contended ratios come from the same process and the same minutes of a shared machine.

The rooms: :mod:`selfattention.bench_measure` (memory, the matmul peak, the spinner),
:mod:`selfattention.bench_cases` (the variants, their implementations, the child's measurement) and
:mod:`selfattention.bench_table` (the markdown and the files); this module holds the configuration and the
parent that runs one child per case. Their public names stay importable from here.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from .bench_cases import MASKED_VARIANTS, VARIANTS, measure_case
from .bench_measure import Spinner, matmul_peak_gflops
from .bench_table import by_case, case_key, to_markdown, write_results

__all__ = [
    "BenchConfig",
    "run_bench",
    "to_markdown",
    "write_results",
    "matmul_peak_gflops",
    "VARIANTS",
    "Spinner",
]

FULL_SIZES = (1024, 4096)
QUICK_SIZES = (128, 256)


@dataclass
class BenchConfig:
    """What to measure. ``quick`` gives CI-sized runs (seconds, no flex compile)."""

    sizes: tuple[int, ...] = FULL_SIZES  # dense / causal lengths
    heads: int = 8
    head_dim: int = 64
    batch: int = 1
    variants: tuple[str, ...] = VARIANTS
    passes: tuple[str, ...] = ("fwd", "fwd+bwd")
    long_t: int = 16384  # the window / documents / stats length (stats at min(long_t, 4096))
    window: int = 512
    documents: int = 8
    top_k: int = 4
    repeats: int = 3
    slow_repeats: int = 2  # rounds for cases whose slowest peer takes seconds (SDPA with a T² mask)
    reference_max_t: int = 1024  # the materialising reference beyond this: n² memory, skipped
    flex: bool = True
    peak_size: int = 4096
    memory_t: int | None = None  # opt-in: causal fwd+bwd at this T with H = 1 (65536 with --long)
    block_q: int | None = None
    block_k: int | None = None
    threads: int | None = None  # torch threads in the children (None: torch's default)
    contended: bool = False  # time every round quiet and with one core kept busy by a spinner
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(
            sizes=QUICK_SIZES,
            heads=2,
            head_dim=32,
            long_t=512,
            window=32,
            repeats=2,
            slow_repeats=1,
            reference_max_t=256,
            flex=False,
            peak_size=512,
        )


def _specs(cfg: BenchConfig) -> list[dict]:
    base = {
        "heads": cfg.heads,
        "head_dim": cfg.head_dim,
        "batch": cfg.batch,
        "window": cfg.window,
        "documents": cfg.documents,
        "top_k": cfg.top_k,
        "repeats": cfg.repeats,
        "reference_max_t": cfg.reference_max_t,
        "flex": cfg.flex,
        "block_q": cfg.block_q,
        "block_k": cfg.block_k,
        "threads": cfg.threads,
        "contended": cfg.contended,
    }
    specs = []
    for variant in ("dense", "causal"):
        if variant in cfg.variants:
            specs += [{**base, "t": t, "variant": variant, "pass": p} for t in cfg.sizes for p in cfg.passes]
    for variant in MASKED_VARIANTS:
        if variant in cfg.variants:
            specs += [
                {**base, "t": cfg.long_t, "variant": variant, "pass": p, "repeats": cfg.slow_repeats}
                for p in cfg.passes
            ]
    for variant in ("stats0", "stats"):
        if variant in cfg.variants:
            specs.append({**base, "t": min(cfg.long_t, max(cfg.sizes)), "variant": variant, "pass": "fwd"})
    if cfg.memory_t:
        specs.append({**base, "t": cfg.memory_t, "heads": 1, "variant": "causal", "pass": "fwd+bwd",
                      "repeats": 0, "flex": False, "memory": True})  # fmt: skip
    return specs


def run_bench(cfg: BenchConfig, *, progress: bool = True, log=None) -> dict:
    """Run the benchmark; returns ``{"meta": {...}, "rows": [...]}`` (see the module docstring)."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    specs = _specs(cfg)
    meta = {
        "torch": torch.__version__,
        "threads": cfg.threads or torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "config": {k: v for k, v in cfg.__dict__.items() if k != "extra"},
        "skipped": [],
    }
    rows: list[dict] = []
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}")]
    with Progress(*columns, TimeElapsedColumn(), disable=not progress, transient=False) as bar:
        task = bar.add_task("matmul peak", total=len(specs) + 1)
        meta["matmul_peak_gflops"] = matmul_peak_gflops(cfg.peak_size)
        bar.advance(task)
        for spec in specs:
            bar.update(task, description=f"{spec['variant']} {spec['pass']} T={spec['t']} H={spec['heads']}")
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            cmd = [sys.executable, "-m", "selfattention.bench", "--child", json.dumps(spec)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                row = json.loads(line)
                if "missing" in row:
                    meta["skipped"].append(
                        f"{row['impl']} for {row['variant']} {row['pass']}: {row['missing']}"
                    )
                    continue
                row["memory_case"] = bool(spec.get("memory"))
                rows.append(row)
                if log is not None:
                    log(row)
            err = proc.stderr.read() if proc.stderr else ""
            if proc.wait() != 0:
                last = err.strip().splitlines()[-1:] or ["(no message)"]
                meta["skipped"].append(
                    f"{spec['variant']} {spec['pass']} T={spec['t']}: child failed: {last[0]}"
                )
            bar.advance(task)
    meta["load_avg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    peak = meta["matmul_peak_gflops"]
    for row in rows:
        fwd_flops = 4 * row["t"] ** 2 * row["head_dim"] * row["heads"] * row["batch"]
        flops = fwd_flops * (3.5 if row["pass"] == "fwd+bwd" else 1.0)
        if row["impl"] in ("tiled", "flex"):
            flops *= row["visible_fraction"]  # the work a path that skips has to do
        row["gflops"] = flops / row["median_s"] / 1e9
        row["pct_peak"] = 100 * row["gflops"] / peak
    _ratios(rows)
    return {"meta": meta, "rows": rows}


def _ratios(rows: list[dict]) -> None:
    by = by_case(rows)
    for r in rows:
        if r["impl"] == "tiled":
            for peer in ("sdpa", "flex"):
                base = by.get((*case_key(r), peer))
                r[f"ratio_vs_{peer}"] = r["median_s"] / base["median_s"] if base else None
                if base and "median_s_contended" in r and "median_s_contended" in base:
                    busy = r["median_s_contended"] / base["median_s_contended"]
                    r[f"ratio_vs_{peer}_contended"] = busy
                    r[f"contention_vs_{peer}"] = busy / r[f"ratio_vs_{peer}"]


if __name__ == "__main__":  # the child process
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        measure_case(json.loads(sys.argv[2]))
    else:
        print("usage: python -m selfattention.bench --child SPEC (used by `selfattention bench`)")
        sys.exit(2)
