"""``selfattention bench``: the tiled path against torch SDPA and flex_attention, in one run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.table import Table

from ..i18n import N_, _
from . import UsageError, console
from ._notes import output_folder


def _ints(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise UsageError(
            _("--{name} must be comma-separated integers, got {value!r}").format(name=name, value=text)
        ) from None
    if not values or min(values) <= 0:
        raise UsageError(_("--{name} must be positive integers, got {value!r}").format(name=name, value=text))
    return values


def _subset(name: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    chosen = tuple(x.strip() for x in text.split(",") if x.strip())
    if not chosen or any(x not in allowed for x in chosen):
        raise UsageError(
            _("--{name} takes a subset of {allowed}, got {value!r}").format(
                name=name, allowed=",".join(allowed), value=text
            )
        )
    return chosen


_HELP = N_(
    "Time the tiled path against torch SDPA and flex_attention: median time, ratios, memory, kernel.\n\n"
    "B = 1, H = 8, D = 64, float32, default threads: dense and causal at T = 1024 and 4096; a sliding "
    "window (W = 512) and 8 packed documents at T = 16384 (SDPA gets the same bool mask); statistics; "
    "forward and forward + backward (flex has no CPU backward). Writes a markdown table and JSON."
)


#: a case's mask as the summary shows it
_MASKS = {
    "dense": N_("none"),
    "causal": N_("causal"),
    "window": N_("window {window}"),
    "documents": N_("{documents} documents"),
    "stats": N_("causal, stats"),
    "stats0": N_("causal, entropy + column sums"),
}


def summary_table(result: dict) -> Table:
    """The terminal's view of a bench result: a row per case with the times and the ratios, narrow enough
    for 80 columns (the full markdown table, with memory, GFLOP/s and the plan, is in bench.md)."""
    from ..bench_table import by_case, case_key, fmt_ratio, fmt_seconds

    rows = result["rows"]
    by = by_case(rows)
    table = Table(box=None, pad_edge=False, show_edge=False)
    flex = any(r["impl"] == "flex" for r in rows)  # no flex columns when flex was left out (--no-flex)
    heads = [_("T"), _("mask"), _("pass"), _("tiled"), _("SDPA")] + ([_("flex")] if flex else [])
    heads += [_("tiled/SDPA")] + ([_("tiled/flex")] if flex else [])
    for head in heads:
        table.add_column(head, justify="left" if head in (_("mask"), _("pass")) else "right", no_wrap=True)
    seen = []
    for r in rows:
        key = case_key(r)
        if key in seen or (*key, "tiled") not in by:
            continue
        seen.append(key)
        til, sd, fx = (by.get((*key, impl)) for impl in ("tiled", "sdpa", "flex"))

        def secs(row: dict | None) -> str:
            return fmt_seconds(None if row is None else row.get("median_s"))

        cfg = result["meta"]["config"]
        mask = _(_MASKS.get(key[2], key[2])).format(window=cfg.get("window"), documents=cfg.get("documents"))
        cells = [str(key[0]), mask, key[3], secs(til), secs(sd)] + ([secs(fx)] if flex else [])
        ratios = [til.get("ratio_vs_sdpa")] + ([til.get("ratio_vs_flex")] if flex else [])
        cells += [fmt_ratio(x) for x in ratios]
        table.add_row(*cells)
    return table


def register(app: typer.Typer) -> None:
    @app.command("bench", help=_HELP)
    def bench(
        quick: bool = typer.Option(
            False,
            "--quick",
            help=N_(
                "CI-sized run (T = 128, 256 and 512; H = 2; D = 32; no flex compile): about 30 s of CPU "
                "time, longer on a busy machine (2 min 12 s on a shared 2-core machine at load 10); the "
                "run prints how long it took."
            ),
        ),
        long: bool = typer.Option(
            False,
            "--long",
            help=N_("Add the memory case: causal forward + backward at T = 65536, H = 1 (minutes)."),
        ),
        out: Path = typer.Option(
            Path("out/bench"),
            "--out",
            help=N_("Folder for bench.json and bench.md (the committed figures are in benchmarks/results)."),
        ),
        sizes: str | None = typer.Option(
            None, "--sizes", help=N_("Comma-separated T for the dense and causal cases. Default: 1024,4096.")
        ),
        long_t: int | None = typer.Option(
            None,
            "--long-t",
            help=N_("T of the window, documents and stats cases. Default: 16384 (stats at 4096)."),
        ),
        memory_t: int | None = typer.Option(
            None, "--memory-t", help=N_("T of the memory case (implies it). Default with --long: 65536.")
        ),
        repeats: int | None = typer.Option(
            None,
            "--repeats",
            help=N_("Timed rounds per case. Default: 3 (2 with --quick); 0: the memory call only."),
        ),
        variants: str | None = typer.Option(
            None,
            "--variants",
            help=N_(
                "Subset of dense,causal,window,documents,stats,stats0 (stats0: entropy and column sums without top-k). Default: all."
            ),
        ),
        passes: str | None = typer.Option(None, "--passes", help=N_("Subset of fwd,fwd+bwd. Default: both.")),
        heads: int | None = typer.Option(
            None, "--heads", help=N_("Attention heads. Default: 8 (2 with --quick).")
        ),
        threads: int | None = typer.Option(
            None, "--threads", help=N_("torch threads. Default: torch's own choice.")
        ),
        block_q: int | None = typer.Option(
            None, "--block-q", help=N_("Query rows per block of the tiled plan.")
        ),
        block_k: int | None = typer.Option(
            None, "--block-k", help=N_("Key columns per block of the tiled plan.")
        ),
        no_flex: bool = typer.Option(
            False, "--no-flex", help=N_("Leave flex_attention out (saves its compile time).")
        ),
        contended: bool = typer.Option(
            False,
            "--contended",
            help=N_(
                "Also time every round with one core kept busy by a background spinner (started and "
                "killed by the benchmark) and print quiet and contended ratios side by side."
            ),
        ),
    ) -> None:
        from ..bench import VARIANTS, BenchConfig, run_bench, to_markdown, write_results

        cfg = BenchConfig.quick() if quick else BenchConfig()
        if sizes is not None:
            cfg.sizes = _ints("sizes", sizes)
        if variants is not None:
            cfg.variants = _subset("variants", variants, VARIANTS)
        if passes is not None:
            cfg.passes = _subset("passes", passes, ("fwd", "fwd+bwd"))
        for name, value in (
            ("heads", heads),
            ("threads", threads),
            ("block-q", block_q),
            ("block-k", block_k),
        ):
            if value is not None and value <= 0:
                raise UsageError(
                    _("--{name} must be a positive integer, got {value}").format(name=name, value=value)
                )
        for name, value in (("long-t", long_t), ("memory-t", memory_t)):
            if value is not None and value <= 1:
                raise UsageError(
                    _("--{name} must be an integer > 1, got {value}").format(name=name, value=value)
                )
        if repeats is not None and repeats < 0:
            raise UsageError(_("--repeats must be >= 0, got {value}").format(value=repeats))
        cfg.threads = threads
        cfg.heads = heads or cfg.heads
        cfg.long_t = long_t or cfg.long_t
        cfg.memory_t = memory_t or (65536 if long else None)
        if repeats is not None:
            cfg.repeats = cfg.slow_repeats = repeats
        cfg.block_q, cfg.block_k = block_q, block_k
        cfg.flex = cfg.flex and not no_flex
        cfg.contended = contended

        output_folder("--out", out)  # before the rounds, not after them
        partial = out / "bench.partial.jsonl"

        def keep(row: dict) -> None:  # rows so far, in case a long run is cut short
            out.mkdir(parents=True, exist_ok=True)
            with partial.open("a") as f:
                f.write(json.dumps(row) + "\n")

        partial.unlink(missing_ok=True)
        start = time.perf_counter()
        result = run_bench(cfg, progress=True, log=keep)
        json_path, md_path = write_results(result, out)
        partial.unlink(missing_ok=True)  # the complete results replace it
        console.print(summary_table(result))
        console.print(to_markdown(result).split("\n\n", 1)[-1].strip(), markup=False, highlight=False)
        console.print(
            _(
                "took {seconds:.0f} s; wrote {json} and {md} (the full table: memory, GFLOP/s, kernel and plan)"
            ).format(seconds=time.perf_counter() - start, json=json_path, md=md_path),
            markup=False,
            highlight=False,
        )
