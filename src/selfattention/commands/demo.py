"""``selfattention demo``: replay both lectures' worked examples step by step, checking printed numbers."""

from __future__ import annotations

import typer
from rich.cells import cell_len
from rich.columns import Columns
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from ..i18n import N_, _, ngettext
from ..trace import matrix_table
from ..worked import OK, WITHIN, CheckResult, WorkedExample, list_examples, load_example
from . import UsageError, console

_STYLE = {OK: "green", WITHIN: "yellow", "wrong": "bold red"}
#: a check's status as shown (the statuses themselves are the data: ``worked.OK`` ...)
STATUS_TEXT = {OK: N_("ok"), WITHIN: N_("within rounding"), "wrong": N_("wrong")}
#: a step's name in the check table (``normaliser[1]``); the names are the trace's, shown translated
STEP_NAMES = {
    "inputs": N_("inputs"),
    "query": N_("query"),
    "key": N_("key"),
    "value": N_("value"),
    "scores": N_("scores"),
    "scaled_scores": N_("scaled_scores"),
    "exp_scores": N_("exp_scores"),
    "normaliser": N_("normaliser"),
    "weights": N_("weights"),
    "context": N_("context"),
}
_STEP_TITLES = [
    ("inputs", N_("X (inputs, a row per token)")),
    ("query", N_("Q = X·W_query (queries)")),
    ("key", N_("K = X·W_key (keys)")),
    ("value", N_("V = X·W_value (values)")),
    ("scores", N_("1. scores ω = Q Kᵀ")),
    ("scaled_scores", N_("scaled ω · scale")),
    ("exp_scores", N_("exp(scaled ω)")),
    ("normaliser", N_("Σⱼ exp (softmax normaliser)")),
    ("weights", N_("2. weights α = softmax")),
    ("context", N_("3. context z = α · V")),
]


def check_table(example: WorkedExample, results: list[CheckResult] | None = None) -> tuple[Table, int]:
    """The printed-vs-exact table of an example and the number of wrong values.

    A row per printed number at any width: the numbers first on its first line, the sentence of the
    text last, wrapped onto more lines when the terminal is too narrow for all of it (never cut).
    """
    rows, wrong = [], 0
    for r in example.check() if results is None else results:
        n = r.number
        wrong += r.status == "wrong"
        at = f"[{', '.join(map(str, n.at))}]" if n.at else ""
        cells = [
            f"{_(STEP_NAMES.get(n.step, n.step))}{at}",
            f"{n.printed:.{n.decimals}f}",
            f"{r.exact:.{n.decimals + 3}f}",
            f"{r.error:+.{n.decimals + 2}f}",
            _(STATUS_TEXT.get(r.status, r.status)),
        ]
        rows.append((cells, n.display_text(), _STYLE.get(r.status, "")))
    heads = [_("step[at]"), _("printed"), _("exact"), _("error"), _("verdict")]
    table = Table(
        title=_("every number the text prints, recomputed"), title_justify="left", box=None, pad_edge=False
    )
    widths = [max([cell_len(head), *(cell_len(c[i]) for c, _t, _s in rows)]) for i, head in enumerate(heads)]
    for i, (head, width) in enumerate(zip(heads, widths, strict=True)):  # the numbers never shrink
        table.add_column(head, justify="left" if i in (0, 4) else "right", no_wrap=True, min_width=width)
    # the sentence takes what is left of the line (2 columns between cells), wrapped if need be
    room = max(12, console.width - sum(widths) - 2 * len(widths))
    head = _("what the text says")
    table.add_column(head, overflow="fold", max_width=room, min_width=min(room, cell_len(head)))
    for cells, text, style in rows:
        *plain, status = (escape(c) for c in cells)
        table.add_row(*plain, f"[{style}]{status}[/{style}]", escape(text))
    return table, wrong


def show_example(example: WorkedExample, decimals: int = 4) -> int:
    """Print an example's steps and checks; returns the number of wrong printed values."""
    results = example.check()  # raises before anything is printed if the example cannot be computed
    title = example.display_title()
    if cell_len(title) + 6 <= console.width:
        console.rule(f"[bold]{escape(title)}")
    else:  # a rule cuts its title with "…": a long one goes on its own lines, under the rule
        console.rule()
        console.print(f"[bold]{escape(title)}")
    if example.display_source():
        console.print(
            "[dim]{source}[/dim]".format(
                source=escape(_("source: {source}").format(source=example.display_source()))
            )
        )
    vals = example.values()
    simple = example.kind == "simple"
    if simple:
        console.print(
            _("query = key = value = X (no learnable parameters), scale = 1 (lecture 000: no 1/√d)")
        )
    else:
        console.print(_("scaling: scale = 1/√d_k = {scale:.6f}").format(scale=example.steps.scale))
    labels = example.tokens
    tables = []
    for name, title in _STEP_TITLES:
        if simple and name in ("query", "key", "value", "scaled_scores"):
            continue
        m = vals[name]
        cols = labels if name in ("scores", "scaled_scores", "exp_scores", "weights") else None
        if name == "normaliser":
            m, cols = m[:, None], ["Σ exp"]
        tables.append(matrix_table(m, title=_(title), row_labels=labels, col_labels=cols, decimals=decimals))
    console.print(Columns(tables, padding=(1, 3)))
    focus = example.focus
    if focus is not None:
        w, ctx = vals["weights"][focus], vals["context"][focus]
        vname = "x" if simple else "v"
        terms = " + ".join(f"{float(w[j]):.4f}·{vname}({labels[j]})" for j in range(len(labels)))
        vec = ", ".join(f"{float(c):.4f}" for c in ctx)
        console.print(
            _("[bold]{what}[/bold]: z = {terms} = {vec}").format(
                what=escape(_("context vector of “{token}”").format(token=labels[focus])),
                terms=escape(terms),
                vec=f"\\[{vec}]",
            )
        )
    table, wrong = check_table(example, results)
    console.print(table)
    return wrong


_HELP = N_(
    "Replay the lectures' worked examples step by step with exact values; flag printed numbers "
    "that are off by more than their own rounding."
)


def demo(
    example: list[str] = typer.Option(
        None, "--example", "-e", help=N_("Only these examples (default: all shipped: journey, two-token).")
    ),
    decimals: int = typer.Option(4, help=N_("Decimals shown in the step tables.")),
) -> None:
    names = example or list_examples()
    unknown = [n for n in names if n not in list_examples()]
    if unknown:
        raise UsageError(
            _("unknown example {name!r}; shipped examples: {names}").format(
                name=unknown[0], names=", ".join(list_examples())
            )
        )
    if not 0 <= decimals <= 12:
        raise UsageError(_("--decimals must be between 0 and 12, got {value}").format(value=decimals))
    summary = []
    for name in names:
        ex = load_example(name)
        wrong = show_example(ex, decimals)
        summary.append((ex, wrong))
    lines = []
    for ex, wrong in summary:
        total = len(ex.printed)
        if wrong:
            bad = [r for r in ex.check() if r.status == "wrong"]
            what = _("; ").join(
                _("{step}{at} printed {printed} (exact {exact:.4f})").format(
                    step=_(STEP_NAMES.get(r.number.step, r.number.step)),
                    at=list(r.number.at),
                    printed=r.number.printed,
                    exact=r.exact,
                )
                for r in bad
            )
            wrong_text = ngettext(
                "{wrong} of {total} printed number is wrong",
                "{wrong} of {total} printed numbers are wrong",
                total,
            ).format(wrong=wrong, total=total)
            lines.append(
                _("[bold]{name}[/bold]: [red]{wrong}[/red]: {what}").format(
                    name=escape(ex.name), wrong=escape(wrong_text), what=escape(what)
                )
            )
        else:
            ok_text = ngettext(
                "the {total} printed number checks out", "all {total} printed numbers check out", total
            ).format(total=total)
            lines.append(
                _("[bold]{name}[/bold]: [green]{ok}[/green]").format(name=escape(ex.name), ok=escape(ok_text))
            )
    console.print(Panel("\n".join(lines), title=_("verdict"), expand=False))


def register(app: typer.Typer) -> None:
    app.command("demo", help=_HELP)(demo)
