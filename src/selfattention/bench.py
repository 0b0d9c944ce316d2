"""The benchmark behind ``selfattention bench``: tiled attention against torch SDPA, in the same run.

Each sequence length runs in a fresh child process (``python -m selfattention.bench --child SPEC``),
which reports one JSON line per measured case. Inside a child:

* **memory** first: for each implementation, freed heap is returned to the OS (``malloc_trim``), the
  peak-RSS mark is reset (``/proc/self/clear_refs``), one call runs, and peak extra memory =
  VmHWM − VmRSS before the call (torch's allocations are invisible to tracemalloc);
* **time** next (the memory call was the warm-up): ``repeats`` rounds that call every implementation in turn
  (interleaved, so a noisy neighbour slows them alike); the median is reported.

GFLOP/s counts 4·T²·D·H per forward (two matmuls) times the visible fraction of the mask, and 3.5× that
for forward + backward (the backward recomputes the scores: five matmuls). The float32 matmul peak
(a 4096² × 4096² product, median of 3) is measured in the same run.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BenchConfig", "run_bench", "to_markdown", "matmul_peak_gflops"]

FULL_SIZES = (512, 1024, 2048, 4096, 8192, 16384)
QUICK_SIZES = (128, 256)


@dataclass
class BenchConfig:
    """What to measure. ``quick`` gives CI-sized runs (seconds)."""

    sizes: tuple[int, ...] = FULL_SIZES
    heads: int = 8
    head_dim: int = 64
    batch: int = 1
    variants: tuple[str, ...] = ("dense", "causal", "window")
    passes: tuple[str, ...] = ("fwd", "fwd+bwd")
    window: int = 512
    window_min_t: int = 2048  # the window variant only where it hides something worth skipping
    repeats: int = 3
    reference_max_t: int = 4096  # the materialising reference beyond this: n² memory, skipped
    peak_size: int = 4096
    long_t: int | None = 65536  # the memory case: H = 1, forward + backward
    long_impls: tuple[str, ...] = ("tiled",)
    block_q: int | None = None
    block_k: int | None = None
    threads: int | None = None  # torch threads in the children (None: torch's default)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(
            sizes=QUICK_SIZES,
            heads=2,
            head_dim=32,
            window=32,
            window_min_t=128,
            repeats=2,
            reference_max_t=256,
            peak_size=512,
            long_t=None,
        )


# ----------------------------------------------------------------------------------------------- child


def _rss_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def _trim() -> None:
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _peak_extra_mib(fn) -> float | None:
    """Peak resident memory of one call of ``fn`` above what was resident before it, in MiB."""
    if not os.path.exists("/proc/self/status"):
        return None
    _trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    before = _rss_kib("VmRSS")
    fn()
    return max(0, _rss_kib("VmHWM") - before) / 1024


def matmul_peak_gflops(n: int = 4096, repeats: int = 3) -> float:
    """float32 GFLOP/s of one n × n × n matmul on this machine (median of ``repeats``)."""
    import torch

    a = torch.randn(n, n)
    b = torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def _visible_fraction(variant: str, t: int, window: int) -> float:
    if variant == "dense":
        return 1.0
    if variant == "causal":
        return (t + 1) / (2 * t)
    w = min(window, t)
    return (w * t - w * (w - 1) / 2) / t**2


def _impls(variant: str, t: int, spec: dict) -> dict[str, Any]:
    """name → callable(q, k, v) for one variant at length t."""
    import torch.nn.functional as tnf

    from . import functional, masks
    from .tiled import tiled_attention

    bq, bk, w = spec.get("block_q"), spec.get("block_k"), spec["window"]
    causal = variant == "causal"
    out: dict[str, Any] = {}
    if t <= spec["reference_max_t"]:
        ref_mask = masks.sliding_window_mask(t, window=w) if variant == "window" else None
        out["reference"] = lambda q, k, v: functional.scaled_dot_product_attention(
            q, k, v, attn_mask=ref_mask, is_causal=causal
        )
    if variant == "window":
        out["tiled"] = lambda q, k, v: tiled_attention(q, k, v, window=w, block_q=bq, block_k=bk)
        bool_mask = masks.sliding_window_mask(t, window=w)
        out["sdpa"] = lambda q, k, v: tnf.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask)
    else:
        out["tiled"] = lambda q, k, v: tiled_attention(q, k, v, is_causal=causal, block_q=bq, block_k=bk)
        out["sdpa"] = lambda q, k, v: tnf.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out


def _child(spec: dict) -> None:
    """Measure every case of one sequence length; print one JSON line per case."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    t, h, d, b = spec["t"], spec["heads"], spec["head_dim"], spec["batch"]
    for variant in spec["variants"]:
        impls = _impls(variant, t, spec)
        if spec.get("only"):
            impls = {k: v for k, v in impls.items() if k in spec["only"]}
        for pss in spec["passes"]:
            bwd = pss == "fwd+bwd"
            q, k, v = (torch.randn(b, h, t, d, requires_grad=bwd) for _ in range(3))

            def call(fn, q=q, k=k, v=v, bwd=bwd):
                out = fn(q, k, v)
                if bwd:
                    out.backward(torch.ones_like(out))
                    q.grad = k.grad = v.grad = None

            memory, first = {}, {}
            for name, fn in impls.items():  # the memory call doubles as the warm-up
                t0 = time.perf_counter()
                memory[name] = _peak_extra_mib(lambda fn=fn: call(fn))
                first[name] = time.perf_counter() - t0
            times: dict[str, list[float]] = {name: [] for name in impls}
            repeats = spec["repeats"] if max(first.values()) < 20 else min(1, spec["repeats"])
            if repeats == 0:  # memory-only run: the one call is the time sample
                times = {name: [first[name]] for name in impls}
            for _ in range(repeats):
                for name, fn in impls.items():
                    t0 = time.perf_counter()
                    call(fn)
                    times[name].append(time.perf_counter() - t0)
            for name in impls:
                row = {
                    "t": t,
                    "heads": h,
                    "head_dim": d,
                    "batch": b,
                    "variant": variant,
                    "pass": pss,
                    "impl": name,
                    "median_s": statistics.median(times[name]),
                    "times_s": times[name],
                    "extra_mib": memory[name],
                    "visible_fraction": _visible_fraction(variant, t, spec["window"]),
                }
                print(json.dumps(row), flush=True)


# ---------------------------------------------------------------------------------------------- parent


def _specs(cfg: BenchConfig) -> list[dict]:
    base = {
        "heads": cfg.heads,
        "head_dim": cfg.head_dim,
        "batch": cfg.batch,
        "window": cfg.window,
        "repeats": cfg.repeats,
        "reference_max_t": cfg.reference_max_t,
        "block_q": cfg.block_q,
        "block_k": cfg.block_k,
        "threads": cfg.threads,
        "passes": list(cfg.passes),
    }
    specs = []
    for t in cfg.sizes:
        variants = [v for v in cfg.variants if v != "window" or t >= cfg.window_min_t]
        specs.append({**base, "t": t, "variants": variants})
    if cfg.long_t:
        specs.append(
            {
                **base,
                "t": cfg.long_t,
                "heads": 1,
                "variants": ["dense"],
                "passes": ["fwd+bwd"],
                "repeats": 0,  # one call: its time and its memory
                "only": list(cfg.long_impls),
            }
        )
    return specs


def _count_cases(spec: dict, cfg: BenchConfig) -> int:
    n_impl = len(spec["only"]) if spec.get("only") else (3 if spec["t"] <= cfg.reference_max_t else 2)
    return len(spec["variants"]) * len(spec["passes"]) * n_impl


def run_bench(cfg: BenchConfig, *, progress: bool = True, log=None) -> dict:
    """Run the benchmark; returns ``{"meta": {...}, "rows": [...]}`` (see the module docstring)."""
    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    specs = _specs(cfg)
    total = sum(_count_cases(s, cfg) for s in specs) + 1
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
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
        task = bar.add_task("matmul peak", total=total)
        meta["matmul_peak_gflops"] = matmul_peak_gflops(cfg.peak_size)
        bar.advance(task)
        for spec in specs:
            bar.update(task, description=f"T={spec['t']} H={spec['heads']}")
            if spec["t"] > cfg.reference_max_t and not spec.get("only"):
                meta["skipped"].append(
                    f"reference at T={spec['t']}: materialises {spec['heads']}×T² scores "
                    f"({spec['heads'] * spec['t'] ** 2 * 4 / 2**30:.1f} GiB per copy, several copies)"
                )
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            cmd = [sys.executable, "-m", "selfattention.bench", "--child", json.dumps(spec)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                row = json.loads(line)
                rows.append(row)
                bar.advance(task)
                if log is not None:
                    log(row)
            err = proc.stderr.read() if proc.stderr else ""
            if proc.wait() != 0:
                meta["skipped"].append(f"T={spec['t']}: child failed: {err.strip().splitlines()[-1:]}")
    meta["load_avg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    peak = meta["matmul_peak_gflops"]
    for row in rows:
        fwd_flops = 4 * row["t"] ** 2 * row["head_dim"] * row["heads"] * row["batch"]
        flops = fwd_flops * (3.5 if row["pass"] == "fwd+bwd" else 1.0)
        if row["impl"] == "tiled":
            flops *= row["visible_fraction"]  # work the tiled path has to do
        row["gflops"] = flops / row["median_s"] / 1e9
        row["pct_peak"] = 100 * row["gflops"] / peak
    _ratios(rows)
    return {"meta": meta, "rows": rows}


def _ratios(rows: list[dict]) -> None:
    by = {(r["t"], r["heads"], r["variant"], r["pass"], r["impl"]): r for r in rows}
    for r in rows:
        if r["impl"] == "tiled":
            base = by.get((r["t"], r["heads"], r["variant"], r["pass"], "sdpa"))
            r["ratio_vs_sdpa"] = r["median_s"] / base["median_s"] if base else None


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def to_markdown(result: dict) -> str:
    """The result as a markdown table, one line per (T, mask, pass)."""
    rows = result["rows"]
    meta = result["meta"]
    by = {(r["t"], r["heads"], r["variant"], r["pass"], r["impl"]): r for r in rows}
    keys = []
    for r in rows:
        key = (r["t"], r["heads"], r["variant"], r["pass"])
        if key not in keys:
            keys.append(key)
    lines = [
        "| T | H | mask | pass | reference | tiled | SDPA | tiled/SDPA | tiled GFLOP/s | % peak "
        "| tiled extra MiB | SDPA extra MiB | reference extra MiB |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t, h, variant, pss in keys:
        ref, til, sd = (by.get((t, h, variant, pss, name)) for name in ("reference", "tiled", "sdpa"))
        mask = {"dense": "none", "causal": "causal", "window": f"window {meta['config']['window']}"}[variant]
        sd_name = "" if variant != "window" else " (bool mask)"
        ratio = til.get("ratio_vs_sdpa") if til else None

        def mib(r):
            return "—" if not r or r.get("extra_mib") is None else f"{r['extra_mib']:.0f}"

        lines.append(
            f"| {t} | {h} | {mask} | {pss} | {_fmt_s(ref['median_s']) if ref else 'skipped'} "
            f"| {_fmt_s(til['median_s']) if til else '—'} | {_fmt_s(sd['median_s']) + sd_name if sd else '—'} "
            f"| {'—' if ratio is None else f'{ratio:.2f}'} | {til['gflops']:.1f} | {til['pct_peak']:.0f}% "
            f"| {mib(til)} | {mib(sd)} | {mib(ref)} |"
            if til
            else f"| {t} | {h} | {mask} | {pss} | — | — | — | — | — | — | — | — | — |"
        )
    lines.append("")
    lines.append(
        f"float32 matmul peak measured in the same run: {meta['matmul_peak_gflops']:.0f} GFLOP/s "
        f"({meta['threads']} threads, torch {meta['torch']}); load average at start/end "
        f"{_load(meta.get('load_avg_start'))} / {_load(meta.get('load_avg_end'))}."
    )
    for s in meta.get("skipped", []):
        lines.append(f"Skipped: {s}.")
    return "\n".join(lines) + "\n"


def _load(x) -> str:
    return "n/a" if not x else f"{x[0]:.1f}"


def write_results(result: dict, out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``bench.json`` and ``bench.md`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / "bench.json", out / "bench.md"
    jp.write_text(json.dumps(result, indent=1, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))
    mp.write_text(to_markdown(result))
    return jp, mp


if __name__ == "__main__":  # the child process
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(json.loads(sys.argv[2]))
    else:
        print("usage: python -m selfattention.bench --child SPEC (used by `selfattention bench`)")
        sys.exit(2)
