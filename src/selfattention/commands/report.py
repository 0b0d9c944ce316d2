"""``selfattention report``: one self-contained HTML file of a text's attention (or a worked example's).

selfattention report "The animal didn't cross the street because it was too tired." --out report.html
selfattention report --file essay.txt --out essay.html --head 4.7
selfattention report "Hello there" --model path/to/checkpoint --out mine.html
selfattention report --example journey --out journey.html
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import typer
from rich.markup import escape

from ..i18n import N_, _
from . import UsageError, console
from ._notes import os_error, png_target, save_png, unknown_tokens_note

_HELP = N_(
    "Write one self-contained HTML report (no network, opens from disk): the tokens, a layer × head grid, "
    "a large heatmap with exact weights on hover, the trace tables of a head and per-head statistics. "
    "The model is the built-in all-MiniLM-L6-v2, or any local Hugging Face checkpoint folder (encoder or "
    "decoder) with --model PATH, or --model m3e-small for Chinese text (make zh). The page opens on the strongest long-range link between two words "
    "(largest weight x log2 distance between word tokens at least two apart), unless --head/--token say "
    "otherwise. Inputs too long to keep every weight matrix get per-head statistics from the tiled path."
)


def _check_head(spec: str | None, head: tuple[int, int], n_layers: int, n_heads: int) -> None:
    if not (0 <= head[0] < n_layers and 0 <= head[1] < n_heads):
        raise UsageError(
            _("--head {head}: the layer must be in 0..{last_layer} and the head in 0..{last_head}").format(
                head=spec, last_layer=n_layers - 1, last_head=n_heads - 1
            )
        )


def _check_token(token: int, n_tokens: int) -> None:
    if not 0 <= token < n_tokens:
        raise UsageError(
            _("--token must be in 0..{last}, got {value}").format(last=n_tokens - 1, value=token)
        )


def _parse_head(spec: str | None) -> tuple[int, int] | None:
    if spec is None:
        return None
    try:
        layer, head = (int(p) for p in spec.split("."))
    except ValueError:
        raise UsageError(
            _("--head must be LAYER.HEAD with 0-based integers, e.g. 3.7; got {value!r}").format(value=spec)
        ) from None
    return layer, head


def _human(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def _add_views(payload: dict, run, model: Path | None, measure: str, by_words: bool) -> None:
    """The page's other views (words; rollout, flow, ‖α f(x)‖); it opens on ``--measure`` / ``--words``."""
    from .. import pretrained
    from ..attribution import FLOW_MAX_TOKENS
    from ..report.views import add_views
    from ..words import word_groups

    if run.attentions is None and (by_words or measure != "raw"):
        raise UsageError(
            _("--words and --measure need every weight matrix: this input is too long (try --max-length)")
        )
    if measure == "flow" and len(run.tokens) > FLOW_MAX_TOKENS:
        raise UsageError(
            _(
                "--measure flow: at most {n} tokens (T² max-flow problems), this text has {t}; try rollout"
            ).format(n=FLOW_MAX_TOKENS, t=len(run.tokens))
        )
    net, tokenizer = pretrained.load_model(model)
    groups = None
    if run.attentions is not None:
        try:
            groups = word_groups(run.text, tokenizer, run.input_ids)
        except (ImportError, ValueError) as e:
            if by_words:
                raise UsageError(_("--words: {error}").format(error=e)) from None
            payload["notes"].append(_("No word view: {error}").format(error=e))
    add_views(payload, run, groups, net, initial=f"{'words' if by_words else 'tokens'}:{measure}")


def register(app: typer.Typer) -> None:
    @app.command("report", help=_HELP)
    def report(
        text: str | None = typer.Argument(None, help=N_("The text to run through the model.")),
        model: Path | None = typer.Option(
            None,
            "--model",
            "-m",
            help=N_(
                "m3e-small (a Chinese model: make zh), or a local Hugging Face checkpoint folder (encoder "
                "or decoder), instead of all-MiniLM-L6-v2."
            ),
        ),
        out: Path = typer.Option(
            Path("report.html"), "--out", "-o", help=N_("Where to write the HTML file.")
        ),
        file: Path | None = typer.Option(
            None, "--file", "-f", help=N_("Read the text from this UTF-8 file.")
        ),
        example: str | None = typer.Option(
            None,
            "--example",
            "-e",
            help=N_("A lecture's worked example (journey, two-token) or a TOML path."),
        ),
        head: str | None = typer.Option(
            None,
            "--head",
            help=N_(
                "LAYER.HEAD (0-based) selected on opening and stored exactly. Default: the head of "
                "the strongest long-range link between two words."
            ),
        ),
        token: int | None = typer.Option(
            None, "--token", help=N_("Query token selected on opening (0-based).")
        ),
        max_length: int | None = typer.Option(
            None,
            "--max-length",
            help=N_("Cut the text to this many tokens (2 .. the model's limit, 512 for MiniLM)."),
        ),
        png: Path | None = typer.Option(
            None,
            "--png",
            help=N_("Also save a static PNG (matplotlib): every head as a grid, or the example's heatmap."),
        ),
        exact_mb: float = typer.Option(
            8.0,
            "--exact-mb",
            help=N_("Megabytes allowed for exact per-head traces (the rest: 8-bit colours)."),
        ),
        measure: str = typer.Option(
            "raw",
            "--measure",
            help=N_(
                "The view the page opens on: raw, norm (‖α f(x)‖), rollout or flow; the page holds all four "
                "(flow for short texts only) and switches between them."
            ),
        ),
        by_words: bool = typer.Option(
            False,
            "--words/--tokens",
            help=N_(
                "Open on words instead of tokens (jieba's words for Chinese, the tokenizer's words otherwise); "
                "the page switches between the two."
            ),
        ),
    ) -> None:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from ..report import example_report, model_report, write_report

        sources = [s for s in (text is not None, file is not None, example is not None) if s]
        if len(sources) != 1:
            raise UsageError(
                _('give exactly one of TEXT, --file PATH or --example NAME (e.g. report "Hello world")')
            )
        from ..attribution import MEASURES

        if measure not in MEASURES:
            raise UsageError(
                _("--measure must be one of {choices}, got {value!r}").format(
                    choices=", ".join(MEASURES), value=measure
                )
            )
        if example is not None and (by_words or measure != "raw"):
            raise UsageError(_("--words and --measure apply to model reports, not to a worked example"))
        if png is not None:
            png = png_target("--png", png)  # before the model runs
        if not math.isfinite(exact_mb) or exact_mb <= 0:
            raise UsageError(_("--exact-mb must be a finite number > 0, got {value}").format(value=exact_mb))
        if out.exists() and out.is_dir():
            raise UsageError(
                _("--out {path} is a directory; give a file name such as {example}").format(
                    path=out, example=out / "report.html"
                )
            )
        if out.suffix.lower() not in (".html", ".htm"):
            raise UsageError(
                _("--out {path}: the report is an HTML page, give a file name ending in .html").format(
                    path=out
                )
            )
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(
                _("--out {path}: cannot create its folder ({error})").format(path=out, error=os_error(e))
            ) from None
        if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
            raise UsageError(_("--out {path}: not writable").format(path=out))
        start = time.perf_counter()

        if example is not None:
            from ..worked import load_example

            if head is not None:
                raise UsageError(
                    _("--head applies to model reports; a worked example has one layer and one head")
                )
            try:
                ex = load_example(example)
                ex.check()  # refuses examples whose steps are not finite
            except ValueError as e:
                raise UsageError(str(e)) from None
            payload = example_report(ex)
            if token is not None:
                if not 0 <= token < len(ex.tokens):
                    raise UsageError(
                        _("--token must be in 0..{last}, got {value}").format(
                            last=len(ex.tokens) - 1, value=token
                        )
                    )
                payload["initial"]["token"] = token
            what = _("worked example “{name}” ({n} tokens)").format(name=ex.name, n=len(ex.tokens))
        else:
            if file is not None:
                if file.is_dir():
                    raise UsageError(_("--file {path} is a directory; give a text file").format(path=file))
                if not file.is_file():
                    raise UsageError(_("--file {path}: no such file").format(path=file))
                try:
                    text = file.read_text(encoding="utf-8")
                except UnicodeDecodeError:
                    raise UsageError(_("--file {path}: not a UTF-8 text file").format(path=file)) from None
            assert text is not None
            if not text.strip():
                raise UsageError(_("the text is empty: give at least one word"))
            from .. import pretrained

            try:
                limit = pretrained.position_limit(model)
            except ImportError as e:
                raise UsageError(str(e)) from None
            except ValueError as e:
                raise UsageError(_("--model: {error}").format(error=e)) from None
            if max_length is not None and not 2 <= max_length <= (limit or max_length):
                raise UsageError(
                    _("--max-length must be in 2..{limit}, got {value}").format(limit=limit, value=max_length)
                )
            head_lh = _parse_head(head)
            if head_lh is not None:  # checked before the model runs (its config says the layers and heads)
                n_layers, n_heads = pretrained.n_layers_and_heads(pretrained.model_config(model))
                _check_head(head, head_lh, n_layers, n_heads)
            name = pretrained.model_label(model)
            with Progress(
                SpinnerColumn(),
                TextColumn("[progress.description]{task.description}"),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            ) as progress:
                task = progress.add_task(_("loading {name} (offline)…").format(name=name), total=None)
                try:
                    pretrained.load_model(model)
                except ValueError as e:
                    raise UsageError(_("--model: {error}").format(error=e)) from None
                if token is not None:  # the tokens the run will have, before the run
                    _check_token(token, pretrained.token_count(text, model=model, max_length=max_length))
                progress.update(
                    task, description=_("running the model on our attention (and eager, to compare)…")
                )
                try:
                    run = pretrained.run_text(text, model=model, max_length=max_length, compare=True)
                except ValueError as e:
                    raise UsageError(str(e)) from None
                if head_lh is not None:  # (the run's own counts decide)
                    _check_head(head, head_lh, run.n_layers, run.n_heads)
                if token is not None:
                    _check_token(token, len(run.tokens))

                def say(msg: str) -> None:
                    progress.update(task, description=msg + "…")

                payload = model_report(run, head=head_lh, token=token, exact_budget_mb=exact_mb, progress=say)
                say(_("rollout, flow, ‖α f(x)‖ and words"))
                _add_views(payload, run, model, measure, by_words)
                say(_("writing {out}").format(out=out))
                size = write_report(payload, out)
            from .._scripts import has_cjk
            from ..fonts import find_cjk_font

            if has_cjk("".join(run.tokens)) and find_cjk_font() is None:
                console.print(
                    "[yellow]"
                    + escape(
                        _(
                            "note: no CJK font to embed, so the page shows Chinese only where the browser has "
                            "a CJK font of its own: run `make zh` (or pip install --no-deps "
                            "paperang-p2-fonts-cjk==0.1.0)."
                        )
                    )
                    + "[/yellow]"
                )
            unknown = unknown_tokens_note(run, name)
            if unknown is not None:
                console.print("[yellow]" + escape(unknown) + "[/yellow]")
            if run.past_trained_length:
                console.print(
                    "[yellow]"
                    + escape(
                        _(
                            "note: {name} was trained on inputs of at most {trained} tokens (its own files say so); "
                            "this text has {n}, so its attention past position {trained} is less reliable."
                        ).format(name=name, trained=run.trained_length, n=len(run.tokens))
                    )
                    + "[/yellow]"
                )
            lh = payload["initial"]
            what = _(
                "{n} tokens{cut}, {layers} layers × {heads} heads, opens on layer {layer} · head {head} and "
                "the token “{token}”"
            ).format(
                n=len(run.tokens),
                cut=_(" (text cut to the model's limit)") if run.truncated else "",
                layers=run.n_layers,
                heads=run.n_heads,
                layer=lh["layer"],
                head=lh["head"],
                token=(payload["views"].get(lh.get("view", ""), {}).get("labels") or run.tokens)[lh["token"]],
            )
        if example is not None:
            size = write_report(payload, out)
        if png is not None:
            from .. import viz

            if example is not None:
                fig = viz.attention_heatmap(ex.steps.weights, ex.tokens, ex.tokens, title=ex.title)
            elif run.attentions is not None:
                fig = viz.attention_head_grid(run.attentions, title=payload["title"])
            else:  # too long to keep every matrix: one layer at a time would not fit a picture either
                lh = payload["initial"]
                fig = viz.attention_heatmap(
                    run.weights(lh["layer"], lh["head"]),
                    run.tokens,
                    run.tokens,
                    title=_("{title} · layer {layer}, head {head}").format(
                        title=payload["title"], layer=lh["layer"], head=lh["head"]
                    ),
                )
            save_png(fig, png, dpi=120)
            console.print("[green]{}[/green] {}".format(_("wrote"), escape(str(png))))
        seconds = time.perf_counter() - start
        console.print(
            "[green]{}[/green] {}".format(
                _("wrote"),
                escape(
                    _("{out} ({size}, {seconds:.1f} s): {what}").format(
                        out=out, size=_human(size), seconds=seconds, what=what
                    )
                ),
            )
        )
        console.print(
            "[dim]{}[/dim]".format(
                escape(
                    _("open it in any browser: file://{path}").format(
                        path=out.resolve().as_uri().removeprefix("file://")  # percent-encoded (spaces …)
                    )
                )
            ),
            highlight=False,
        )
