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
exits by itself after ``_SPIN_LIMIT_S`` and is killed at the end) — and every round times each
implementation twice, once with the spinner stopped (SIGSTOP) and once with it running (SIGCONT), so the
quiet and the contended ratios come from the same process and the same minutes of a shared machine.
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

__all__ = ["BenchConfig", "run_bench", "to_markdown", "write_results", "matmul_peak_gflops", "VARIANTS"]

VARIANTS = ("dense", "causal", "window", "documents", "stats", "stats0")
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
        fn()
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


def _visible_fraction(spec: dict) -> float:
    t, variant = spec["t"], spec["variant"]
    if variant == "dense":
        return 1.0
    if variant in ("causal", "stats", "stats0"):
        return (t + 1) / (2 * t)
    if variant == "window":
        w = min(spec["window"], t)
        return (w * t - w * (w - 1) / 2) / t**2
    return 1.0 / spec["documents"]


def _masks(spec: dict):
    """(tiled kwargs, dense bool mask or None, flex mask_mod or None) of the case's visibility."""
    import torch

    from . import masks

    t, variant = spec["t"], spec["variant"]
    if variant == "dense":
        return {}, None, None
    if variant in ("causal", "stats", "stats0"):
        return {"is_causal": True}, None, lambda b, h, q, kv: q >= kv
    if variant == "window":
        w = spec["window"]
        return (
            {"window": w},
            masks.sliding_window_mask(t, window=w),
            lambda b, h, q, kv: (q >= kv) & (q - kv < w),
        )
    ids = torch.arange(spec["documents"]).repeat_interleave(t // spec["documents"])
    ids = torch.cat([ids, ids.new_full((t - ids.numel(),), spec["documents"] - 1)])
    return {"document_ids": ids}, masks.document_mask(ids), lambda b, h, q, kv: ids[q] == ids[kv]


def _impls(spec: dict) -> tuple[dict[str, Any], dict[str, str]]:
    """name → callable(q, k, v) for one case, and the reasons peers are left out."""
    import torch
    import torch.nn.functional as tnf

    from . import functional
    from .tiled import tiled_attention, tiled_attention_with_stats

    t, variant, bwd = spec["t"], spec["variant"], spec["pass"] == "fwd+bwd"
    blocks = {"block_q": spec.get("block_q"), "block_k": spec.get("block_k")}
    kw, dense_mask, mask_mod = _masks(spec)
    out: dict[str, Any] = {}
    missing: dict[str, str] = {}
    if variant in ("stats", "stats0"):  # stats0: output, entropy and column sums, no top-k
        top_k = spec["top_k"] if variant == "stats" else 0
        out["tiled"] = lambda q, k, v: tiled_attention_with_stats(q, k, v, top_k=top_k, **kw, **blocks)
        out["sdpa"] = lambda q, k, v: tnf.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out, missing
    if t <= spec["reference_max_t"] and dense_mask is None:
        out["reference"] = lambda q, k, v: functional.scaled_dot_product_attention(q, k, v, **kw)
    out["tiled"] = lambda q, k, v: tiled_attention(q, k, v, **kw, **blocks)
    if dense_mask is None:
        out["sdpa"] = lambda q, k, v: tnf.scaled_dot_product_attention(q, k, v, is_causal=variant == "causal")
    else:
        out["sdpa"] = lambda q, k, v: tnf.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)
    if mask_mod is not None and spec["flex"]:
        if bwd:
            missing["flex"] = "flex_attention has no CPU backward"
        else:
            try:
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            except ImportError as e:
                missing["flex"] = f"flex_attention unavailable in torch {torch.__version__}: {e}"
            else:
                block_mask = create_block_mask(mask_mod, None, None, t, t, device="cpu")
                compiled = torch.compile(flex_attention)
                out["flex"] = lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
    return out, missing


_SPIN_LIMIT_S = 3600.0  # a spinner left behind by a killed run stops by itself
_SPIN = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"


class Spinner:
    """A child process spinning on one core (the background load of ``--contended``), paused at start.

    ``busy(True)`` lets it run, ``busy(False)`` stops it (SIGSTOP); :meth:`close` kills it. Use as a
    context manager so that it dies with the measurement."""

    def __init__(self, limit_s: float = _SPIN_LIMIT_S) -> None:
        import signal

        self._signal = signal
        self.proc = subprocess.Popen([sys.executable, "-c", _SPIN.format(limit=float(limit_s))])
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(cpus) > 1:
            try:
                os.sched_setaffinity(self.proc.pid, {cpus[-1]})
            except OSError:
                pass
        self.busy(False)

    def busy(self, on: bool) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, self._signal.SIGCONT if on else self._signal.SIGSTOP)
            if on:
                time.sleep(0.05)  # let the scheduler see it

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> Spinner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _child(spec: dict) -> None:
    """Measure one case; print one JSON line per implementation."""
    import torch

    from .tiled import describe

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    t, h, d, b = spec["t"], spec["heads"], spec["head_dim"], spec["batch"]
    bwd = spec["pass"] == "fwd+bwd"
    q, k, v = (torch.randn(b, h, t, d, requires_grad=bwd) for _ in range(3))
    impls, missing = _impls(spec)
    kw, _, _ = _masks(spec)
    plan = describe(q, k, v, **kw, block_q=spec.get("block_q"), block_k=spec.get("block_k"))

    def call(fn):
        out = fn(q, k, v)
        out = out[0] if isinstance(out, tuple) else out
        if bwd:
            out.backward(torch.ones_like(out))
            q.grad = k.grad = v.grad = None

    memory, first = {}, {}
    for name, fn in impls.items():  # the memory call doubles as the warm-up (and flex's compile)
        t0 = time.perf_counter()
        memory[name] = _peak_extra_mib(lambda fn=fn: call(fn))
        first[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in impls}
    busy_times: dict[str, list[float]] = {name: [] for name in impls}
    repeats = spec["repeats"]
    if repeats == 0:  # memory-only run: the one call is the time sample
        times = {name: [first[name]] for name in impls}
    # SDPA given a dense (T, T) bool mask at T = 16384 takes minutes a round: its warm-up call is its one
    # sample (the tiled path and flex still get every round)
    once = {"sdpa"} if spec["variant"] in ("window", "documents") and repeats else set()
    for name in once:
        times[name] = [first[name]]
    contended = bool(spec.get("contended")) and repeats > 0
    spinner = Spinner() if contended else None
    try:
        for _ in range(repeats):
            for mode in ("quiet", "busy") if contended else ("quiet",):
                if spinner is not None:
                    spinner.busy(mode == "busy")
                for name, fn in impls.items():
                    samples = (busy_times if mode == "busy" else times)[name]
                    if name in once and (mode == "quiet" or samples):  # the slow peer: one busy sample
                        continue
                    t0 = time.perf_counter()
                    call(fn)
                    samples.append(time.perf_counter() - t0)
    finally:
        if spinner is not None:
            spinner.close()
    for name in impls:
        med = statistics.median(times[name])
        row = {
            **{key: spec[key] for key in ("t", "heads", "head_dim", "batch", "variant", "pass")},
            "impl": name,
            "median_s": med,
            "times_s": times[name],
            "extra_mib": memory[name],
            "visible_fraction": _visible_fraction(spec),
            "threads": torch.get_num_threads(),
        }
        if busy_times[name]:
            row["median_s_contended"] = statistics.median(busy_times[name])
            row["times_s_contended"] = busy_times[name]
        if name == "flex":
            row["compile_s"] = max(0.0, first[name] - med)
        if name == "tiled":
            row.update(kernel=plan.kernel, reason=plan.reason, strategy=plan.strategy, calls=plan.calls)
        print(json.dumps(row), flush=True)
    for name, why in missing.items():
        print(
            json.dumps(
                {
                    **{key: spec[key] for key in ("t", "heads", "variant", "pass")},
                    "impl": name,
                    "missing": why,
                }
            )
        )


# ---------------------------------------------------------------------------------------------- parent


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
    for variant in ("window", "documents"):
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


def _key(r: dict) -> tuple:
    return (r["t"], r["heads"], r["variant"], r["pass"])


def _ratios(rows: list[dict]) -> None:
    by = {(*_key(r), r["impl"]): r for r in rows}
    for r in rows:
        if r["impl"] == "tiled":
            for peer in ("sdpa", "flex"):
                base = by.get((*_key(r), peer))
                r[f"ratio_vs_{peer}"] = r["median_s"] / base["median_s"] if base else None
                if base and "median_s_contended" in r and "median_s_contended" in base:
                    busy = r["median_s_contended"] / base["median_s_contended"]
                    r[f"ratio_vs_{peer}_contended"] = busy
                    r[f"contention_vs_{peer}"] = busy / r[f"ratio_vs_{peer}"]


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def _mask_name(variant: str, meta: dict) -> str:
    cfg = meta["config"]
    return {
        "dense": "none",
        "causal": "causal",
        "window": f"window {cfg['window']}",
        "documents": f"{cfg['documents']} documents",
        "stats": f"causal, stats (top-{cfg['top_k']})",
        "stats0": "causal, entropy + column sums",
    }[variant]


def to_markdown(result: dict) -> str:
    """The result as a markdown table, one line per case, with the ratios against the peers."""
    rows, meta = result["rows"], result["meta"]
    by = {(*_key(r), r["impl"]): r for r in rows}
    keys: list[tuple] = []
    for r in rows:
        if _key(r) not in keys:
            keys.append(_key(r))
    lines = [
        "| T | H | mask | pass | tiled | SDPA | flex (compiled) | tiled/SDPA | tiled/flex | tiled extra MiB "
        "| SDPA extra MiB | tiled GFLOP/s | kernel, plan |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]

    def mib(r):
        return "—" if not r or r.get("extra_mib") is None else f"{r['extra_mib']:.0f}"

    def ratio(x):
        return "—" if x is None else f"{x:.2f}"

    for key in keys:
        t, h, variant, pss = key
        til, sd, fx = (by.get((*key, name)) for name in ("tiled", "sdpa", "flex"))
        if til is None:
            continue
        sd_txt = "—" if sd is None else _fmt_s(sd["median_s"])
        if sd is not None and variant in ("window", "documents"):
            sd_txt += " (bool mask, 1 run)"
        if sd is not None and variant in ("stats", "stats0"):
            sd_txt += " (causal fwd)"
        fx_txt = "—" if fx is None else f"{_fmt_s(fx['median_s'])} (compile {fx.get('compile_s', 0):.0f} s)"
        plan = f"{til['kernel']}, {til['strategy']} ({til['calls']} call{'s' if til['calls'] != 1 else ''})"
        if til["kernel"] != "vendor":
            plan += f": {til['reason']}"
        lines.append(
            f"| {t} | {h} | {_mask_name(variant, meta)} | {pss} | {_fmt_s(til['median_s'])} | {sd_txt} | {fx_txt} "
            f"| {ratio(til.get('ratio_vs_sdpa'))} | {ratio(til.get('ratio_vs_flex'))} | {mib(til)} | {mib(sd)} "
            f"| {til['gflops']:.1f} | {plan} |"
        )
    lines.append("")
    lines.append(
        f"float32 matmul peak measured in the same run: {meta['matmul_peak_gflops']:.0f} GFLOP/s "
        f"({meta['threads']} threads, torch {meta['torch']}); load average at start/end "
        f"{_load(meta.get('load_avg_start'))} / {_load(meta.get('load_avg_end'))}."
    )
    for s in meta.get("skipped", []):
        lines.append(f"Left out: {s}.")
    if any("ratio_vs_sdpa_contended" in r for r in rows):
        lines += ["", *_contention_table(rows, meta)]
    return "\n".join(lines) + "\n"


def _contention_table(rows: list[dict], meta: dict) -> list[str]:
    """Quiet and contended (one core kept busy) ratios side by side, from the same rounds."""
    lines = [
        "Contended (a spinner keeps one core busy in every other pass of each round; same process):",
        "",
        "| T | H | mask | pass | tiled quiet | tiled busy | SDPA quiet | SDPA busy | tiled/SDPA quiet "
        "| tiled/SDPA busy | busy/quiet ratio | tiled/flex quiet | tiled/flex busy |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by = {(*_key(r), r["impl"]): r for r in rows}

    def f(x):
        return "—" if x is None else f"{x:.2f}"

    for r in rows:
        if r["impl"] != "tiled" or "median_s_contended" not in r:
            continue
        sd = by.get((*_key(r), "sdpa"), {})
        t, h, variant, pss = _key(r)
        lines.append(
            f"| {t} | {h} | {_mask_name(variant, meta)} | {pss} | {_fmt_s(r['median_s'])} "
            f"| {_fmt_s(r['median_s_contended'])} | {_fmt_s(sd.get('median_s'))} "
            f"| {_fmt_s(sd.get('median_s_contended'))} | {f(r.get('ratio_vs_sdpa'))} "
            f"| {f(r.get('ratio_vs_sdpa_contended'))} | {f(r.get('contention_vs_sdpa'))} "
            f"| {f(r.get('ratio_vs_flex'))} | {f(r.get('ratio_vs_flex_contended'))} |"
        )
    return lines


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
