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
    help="The lectures' claims and exercises, measured: `lesson list`, `lesson show NAME`, "
    "`lesson run NAME [--out DIR]`.",
    no_args_is_help=True,
)

_STATUS_STYLE = {"holds": "green", "does not hold": "red", "holds only when": "yellow"}


def _by_lecture() -> list[tuple[str, list[Any]]]:
    from ..lessons import all_lessons

    groups: dict[str, list[Any]] = {}
    for lesson in all_lessons():
        groups.setdefault(lesson.lecture, []).append(lesson)
    return sorted(groups.items())


def _show(lesson: Any) -> None:
    """The whole record of one lesson: lecture, section, the claim (Chinese and English), status."""
    from rich.padding import Padding
    from rich.text import Text

    from ..lectures import label

    console.print(Text.assemble((lesson.name, "bold"), " — ", lesson.status))
    lines = [
        "{lecture}, {section}".format(lecture=label(lesson.lecture), section=lesson.section),
        "kind: {kind}".format(kind=lesson.kind),
        lesson.claim_zh,
        lesson.claim_en,
    ]
    if lesson.reason:
        lines.append("not measured: {why}".format(why=lesson.reason))
    for line in lines:  # plain text: lesson texts are never parsed as markup
        console.print(Padding(Text(line), (0, 0, 0, 2)))


@lesson_app.command("list")
def list_lessons(
    long: bool = typer.Option(False, "--long", "-l", help="Show each lesson's section and claims."),
) -> None:
    """Every lesson, by lecture: name, status (run / checker / discussed) and what it is about."""
    from rich.markup import escape
    from rich.table import Table

    from ..lectures import label

    for number, group in _by_lecture():
        if long:
            console.rule(f"[bold]{label(number)}", align="left")
            for lesson in group:
                _show(lesson)
            continue
        table = Table(title=label(number), title_justify="left", title_style="bold", box=None, pad_edge=False)
        table.add_column("name", no_wrap=True, min_width=max(len(lesson.name) for lesson in group))
        table.add_column("status", no_wrap=True, min_width=max(len(lesson.status) for lesson in group))
        table.add_column("about", no_wrap=True, overflow="ellipsis")
        for lesson in group:
            table.add_row(lesson.name, lesson.status, escape(lesson.summary))
        console.print(table)
    console.print(
        "Details: [bold]lesson show NAME[/bold] or [bold]lesson list --long[/bold]. "
        "Run one with [bold]lesson run NAME [--out DIR][/bold], or all with [bold]lesson run all[/bold]."
    )


@lesson_app.command("show")
def show_lesson(name: str = typer.Argument(..., help="Lesson name (see `lesson list`).")) -> None:
    """One lesson's lecture, section, claim (as quoted and in English) and status."""
    from .. import lessons

    try:
        lesson = lessons.get(name)
    except KeyError as e:
        raise UsageError(e.args[0]) from None
    _show(lesson)


def _print_result(result: Any, out: Path | None = None) -> None:
    from rich import box
    from rich.markup import escape
    from rich.panel import Panel
    from rich.table import Table

    from ..lectures import label

    lesson = result.lesson
    console.print(
        Panel(
            f"[dim]{escape(lesson.section)}[/dim]\n[bold]{escape(lesson.claim_zh)}[/bold]\n{escape(lesson.claim_en)}",
            title=f"{lesson.name} — {label(lesson.lecture)}",
            title_align="left",
        )
    )
    for t in result.tables:
        table = Table(title=escape(t.title), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for col in t.columns:
            table.add_column(escape(col), overflow="fold")
        for row in t.rows:
            table.add_row(*(escape(str(c)) for c in row))
        console.print(table)
    for note in result.notes:
        console.print(f"[dim]note:[/dim] {escape(note)}", highlight=False)
    for path in result.figures:
        console.print(f"figure: {path}", highlight=False)
    if out is not None and not result.figures:
        console.print(
            "[dim]this lesson draws no figure: nothing was written to {out}[/dim]".format(
                out=escape(str(out))
            )
        )
    style = _STATUS_STYLE[result.verdict.status]
    console.print(
        f"[bold]verdict:[/bold] [{style}]{escape(result.verdict.short)}[/{style}] — {escape(result.verdict.because)}",
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
        _print_result(result, out)
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
