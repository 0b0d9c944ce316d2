"""``selfattention bench``: tiled attention against torch SDPA (and the reference), in one run."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from . import UsageError, console


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench(
        quick: bool = typer.Option(
            False, "--quick", help="CI-sized run (T = 128, 256; H = 2; D = 32): seconds."
        ),
        out: Path = typer.Option(
            Path("out/bench"),
            "--out",
            help="Folder for bench.json and bench.md (the committed figures are in benchmarks/results).",
        ),
        sizes: str = typer.Option(
            "", "--sizes", help="Comma-separated sequence lengths (default 512…16384)."
        ),
        repeats: int = typer.Option(
            -1,
            "--repeats",
            help="Timed rounds per case (default 3; 2 with --quick; 0: the memory call only).",
        ),
        long_t: int = typer.Option(
            -1, "--long-t", help="Length of the H = 1 memory case (default 65536; 0 skips it)."
        ),
        variants: str = typer.Option("", "--variants", help="Subset of dense,causal,window (default all)."),
        passes: str = typer.Option("", "--passes", help="Subset of fwd,fwd+bwd (default both)."),
        heads: int = typer.Option(0, "--heads", help="Attention heads (default 8; 2 with --quick)."),
        threads: int = typer.Option(0, "--threads", help="torch threads (default: torch's own choice)."),
        block_q: int = typer.Option(
            0, "--block-q", help="Query rows per block of the tiled path (0: default)."
        ),
        block_k: int = typer.Option(
            0, "--block-k", help="Key columns per chunk of the tiled path (0: default)."
        ),
    ) -> None:
        """Time tiled attention against torch SDPA: median time, ratio, GFLOP/s, % of matmul peak, memory.

        T = 512 … 16384, B = 1, H = 8, D = 64, float32; dense, causal and a sliding window (W = 512,
        SDPA given the same bool mask); forward and forward + backward. Writes a markdown table and JSON.
        """
        from ..bench import BenchConfig, run_bench, to_markdown, write_results

        cfg = BenchConfig.quick() if quick else BenchConfig()
        if sizes:
            try:
                cfg.sizes = tuple(int(s) for s in sizes.split(",") if s.strip())
            except ValueError:
                raise UsageError(f"--sizes must be comma-separated integers, got {sizes!r}") from None
            if not cfg.sizes or min(cfg.sizes) <= 0:
                raise UsageError(f"--sizes must be positive integers, got {sizes!r}")
        for name, given, allowed in (
            ("variants", variants, ("dense", "causal", "window")),
            ("passes", passes, ("fwd", "fwd+bwd")),
        ):
            if given:
                chosen = tuple(x.strip() for x in given.split(",") if x.strip())
                if not chosen or any(x not in allowed for x in chosen):
                    raise UsageError(f"--{name} takes a subset of {','.join(allowed)}, got {given!r}")
                setattr(cfg, name, chosen)
                if name == "variants" and "window" in chosen:
                    cfg.window_min_t = 0
        if heads < 0 or block_q < 0 or block_k < 0 or threads < 0:
            raise UsageError("--heads, --threads, --block-q and --block-k must be >= 0")
        cfg.threads = threads or None
        cfg.heads = heads or cfg.heads
        if repeats >= 0:
            cfg.repeats = repeats
        if long_t >= 0:
            cfg.long_t = long_t or None
        cfg.block_q = block_q or None
        cfg.block_k = block_k or None
        partial: dict = {"rows": []}

        def keep(row: dict) -> None:  # a partial JSON after every case, in case a long run is cut short
            partial["rows"].append(row)
            out.mkdir(parents=True, exist_ok=True)
            with (out / "bench.partial.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")

        (out / "bench.partial.jsonl").unlink(missing_ok=True)
        result = run_bench(cfg, progress=True, log=keep)
        json_path, md_path = write_results(result, out)
        console.print(to_markdown(result), markup=False, highlight=False, soft_wrap=True)
        console.print(f"wrote {json_path} and {md_path}")
