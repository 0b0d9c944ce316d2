"""The written results of ``selfattention bench``: the markdown table (and the contended one beside it),
``bench.json`` and ``bench.md``, and the small formatters the terminal summary shares with them.

A result is ``{"meta": {...}, "rows": [...]}`` (:func:`selfattention.bench.run_bench`): one row per case
and implementation; a case is keyed by (T, H, variant, pass) (:func:`case_key`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .bench_cases import MASKED_VARIANTS, STATS_VARIANTS

__all__ = [
    "by_case",
    "case_key",
    "contention_table",
    "fmt_ratio",
    "fmt_seconds",
    "mask_name",
    "to_markdown",
    "write_results",
]


def case_key(r: dict) -> tuple:
    """(T, H, variant, pass) of a row: the case it measured."""
    return (r["t"], r["heads"], r["variant"], r["pass"])


def by_case(rows: list[dict]) -> dict[tuple, dict]:
    """The rows keyed by (T, H, variant, pass, implementation)."""
    return {(*case_key(r), r["impl"]): r for r in rows}


def fmt_seconds(x: float | None) -> str:
    """A time for a table: ``12.3 ms`` under a second, ``1.23 s`` from one, ``—`` for None."""
    if x is None:
        return "—"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def fmt_ratio(x: float | None) -> str:
    """A ratio for a table, two decimals (``—`` for None)."""
    return "—" if x is None else f"{x:.2f}"


def mask_name(variant: str, meta: dict) -> str:
    """The case's mask as the markdown table names it (``window 512``, ``8 documents``, …)."""
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
    by = by_case(rows)
    keys: list[tuple] = []
    for r in rows:
        if case_key(r) not in keys:
            keys.append(case_key(r))
    lines = [
        "| T | H | mask | pass | tiled | SDPA | flex (compiled) | tiled/SDPA | tiled/flex | tiled extra MiB "
        "| SDPA extra MiB | tiled GFLOP/s | kernel, plan |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]

    def mib(r):
        return "—" if not r or r.get("extra_mib") is None else f"{r['extra_mib']:.0f}"

    for key in keys:
        t, h, variant, pss = key
        til, sd, fx = (by.get((*key, name)) for name in ("tiled", "sdpa", "flex"))
        if til is None:
            continue
        sd_txt = "—" if sd is None else fmt_seconds(sd["median_s"])
        if sd is not None and variant in MASKED_VARIANTS:
            sd_txt += " (bool mask, 1 run)"
        if sd is not None and variant in STATS_VARIANTS:
            sd_txt += " (causal fwd)"
        fx_txt = (
            "—" if fx is None else f"{fmt_seconds(fx['median_s'])} (compile {fx.get('compile_s', 0):.0f} s)"
        )
        plan = f"{til['kernel']}, {til['strategy']} ({til['calls']} call{'s' if til['calls'] != 1 else ''})"
        if til["kernel"] != "vendor":
            plan += f": {til['reason']}"
        lines.append(
            f"| {t} | {h} | {mask_name(variant, meta)} | {pss} | {fmt_seconds(til['median_s'])} | {sd_txt} "
            f"| {fx_txt} | {fmt_ratio(til.get('ratio_vs_sdpa'))} | {fmt_ratio(til.get('ratio_vs_flex'))} "
            f"| {mib(til)} | {mib(sd)} | {til['gflops']:.1f} | {plan} |"
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
        lines += ["", *contention_table(rows, meta)]
    return "\n".join(lines) + "\n"


def contention_table(rows: list[dict], meta: dict) -> list[str]:
    """Quiet and contended (one core kept busy) ratios side by side, from the same rounds."""
    lines = [
        "Contended (a spinner keeps one core busy in every other pass of each round; same process):",
        "",
        "| T | H | mask | pass | tiled quiet | tiled busy | SDPA quiet | SDPA busy | tiled/SDPA quiet "
        "| tiled/SDPA busy | busy/quiet ratio | tiled/flex quiet | tiled/flex busy |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    by = by_case(rows)
    f = fmt_ratio
    for r in rows:
        if r["impl"] != "tiled" or "median_s_contended" not in r:
            continue
        sd = by.get((*case_key(r), "sdpa"), {})
        t, h, variant, pss = case_key(r)
        lines.append(
            f"| {t} | {h} | {mask_name(variant, meta)} | {pss} | {fmt_seconds(r['median_s'])} "
            f"| {fmt_seconds(r['median_s_contended'])} | {fmt_seconds(sd.get('median_s'))} "
            f"| {fmt_seconds(sd.get('median_s_contended'))} | {f(r.get('ratio_vs_sdpa'))} "
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
