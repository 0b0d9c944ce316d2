"""``selfattention demo``: replay both lectures' worked examples step by step, checking printed numbers."""

from __future__ import annotations

import typer
from rich.columns import Columns
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from ..trace import matrix_table
from ..worked import OK, WITHIN, CheckResult, WorkedExample, list_examples, load_example
from . import UsageError, console

_STYLE = {OK: "green", WITHIN: "yellow", "wrong": "bold red"}
_STEP_TITLES = [
    ("inputs", "X (inputs, a row per token)"),
    ("query", "Q = X·W_query"),
    ("key", "K = X·W_key"),
    ("value", "V = X·W_value"),
    ("scores", "1. scores ω = Q Kᵀ"),
    ("scaled_scores", "scaled ω · scale"),
    ("exp_scores", "exp(scaled ω)"),
    ("normaliser", "Σⱼ exp (softmax normaliser)"),
    ("weights", "2. weights α = softmax"),
    ("context", "3. context z = α · V"),
]


def check_table(example: WorkedExample, results: list[CheckResult] | None = None) -> tuple[Table, int]:
    """The printed-vs-exact table of an example and the number of wrong values.

    One line per printed number at any width: the numbers first, the sentence of the text last,
    shortened with "…" when the terminal is too narrow for all of it.
    """
    rows, wrong = [], 0
    for r in example.check() if results is None else results:
        n = r.number
        wrong += r.status == "wrong"
        at = f"[{', '.join(map(str, n.at))}]" if n.at else ""
        cells = [
            f"{n.step}{at}",
            f"{n.printed:.{n.decimals}f}",
            f"{r.exact:.{n.decimals + 3}f}",
            f"{r.error:+.{n.decimals + 2}f}",
            r.status,
        ]
        rows.append((cells, n.text, _STYLE.get(r.status, "")))
    heads = ["step[at]", "printed", "exact", "error", "verdict"]
    table = Table(
        title="every number the text prints, recomputed", title_justify="left", box=None, pad_edge=False
    )
    widths = [max([len(head), *(len(cells[i]) for cells, _, _ in rows)]) for i, head in enumerate(heads)]
    for i, (head, width) in enumerate(zip(heads, widths, strict=True)):  # the numbers never shrink
        table.add_column(head, justify="left" if i in (0, 4) else "right", no_wrap=True, min_width=width)
    # the sentence takes what is left of the line (2 columns between cells) and ends in "…" if cut
    room = max(12, console.width - sum(widths) - 2 * len(widths))
    table.add_column("what the text says", no_wrap=True, overflow="ellipsis", max_width=room)
    for cells, text, style in rows:
        *plain, status = (escape(c) for c in cells)
        table.add_row(*plain, f"[{style}]{status}[/{style}]", escape(text))
    return table, wrong


def show_example(example: WorkedExample, decimals: int = 4) -> int:
    """Print an example's steps and checks; returns the number of wrong printed values."""
    results = example.check()  # raises before anything is printed if the example cannot be computed
    console.rule(f"[bold]{escape(example.title)}")
    if example.source:
        console.print(f"[dim]source: {escape(example.source)}[/dim]")
    vals = example.values()
    simple = example.kind == "simple"
    if simple:
        console.print("query = key = value = X (no learnable parameters), scale = 1 (lecture 000: no 1/√d)")
    else:
        console.print(f"scale = 1/√d_k = {example.steps.scale:.6f}")
    labels = example.tokens
    tables = []
    for name, title in _STEP_TITLES:
        if simple and name in ("query", "key", "value", "scaled_scores"):
            continue
        m = vals[name]
        cols = labels if name in ("scores", "scaled_scores", "exp_scores", "weights") else None
        if name == "normaliser":
            m, cols = m[:, None], ["Σ exp"]
        tables.append(matrix_table(m, title=title, row_labels=labels, col_labels=cols, decimals=decimals))
    console.print(Columns(tables, padding=(1, 3)))
    focus = example.focus
    if focus is not None:
        w, ctx = vals["weights"][focus], vals["context"][focus]
        vname = "x" if simple else "v"
        terms = " + ".join(f"{float(w[j]):.4f}·{vname}({labels[j]})" for j in range(len(labels)))
        vec = ", ".join(f"{float(c):.4f}" for c in ctx)
        console.print(
            f"[bold]context vector of “{escape(labels[focus])}”[/bold]: z = {escape(terms)} = \\[{vec}]"
        )
    table, wrong = check_table(example, results)
    console.print(table)
    return wrong


def demo(
    example: list[str] = typer.Option(
        None, "--example", "-e", help="Only these examples (default: all shipped: journey, two-token)."
    ),
    decimals: int = typer.Option(4, help="Decimals shown in the step tables."),
) -> None:
    """Replay the lectures' worked examples step by step with exact values; flag printed numbers
    that are off by more than their own rounding."""
    names = example or list_examples()
    unknown = [n for n in names if n not in list_examples()]
    if unknown:
        raise UsageError(f"unknown example {unknown[0]!r}; shipped examples: {', '.join(list_examples())}")
    if not 0 <= decimals <= 12:
        raise UsageError(f"--decimals must be between 0 and 12, got {decimals}")
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
            what = "; ".join(
                f"{r.number.step}{list(r.number.at)} printed {r.number.printed} (exact {r.exact:.4f})"
                for r in bad
            )
            lines.append(
                f"[bold]{ex.name}[/bold]: [red]{wrong} of {total} printed numbers are wrong[/red]: {what}"
            )
        else:
            lines.append(f"[bold]{ex.name}[/bold]: [green]all {total} printed numbers check out[/green]")
    console.print(Panel("\n".join(lines), title="verdict", expand=False))


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
