"""``selfattention explain [TEXT]``: a real model on our attention, one head's weights shown.

The built-in all-MiniLM-L6-v2, or any local Hugging Face checkpoint folder with ``--model PATH``.

Thin: :mod:`selfattention.pretrained` runs the model, :mod:`selfattention.viz` draws the heatmap. Heavy
imports (transformers, matplotlib) happen inside the command.
"""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.cells import cell_len
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from ..attribution import FLOW_MAX_TOKENS, MEASURES
from ..i18n import N_, _
from ..pretrained import MATCH_TOLERANCE
from . import UsageError, console
from ._notes import os_error, png_target, save_png, unknown_tokens_note

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired."
DEFAULT_LAYER = 3
DEFAULT_HEAD = 1
MAX_ROWS = 40
"""At most this many query rows in the tables (the heatmap from --out always has every token)."""

_HELP = N_(
    "Run all-MiniLM-L6-v2 on TEXT with this library's attention doing every attention computation, "
    "and show one head: its weight table over the real tokens, each token's most-attended tokens, and "
    "the largest difference between our attention and the model's own (transformers eager) attention, "
    "which must be <= {tolerance:g} in float32 (exit code 1 otherwise).\n\n"
    'Layers (0-5) and heads (0-11) count from 0. Without TEXT the built-in sentence "{text}" '
    "is used. The defaults, layer {layer} head {head}, were chosen by looking at the "
    'real weights of every head on it: there "it" puts 0.68 of its weight on "animal" (and "cross" '
    '0.60 on "street", "the" 0.52 on "animal"), a pronoun-to-noun pattern. A pattern, not proof of '
    'understanding: with "...because it was too wide" the same head gives "animal" only 0.28.\n\n'
    "For a clean positional head try --layer 0 --head 2: every token puts ~1.00 on the token before it.\n\n"
    "With --model PATH (a local Hugging Face checkpoint folder: config.json, weights, tokenizer files; an "
    "encoder or a decoder) that model runs instead. Without --layer/--head it opens on the head with the "
    "strongest long-range link between two words: the largest weight x log2(distance) over pairs of "
    "word tokens at least two positions apart.\n\n"
    "With --model m3e-small, moka-ai's Chinese model (one token per character; install it with "
    "make zh; non-commercial / research use only) reads Chinese text, which all-MiniLM-L6-v2 turns "
    "into [UNK]. Unknown tokens are always counted in a note.\n\n"
    "Inputs longer than the model was trained on (all-MiniLM-L6-v2: 256 tokens, though its position "
    "table has 512) get a printed note."
)
#: the values of the help's placeholders (filled in after translation: see ``cli._tidy_help``)
_HELP_VALUES = {
    "tolerance": MATCH_TOLERANCE,
    "text": DEFAULT_TEXT,
    "layer": DEFAULT_LAYER,
    "head": DEFAULT_HEAD,
    "flow_max": FLOW_MAX_TOKENS,
}


def _fmt_tokens(tokens: list[str]) -> list[str]:
    """Token labels with their position, so repeated tokens ('the', 'the') stay distinguishable."""
    return [f"{i} {t}" for i, t in enumerate(tokens)]


def _cell(v: float, is_max: bool) -> str:
    s = f"{v:.2f}"
    if is_max:
        return f"[bold yellow]{s}[/bold yellow]"
    if v < 0.01:
        return f"[dim]{s}[/dim]"
    return s


# Tokens are never shortened ("becau…"): a column is as wide as its token; fewer columns fit, and the
# 'rest' column holds the weight on the others.


def columns_that_fit(width: int, tokens: list[str], n_rows: int) -> int:
    """How many key columns of the weight table fit a console ``width`` (at least 2)."""
    label = max(cell_len(f"{i} {t}") for i, t in enumerate(tokens[:n_rows])) + 1
    rest = 5  # the 'rest' column, needed as soon as one column is left out
    used, n = label, 0
    for t in tokens:
        used += max(4, cell_len(t)) + 1  # one space of left padding
        if used > width - (rest if n + 1 < len(tokens) else 0):
            break
        n += 1
    return max(2, n)


def weight_table(weights, tokens: list[str], n_rows: int, n_cols: int, title: str) -> Table:
    """Rich table of ``weights[:n_rows, :n_cols]`` (rows: queries, columns: keys), with a 'rest' column
    holding each row's weight on the keys not shown, so every printed row still sums to 1."""
    T = len(tokens)
    table = Table(
        title=title, title_justify="left", show_header=True, pad_edge=False, box=None, padding=(0, 0, 0, 1)
    )
    table.add_column("", style="bold", no_wrap=True)
    for j in range(n_cols):
        table.add_column(escape(tokens[j]), justify="right", no_wrap=True, min_width=4)
    if n_cols < T:
        table.add_column(_("rest"), justify="right", style="italic", no_wrap=True)
    for i in range(n_rows):
        row = weights[i]
        top = int(row.argmax())
        cells = [_cell(float(row[j]), j == top) for j in range(n_cols)]
        if n_cols < T:
            cells.append(f"{float(row[n_cols:].sum()):.2f}")
        table.add_row(escape(f"{i} {tokens[i]}"), *cells)
    return table


def top_of(matrix, k: int) -> list[list[tuple[int, float]]]:
    """For each row of ``matrix`` (T, T'), its ``k`` largest columns as ``(index, value)``, largest first;
    ties keep the earlier column first. ``k`` is capped at T'."""
    import torch

    k = min(k, matrix.shape[-1])
    order = torch.sort(torch.as_tensor(matrix), dim=-1, descending=True, stable=True)
    return [
        [(int(i), float(v)) for i, v in zip(idx[:k].tolist(), val[:k].tolist(), strict=True)]
        for idx, val in zip(order.indices, order.values, strict=True)
    ]


def top_table(matrix, labels: list[str], k: int, n_rows: int, unit: str = "token") -> Table:
    """Each query's ``k`` most-attended keys (tokens or words) with their values."""
    title = (
        _("top {k} attended words per query: word [position] weight")
        if unit == "word"
        else _("top {k} attended tokens per query: token [position] weight")
    )
    table = Table(
        title=escape(title.format(k=k)), title_justify="left", box=None, padding=(0, 1), pad_edge=False
    )
    table.add_column(_("query"), style="bold", no_wrap=True)
    table.add_column(
        _("most attended words, heaviest first") if unit == "word" else _("most attended, heaviest first")
    )
    tops = top_of(matrix, k)
    for i in range(n_rows):
        parts = [f"{escape(labels[j])} [dim]\\[{j}][/dim] {w:.2f}" for j, w in tops[i]]
        table.add_row(escape(f"{i} {labels[i]}"), ",  ".join(parts))
    return table


_MEASURE_TITLES = {
    "raw": N_("weights of our attention: row = query, sums to 1; highlighted = row max"),
    "norm": N_(
        "‖α f(x)‖ (Kobayashi et al. 2020): each weight times the size of what its key adds (its value "
        "through the output projection), rows rescaled to sum to 1; highlighted = row max"
    ),
    "rollout": N_(
        "attention rollout after layer {layer} (Abnar & Zuidema 2020): heads averaged, the residual added "
        "(0.5·A + 0.5·I), multiplied through layers 0–{layer}; row = position, column = input token, sums to 1"
    ),
    "flow": N_(
        "attention flow to the last layer (Abnar & Zuidema 2020): the max-flow from each position to each "
        "input token through every layer (0.5·A + 0.5·I), rows rescaled to sum to 1"
    ),
}
_WORDS_RULE = N_("words: weights summed over a word's keys, averaged over its queries (Clark et al. 2019)")


def measured(run, measure: str, layer: int, head: int, net=None):
    """The (T, T) matrix that ``--measure`` shows: raw weights or ‖α f(x)‖ of (layer, head), rollout
    after ``layer``, or flow to the last layer (:mod:`selfattention.attribution`), float64."""
    from .. import attribution

    if measure == "raw":
        return run.weights(layer, head).double()
    m = attribution.measure(run, measure, net)
    if measure == "norm":
        return m[layer, head]
    if measure == "rollout":
        return m[layer]
    return m


def _note(template: str, **values: object) -> None:
    """Print a yellow note (a whole sentence with named placeholders, translated; values are escaped)."""
    console.print("[yellow]" + escape(_(template).format(**values)) + "[/yellow]")


def explain(
    text: str | None = typer.Argument(
        None, help=N_("The text to run through the model (default: the built-in sentence above).")
    ),
    model: Path | None = typer.Option(
        None,
        "--model",
        "-m",
        help=N_(
            "m3e-small (a Chinese model: make zh), or a local Hugging Face checkpoint folder (encoder or "
            "decoder), instead of the built-in all-MiniLM-L6-v2."
        ),
    ),
    layer: int | None = typer.Option(
        None, "--layer", "-l", help=N_("Layer, 0-based. Default: 3 for the built-in model, else see below.")
    ),
    head: int | None = typer.Option(
        None, "--head", help=N_("Head, 0-based. Default: 1 for the built-in model.")
    ),
    out: Path | None = typer.Option(
        None, "--out", "-o", help=N_("Write a heatmap PNG of this head's weights, tokens on both axes.")
    ),
    top: int = typer.Option(3, "--top", "-k", help=N_("How many most-attended tokens to list per token.")),
    measure: str = typer.Option(
        "raw",
        "--measure",
        help=N_(
            "What to show: raw (the head's softmax weights), norm (‖α f(x)‖ of the head, Kobayashi et al. "
            "2020), rollout (all heads, through layers 0..--layer) or flow (all heads and layers, max-flow; "
            "at most {flow_max} tokens), both Abnar & Zuidema 2020."
        ),
    ),
    by_words: bool = typer.Option(
        False,
        "--words/--tokens",
        help=N_(
            "Show words instead of tokens: jieba's words for Chinese (pip install jieba), the tokenizer's "
            "words otherwise; weights summed over a word's keys, averaged over its queries."
        ),
    ),
) -> None:
    from .. import pretrained
    from ..focus import strongest_link

    if text is None:
        text = DEFAULT_TEXT
    if not text.strip():
        raise UsageError(_("TEXT is empty: give a sentence, or leave TEXT out to use the built-in one"))
    try:
        config = pretrained.model_config(model)
        n_layers, n_heads = pretrained.n_layers_and_heads(config)
    except ImportError as e:
        raise UsageError(str(e)) from e
    except ValueError as e:
        raise UsageError(_("--model: {error}").format(error=e)) from e
    if model is None:
        layer = DEFAULT_LAYER if layer is None else layer
        head = DEFAULT_HEAD if head is None else head
    if layer is not None and not 0 <= layer < n_layers:
        raise UsageError(
            _("--layer must be in 0..{last} (0-based), got {value}").format(last=n_layers - 1, value=layer)
        )
    if head is not None and not 0 <= head < n_heads:
        raise UsageError(
            _("--head must be in 0..{last} (0-based), got {value}").format(last=n_heads - 1, value=head)
        )
    if top < 1:
        raise UsageError(_("--top must be at least 1, got {value}").format(value=top))
    if measure not in MEASURES:
        raise UsageError(
            _("--measure must be one of {choices}, got {value!r}").format(
                choices=", ".join(MEASURES), value=measure
            )
        )
    if out is not None:
        out = png_target("--out", out)

    name = pretrained.model_label(model)
    t0 = time.perf_counter()
    with console.status(
        _("loading {name} offline (transformers, our attention backend) ...").format(name=name)
    ):
        try:
            pretrained.load_model(model)
        except ImportError as e:
            raise UsageError(_("cannot load the model: {error}").format(error=e)) from e
        except ValueError as e:
            raise UsageError(_("--model: {error}").format(error=e)) from e
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    with console.status(_("running the model (our attention, then the model's own eager attention) ...")):
        try:
            run = pretrained.run_text(text, model=model, compare=True)
        except ValueError as e:
            raise UsageError(str(e)) from e
    t_run = time.perf_counter() - t0

    T = len(run.tokens)
    if measure != "raw" and run.attentions is None:
        raise UsageError(
            _("--measure {measure}: the input is too long to keep every weight matrix").format(
                measure=measure
            )
        )
    if measure == "flow" and T > FLOW_MAX_TOKENS:
        raise UsageError(
            _(
                "--measure flow: at most {n} tokens (T² max-flow problems), this text has {t}; try rollout"
            ).format(n=FLOW_MAX_TOKENS, t=T)
        )
    link = None
    if layer is None or head is None:
        link = strongest_link((run.layer_weights(la) for la in range(run.n_layers)), run.tokens, run.special)
        if link is not None:
            layer = link.layer if layer is None else layer
            head = link.head if head is None else head
        layer, head = layer or 0, head or 0
    console.rule(
        _("[bold]{what}[/bold] {of}").format(
            what=escape(
                _("{name} · layer {layer}, head {head}").format(name=name, layer=layer, head=head)
                if measure in ("raw", "norm")
                else _heat_title(name, measure, layer, head, False)
            ),
            of=escape(_("(of {n_layers} × {n_heads}, 0-based)").format(n_layers=n_layers, n_heads=n_heads)),
        )
    )
    shown = text if len(text) <= 300 else text[:300] + _("… ({n} characters)").format(n=len(text))
    console.print(_('text: "{text}"').format(text=shown), highlight=False, markup=False)
    if link is not None:
        _note(
            N_(
                "Opening on layer {layer}, head {head}: the strongest long-range link between two words is "
                "there ({query} → {key}, weight {weight:.2f}). Choose another head with --layer and --head."
            ),
            layer=link.layer,
            head=link.head,
            query=run.tokens[link.query],
            key=run.tokens[link.key],
            weight=link.weight,
        )
    if run.truncated:
        _note(
            N_(
                "note: the text has {full} tokens; the model reads at most {n}, so only the first {n} "
                "(special tokens included) were used."
            ),
            full=run.n_tokens_full,
            n=T,
        )
    unknown = unknown_tokens_note(run, name)
    if unknown is not None:
        _note("{note}", note=unknown)
    if run.past_trained_length:
        _note(
            N_(
                "note: {name} was trained on inputs of at most {trained} tokens (its own files say so); this "
                "text has {n}, so its attention past position {trained} is less reliable."
            ),
            name=name,
            trained=run.trained_length,
            n=T,
        )
    more = _(" … (+{n} more)").format(n=T - MAX_ROWS) if T > MAX_ROWS else ""
    console.print(
        _("{n} tokens: ").format(n=T) + " ".join(run.tokens[:MAX_ROWS]) + more, highlight=False, markup=False
    )

    net, tokenizer = pretrained.load_model(model)
    w = measured(run, measure, layer, head, net)
    labels = run.tokens
    title = _(_MEASURE_TITLES[measure]).format(layer=layer)
    if by_words:
        from ..words import aggregate, word_groups

        try:
            groups = word_groups(run.text, tokenizer, run.input_ids)
        except ImportError as e:
            raise UsageError(str(e)) from e
        except ValueError as e:
            raise UsageError(_("--words: {error}").format(error=e)) from e
        w, labels = aggregate(w, groups.groups), groups.words
        title = _("{measure}; {words}").format(measure=title, words=_(_WORDS_RULE))
        console.print(
            _("{n} words ({segmenter}): ").format(n=len(labels), segmenter=groups.segmenter)
            + " ".join(labels[:MAX_ROWS])
            + (_(" … (+{n} more)").format(n=len(labels) - MAX_ROWS) if len(labels) > MAX_ROWS else ""),
            highlight=False,
            markup=False,
        )
    n = len(labels)
    k = min(top, n)
    n_rows = min(n, MAX_ROWS)
    n_cols = columns_that_fit(console.width, labels, n_rows)
    console.print(weight_table(w, labels, n_rows, n_cols, escape(title)))
    if n_rows < n or n_cols < n:
        console.print(
            "[yellow]{}[/yellow]".format(
                escape(
                    (
                        _(
                            "showing query rows 0–{last_row} and key columns 0–{last_col} of {n} words "
                            "(to fit the screen); 'rest' = the weight on the key columns not shown. "
                            "The top-{k} list below covers every key; --out FILE.png draws the whole matrix."
                        )
                        if by_words
                        else _(
                            "showing query rows 0–{last_row} and key columns 0–{last_col} of {n} tokens "
                            "(to fit the screen); 'rest' = the weight on the key columns not shown. "
                            "The top-{k} list below covers every key; --out FILE.png draws the whole matrix."
                        )
                    ).format(last_row=n_rows - 1, last_col=n_cols - 1, n=n, k=k)
                )
            )
        )
    console.print(top_table(w, labels, k, n_rows, "word" if by_words else "token"))

    dw, dh = run.max_abs_diff_weights, run.max_abs_diff_hidden
    ok = dh is not None and dh <= MATCH_TOLERANCE and (dw is None or dw <= MATCH_TOLERANCE)
    if ok:
        within = (
            _("both ≤ {tolerance:g} (float32)") if dw is not None else _("≤ {tolerance:g} (float32)")
        ).format(tolerance=MATCH_TOLERANCE)
        verdict = _("{word}: {why}").format(
            word="[bold green]{}[/bold green]".format(_("MATCH")), why=escape(within)
        )
    else:
        larger = _("larger than {tolerance:g} (float32)").format(tolerance=MATCH_TOLERANCE)
        verdict = _("{word}: {why}").format(
            word="[bold red]{}[/bold red]".format(_("MISMATCH")), why=escape(larger)
        )
    hidden = run.hidden_states[-1].shape[-1]
    weights_line = (
        escape(
            _("max |ours − eager| attention weights (all {L} layers × {H} heads × {T}×{T}):").format(
                L=run.n_layers, H=run.n_heads, T=T
            )
        )
        + _("{label} {value}").format(label="", value=f"[bold]{dw:.2e}[/bold]")
        if dw is not None
        else escape(
            _("attention weights: not kept for an input this long; compared through the hidden state")
        )
    )
    hidden_line = escape(
        _("max |ours − eager| last hidden state (1×{T}×{hidden}):").format(T=T, hidden=hidden)
    )
    timing = _("load {load:.1f} s · two forward passes (ours + eager) {run:.2f} s").format(
        load=t_load, run=t_run
    )
    verdict_label = _("verdict:")
    console.print(
        Panel(
            weights_line
            + "\n"
            + _("{label} {value}").format(label=hidden_line, value=f"[bold]{dh:.2e}[/bold]")
            + "\n"
            + _("{label} {value}").format(label=escape(verdict_label), value=verdict)
            + "\n"
            f"[dim]{escape(timing)}[/dim]",
            title=escape(_("ours vs the model's own eager attention")),
            expand=False,
        )
    )

    if out is not None:
        from ..viz import attention_heatmap

        fig = attention_heatmap(
            w,
            _fmt_tokens(labels),
            _fmt_tokens(labels),
            title=_heat_title(name, measure, layer, head, by_words),
        )
        try:
            save_png(fig, out, dpi=150)
        except OSError as e:
            raise UsageError(
                _("--out: cannot write {path!r}: {error}").format(path=str(out), error=os_error(e))
            ) from e
        console.print(
            _("heatmap ({T}×{T}) written to {out}").format(T=n, out=out), highlight=False, markup=False
        )
    if not ok:
        raise typer.Exit(1)


def _heat_title(name: str, measure: str, layer: int, head: int, by_words: bool) -> str:
    what = {
        "raw": _("{name} · layer {layer}, head {head} · our attention"),
        "norm": _("{name} · layer {layer}, head {head} · ‖α f(x)‖, rows sum to 1"),
        "rollout": _("{name} · attention rollout after layer {layer}"),
        "flow": _("{name} · attention flow to the last layer, rows sum to 1"),
    }[measure].format(name=name, layer=layer, head=head)
    return what + (" · " + _("words") if by_words else "")


explain.__doc__ = _HELP.format(**_HELP_VALUES)
explain.help_values = _HELP_VALUES  # type: ignore[attr-defined]


def register(app: typer.Typer) -> None:
    app.command("explain", help=_HELP)(explain)
