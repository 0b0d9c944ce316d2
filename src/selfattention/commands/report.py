"""``selfattention report``: one self-contained HTML file of a text's attention (or a worked example's).

selfattention report "The animal didn't cross the street because it was too tired." --out report.html
selfattention report --file essay.txt --out essay.html --head 4.7
selfattention report --example journey --out journey.html
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import typer

from . import UsageError, console

_HELP = (
    "Write one self-contained HTML report (no network, opens from disk): the tokens, a layer × head grid, "
    "a large heatmap with exact weights on hover, the trace tables of a head and per-head statistics."
)


def _parse_head(spec: str | None) -> tuple[int, int] | None:
    if spec is None:
        return None
    try:
        layer, head = (int(p) for p in spec.split("."))
    except ValueError:
        raise UsageError(f"--head must be LAYER.HEAD with 0-based integers, e.g. 3.7; got {spec!r}") from None
    return layer, head


def _human(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def register(app: typer.Typer) -> None:
    @app.command("report", help=_HELP)
    def report(
        text: str | None = typer.Argument(None, help="The text to run through all-MiniLM-L6-v2."),
        out: Path = typer.Option(Path("report.html"), "--out", "-o", help="Where to write the HTML file."),
        file: Path | None = typer.Option(None, "--file", "-f", help="Read the text from this UTF-8 file."),
        example: str | None = typer.Option(
            None, "--example", "-e", help="A lecture's worked example (journey, two-token) or a TOML path."
        ),
        head: str | None = typer.Option(
            None,
            "--head",
            help="LAYER.HEAD (0-based) selected on opening and stored exactly. Default: the "
            "most focused head that does not park its weight on [CLS]/[SEP].",
        ),
        token: int | None = typer.Option(None, "--token", help="Query token selected on opening (0-based)."),
        max_length: int = typer.Option(
            512, "--max-length", help="Cut the text to this many tokens (2..512)."
        ),
        png: Path | None = typer.Option(
            None,
            "--png",
            help="Also save a static PNG (matplotlib): every head as a grid, or the example's heatmap.",
        ),
        exact_mb: float = typer.Option(
            8.0, "--exact-mb", help="Megabytes allowed for exact per-head traces (the rest: 8-bit colours)."
        ),
    ) -> None:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from ..report import example_report, model_report, write_report

        sources = [s for s in (text is not None, file is not None, example is not None) if s]
        if len(sources) != 1:
            raise UsageError(
                'give exactly one of TEXT, --file PATH or --example NAME (e.g. report "Hello world")'
            )
        if not math.isfinite(exact_mb) or exact_mb <= 0:
            raise UsageError(f"--exact-mb must be a finite number > 0, got {exact_mb}")
        if out.exists() and out.is_dir():
            raise UsageError(f"--out {out} is a directory; give a file name such as {out / 'report.html'}")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--out {out}: cannot create its folder ({e.strerror})") from None
        start = time.perf_counter()

        if example is not None:
            from ..worked import load_example

            if head is not None:
                raise UsageError(
                    "--head applies to model reports; a worked example has one layer and one head"
                )
            try:
                ex = load_example(example)
                ex.check()  # refuses examples whose steps are not finite
            except ValueError as e:
                raise UsageError(str(e)) from None
            payload = example_report(ex)
            if token is not None:
                if not 0 <= token < len(ex.tokens):
                    raise UsageError(f"--token must be in 0..{len(ex.tokens) - 1}, got {token}")
                payload["initial"]["token"] = token
            what = f"worked example “{ex.name}” ({len(ex.tokens)} tokens)"
        else:
            if file is not None:
                if file.is_dir():
                    raise UsageError(f"--file {file} is a directory; give a text file")
                if not file.is_file():
                    raise UsageError(f"--file {file}: no such file")
                try:
                    text = file.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    raise UsageError(f"--file {file}: not a UTF-8 text file") from None
            assert text is not None
            if not text.strip():
                raise UsageError("the text is empty: give at least one word")
            if not 2 <= max_length <= 512:
                raise UsageError(f"--max-length must be in 2..512, got {max_length}")
            head_lh = _parse_head(head)
            with Progress(
                SpinnerColumn(),
                TextColumn("[progress.description]{task.description}"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            ) as progress:
                task = progress.add_task(
                    "loading all-MiniLM-L6-v2 (offline, from its PyPI package)…", total=None
                )
                from .. import pretrained

                pretrained.load_model()
                progress.update(
                    task, description="running the model on our attention (and eager, to compare)…"
                )
                try:
                    run = pretrained.run_text(text, max_length=max_length, compare=True)
                except ValueError as e:
                    raise UsageError(str(e)) from None
                n_layers, n_heads = run.attentions.shape[:2]
                if head_lh is not None and not (0 <= head_lh[0] < n_layers and 0 <= head_lh[1] < n_heads):
                    raise UsageError(
                        f"--head {head}: layer must be in 0..{n_layers - 1} and head in 0..{n_heads - 1}"
                    )
                if token is not None and not 0 <= token < len(run.tokens):
                    raise UsageError(f"--token must be in 0..{len(run.tokens) - 1}, got {token}")

                def say(msg: str) -> None:
                    progress.update(task, description=msg + "…")

                payload = model_report(run, head=head_lh, token=token, exact_budget_mb=exact_mb, progress=say)
                say(f"writing {out}")
                size = write_report(payload, out)
            what = f"{len(run.tokens)} tokens" + (" (text cut to the model's limit)" if run.truncated else "")
            lh = payload["initial"]
            what += f", {n_layers} layers × {n_heads} heads, opens on layer {lh['layer']} · head {lh['head']}"
        if example is not None:
            size = write_report(payload, out)
        if png is not None:
            from .. import viz

            if example is not None:
                fig = viz.attention_heatmap(ex.steps.weights, ex.tokens, ex.tokens, title=ex.title)
            else:
                fig = viz.attention_head_grid(run.attentions, title=payload["title"])
            fig.savefig(png, dpi=120)
            console.print(f"[green]wrote[/green] {png}")
        seconds = time.perf_counter() - start
        console.print(f"[green]wrote[/green] {out} ({_human(size)}, {seconds:.1f} s): {what}")
        console.print(f"[dim]open it in any browser: file://{out.resolve()}[/dim]", highlight=False)
