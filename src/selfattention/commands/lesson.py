"""``selfattention lesson list`` and ``selfattention lesson run NAME [--out DIR]``.

Every claim and exercise of lectures 000 and 003 as a lesson (see :mod:`selfattention.lessons`): the
claim, a table of what was measured with this library's own functions, and a computed verdict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ..i18n import N_, _, pgettext
from . import UsageError, console

lesson_app = typer.Typer(
    help=N_(
        "The lectures' claims and exercises, measured: `lesson list`, `lesson show NAME`, "
        "`lesson run NAME [--out DIR]`."
    ),
    no_args_is_help=True,
)

_STATUS_STYLE = {"holds": "green", "does not hold": "red", "holds only when": "yellow"}
#: how a verdict's status reads (the statuses themselves are data: ``lessons.HOLDS`` ...)
_STATUS_TEXT = {
    "holds": N_("holds"),
    "does not hold": N_("does not hold"),
    "holds only when": N_("holds only when {condition}"),
}
#: the words of ``Lesson.status`` and ``Lesson.kind`` as shown
_WORDS = {
    "run": N_("run"),
    "checker": N_("checker"),
    "discussed": N_("discussed"),
    "measured": N_("measured"),
    "exercise": N_("exercise"),
}


def verdict_text(verdict: Any) -> str:
    """A verdict's status (with its condition) in the interface language, without the numbers."""
    return _(_STATUS_TEXT[verdict.status]).format(condition=verdict.condition)


def status_text(lesson: Any) -> str:
    """``Lesson.status`` (``run, model, 2 min`` ...) in the interface language."""
    words = []
    for w in lesson.status.split(", "):
        if w == "model":  # the lesson needs the model (not the noun of a table column: 模型)
            words.append(pgettext("lesson status", "model"))
        elif w in _WORDS:
            words.append(_(_WORDS[w]))
        elif w.endswith(" min") and w[:-4].isdigit():
            words.append(_("{n} min").format(n=w[:-4]))
        else:
            words.append(w)
    return _(", ").join(words)


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

    console.print(Text.assemble((lesson.name, "bold"), _(" — "), status_text(lesson)))
    lines = [
        _("{lecture}, {section}").format(lecture=label(lesson.lecture), section=lesson.section),
        _("kind: {kind}").format(kind=_(_WORDS[lesson.kind])),
        lesson.claim_zh,
        _(lesson.claim_en),
    ]
    if lesson.reason:
        lines.append(_("not measured: {why}").format(why=_(lesson.reason)))
    for line in lines:  # plain text: lesson texts are never parsed as markup
        _print_unpadded(Padding(Text(line), (0, 0, 0, 2)))


@lesson_app.command(
    "list",
    help=N_("Every lesson, by lecture: name, status (run / checker / discussed) and what it is about."),
)
def list_lessons(
    long: bool = typer.Option(False, "--long", "-l", help=N_("Show each lesson's section and claims.")),
) -> None:
    from rich.cells import cell_len
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from ..lectures import label

    for number, group in _by_lecture():
        if long:
            console.rule(f"[bold]{label(number)}", align="left")
            for lesson in group:
                _show(lesson)
            continue
        table = Table(title=label(number), title_justify="left", title_style="bold", box=None, pad_edge=False)
        table.add_column(_("name"), no_wrap=True, min_width=max(len(lesson.name) for lesson in group))
        table.add_column(
            _("status"), no_wrap=True, min_width=max(cell_len(status_text(lesson)) for lesson in group)
        )
        table.add_column(_("about"), overflow="fold")  # wraps when it must: never cut
        for lesson in group:
            table.add_row(lesson.name, status_text(lesson), escape(_(lesson.summary)))
        _print_unpadded(table)
    _print_unpadded(
        Text(
            _(
                "Details: lesson show NAME or lesson list --long. "
                "Run one with lesson run NAME [--out DIR], or all with lesson run all."
            )
        )
    )


def _print_unpadded(renderable: Any) -> None:
    """``renderable`` printed without the spaces rich pads each line with up to the table's width (a copied
    or piped listing then has no trailing whitespace)."""
    from rich.segment import Segment, Segments

    for line in console.render_lines(renderable, pad=False, new_lines=False):
        while line and not line[-1].text.strip() and not line[-1].control:
            line.pop()
        if line:
            line[-1] = Segment(line[-1].text.rstrip(), line[-1].style)
        console.print(Segments([*line, Segment.line()]), end="")


@lesson_app.command(
    "show", help=N_("One lesson's lecture, section, claim (as quoted and in English) and status.")
)
def show_lesson(name: str = typer.Argument(..., help=N_("Lesson name (see `lesson list`)."))) -> None:
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

    from ..i18n import language
    from ..lectures import label

    lesson = result.lesson
    console.print(
        Panel(
            f"[dim]{escape(lesson.section)}[/dim]\n[bold]{escape(lesson.claim_zh)}[/bold]"
            + ("" if language() == "zh" else f"\n{escape(lesson.claim_en)}"),
            title=_("{name} — {lecture}").format(name=lesson.name, lecture=label(lesson.lecture)),
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
        console.print(
            _("{label} {value}").format(label="[dim]{}[/dim]".format(escape(_("note:"))), value=escape(note)),
            highlight=False,
        )
    for path in result.figures:
        console.print(escape(_("figure: {path}").format(path=path)), highlight=False)
    if out is not None and not result.figures:
        console.print(
            "[dim]{}[/dim]".format(
                escape(_("this lesson draws no figure: nothing was written to {out}").format(out=out))
            )
        )
    style = _STATUS_STYLE[result.verdict.status]
    console.print(
        _("[bold]verdict:[/bold] {status} — {because}").format(
            status=f"[{style}]{escape(verdict_text(result.verdict))}[/{style}]",
            because=escape(result.verdict.because),
        ),
        highlight=False,
    )
    console.print(f"[dim]{result.seconds:.1f} s[/dim]")


@lesson_app.command(
    "run", help=N_("Run one lesson (or `all`): print the claim, what was measured, and the computed verdict.")
)
def run_lesson(
    name: str = typer.Argument(..., help=N_("Lesson name (see `lesson list`), or `all`.")),
    out: Path | None = typer.Option(
        None, "--out", help=N_("Folder for the figures (PNG); none if not given.")
    ),
) -> None:
    from rich.markup import escape
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
            raise UsageError(
                _("lesson {name!r} is {kind}, not runnable: {reason}").format(
                    name=name, kind=_(_WORDS[lesson.kind]), reason=_(lesson.reason)
                )
            )
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
                raise UsageError(
                    _("lesson {name!r} needs the real model: {error}").format(name=n, error=e)
                ) from None
        _print_result(result, out)
        results.append(result)
    if len(results) > 1:
        summary = Table(title=_("summary"), title_justify="left")
        for col in (_("lesson"), _("verdict"), _("seconds")):
            summary.add_column(col)
        for r in results:
            style = _STATUS_STYLE[r.verdict.status]
            summary.add_row(
                r.lesson.name, f"[{style}]{escape(verdict_text(r.verdict))}[/{style}]", f"{r.seconds:.1f}"
            )
        console.print(summary)


def register(app: typer.Typer) -> None:
    app.add_typer(lesson_app, name="lesson")
