"""``selfattention lesson list`` and ``selfattention lesson run NAME [--out DIR]``.

Every claim and exercise of lectures 000 and 003 as a lesson (see :mod:`selfattention.lessons`): the
claim, a table of what was measured with this library's own functions, and a computed verdict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from . import UsageError, console

lesson_app = typer.Typer(
    help="The lectures' claims and exercises, measured: `lesson list`, `lesson run NAME [--out DIR]`.",
    no_args_is_help=True,
)

_STATUS_STYLE = {"holds": "green", "does not hold": "red", "holds only when": "yellow"}


@lesson_app.command("list")
def list_lessons() -> None:
    """Every lesson with its lecture, kind and status (runnable, or why not)."""
    from rich.table import Table

    from ..lessons import all_lessons

    table = Table(title="lessons (lecture 000 = 简化自注意力, 003 = 自注意力 Q/K/V)", title_justify="left")
    for col in ("name", "lecture", "kind", "claim", "status"):
        table.add_column(col, overflow="fold")
    for lesson in all_lessons():
        if lesson.runnable:
            status = f"run: {lesson.budget}" + (", needs the model" if lesson.needs_model else "")
        elif lesson.kind == "checker":
            status = f"[cyan]checked by `selfattention check`[/cyan]: {lesson.reason}"
        else:
            status = f"[dim]discussed, not measurable: {lesson.reason}[/dim]"
        table.add_row(lesson.name, lesson.lecture, lesson.kind, lesson.claim_en, status)
    console.print(table)
    console.print(
        "Run one with [bold]selfattention lesson run NAME [--out DIR][/bold], or all with `lesson run all`."
    )


def _print_result(result: Any) -> None:
    from rich.panel import Panel
    from rich.table import Table

    lesson = result.lesson
    console.print(
        Panel(
            f"[bold]{lesson.claim_zh}[/bold]\n{lesson.claim_en}",
            title=f"{lesson.name} — lecture {lesson.lecture}, {lesson.section}",
            title_align="left",
        )
    )
    for t in result.tables:
        table = Table(title=t.title, title_justify="left")
        for col in t.columns:
            table.add_column(col, overflow="fold")
        for row in t.rows:
            table.add_row(*(str(c) for c in row))
        console.print(table)
    for note in result.notes:
        console.print(f"[dim]note:[/dim] {note}")
    for path in result.figures:
        console.print(f"figure: {path}")
    style = _STATUS_STYLE[result.verdict.status]
    console.print(
        f"[bold]verdict:[/bold] [{style}]{result.verdict.short}[/{style}] — {result.verdict.because}",
        highlight=False,
    )
    console.print(f"[dim]{result.seconds:.1f} s[/dim]")


@lesson_app.command("run")
def run_lesson(
    name: str = typer.Argument(..., help="Lesson name (see `lesson list`), or `all`."),
    out: Path | None = typer.Option(None, "--out", help="Folder for the figures (PNG); none if not given."),
) -> None:
    """Run one lesson (or `all`): print the claim, what was measured, and the computed verdict."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .. import lessons

    if name == "all":
        names = [lesson.name for lesson in lessons.all_lessons() if lesson.runnable]
    else:
        try:
            lesson = lessons.get(name)
        except KeyError as e:
            raise UsageError(e.args[0]) from None
        if not lesson.runnable:
            raise UsageError(f"lesson {name!r} is {lesson.kind}, not runnable: {lesson.reason}")
        names = [name]
    results = []
    for n in names:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress:
            try:
                result = lessons.run(n, out_dir=out, progress=progress)
            except ImportError as e:  # the model extra is missing
                raise UsageError(f"lesson {n!r} needs the real model: {e}") from None
        _print_result(result)
        results.append(result)
    if len(results) > 1:
        summary = Table(title="summary", title_justify="left")
        for col in ("lesson", "verdict", "seconds"):
            summary.add_column(col)
        for r in results:
            style = _STATUS_STYLE[r.verdict.status]
            summary.add_row(r.lesson.name, f"[{style}]{r.verdict.short}[/{style}]", f"{r.seconds:.1f}")
        console.print(summary)


def register(app: typer.Typer) -> None:
    app.add_typer(lesson_app, name="lesson")
