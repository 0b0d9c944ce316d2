"""``selfattention grade FILE.py``: run a learner's attention code against the spec, name each mistake."""

from __future__ import annotations

import json
import sys
import unicodedata
from pathlib import Path

import typer
from rich.cells import cell_len
from rich.markup import escape

from ..i18n import N_, _
from . import UsageError, console

_HELP = N_(
    "Grade your own attention code: run FILE.py's implementation of one of the lectures' tasks on probes, "
    "compare it with the spec and name each mistake with the lecture passage that covers it.\n\n"
    "The tasks: simple_attention(X) (lecture 000), scaled_dot_product_attention(q, k, v, mask=None), "
    "causal_mask(q_len, k_len), a SelfAttention(d_in, d_out) module with W_query/W_key/W_value, "
    "split_heads(x, num_heads) with merge_heads(x), decode_step(q, k, v, k_cache, v_cache, pos) "
    "(docs/grade.md). The task is found from the names FILE.py defines.\n\n"
    "This RUNS the code in FILE.py: grade only code you trust. Exit code 0: correct; 1: mistakes found; "
    "2: usage error."
)


#: full-width marks that never start a line, and openers that never end one (Chinese line-breaking rules)
_NO_START = set("，。、；：？！）》」』”’…")
_NO_END = set("（《「『“‘")


def _wide(ch: str) -> bool:
    return unicodedata.east_asian_width(ch) in "WF"


def _units(text: str) -> list[str]:
    """The unbreakable pieces of ``text``: words (with their trailing spaces) and single CJK characters,
    full-width closing marks glued to what precedes them and opening marks to what follows."""
    units: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == " " and units:
            units[-1] += ch
            i += 1
        elif _wide(ch):
            units.append(ch)
            i += 1
        else:
            j = i
            while j < len(text) and text[j] != " " and not _wide(text[j]):
                j += 1
            units.append(text[i : max(j, i + 1)])
            i = max(j, i + 1)
    glued: list[str] = []
    for unit in units:
        prev = glued[-1] if glued else ""
        if prev and (unit[0] in _NO_START or (prev[-1] in _NO_END and not prev.endswith(" "))):
            glued[-1] = prev + unit
        else:
            glued.append(unit)
    return glued


def wrap(line: str, width: int) -> list[str]:
    """``line`` folded to ``width`` terminal cells, at spaces or between CJK characters (never before a
    full-width comma or after an opening bracket); continuation lines hang under the text after the
    line's indent and mark (``✗ ``, ``✓ ``)."""
    if cell_len(line) <= width:
        return [line]
    lead = len(line) - len(line.lstrip(" "))
    hang = " " * (lead + (2 if line[lead : lead + 2] in ("✗ ", "✓ ") else 2))
    out: list[str] = []
    current = ""
    for unit in _units(line):
        if current.strip() and cell_len(current + unit.rstrip()) > width:
            out.append(current.rstrip())
            current = hang + unit.lstrip()
        else:
            current += unit
    out.append(current.rstrip())
    return out


def grade_command(
    file: Path = typer.Argument(..., help=N_("The Python file with your implementation (it is executed).")),
    task: str | None = typer.Option(
        None,
        "--task",
        help=N_(
            "The task to grade: simple_attention, scaled_dot_product_attention, causal_mask, "
            "SelfAttention, heads, decode_step. Default: found from the names in FILE."
        ),
    ),
    json_out: str | None = typer.Option(
        None,
        "--json",
        metavar="PATH|-",
        help=N_("Also write the report as JSON to PATH (- for stdout: then no text is printed)."),
    ),
) -> None:
    from ..grade import FileSyntaxError, grade_file, resolve_task

    if task is not None:
        resolve_task(task)  # an unknown --task is a usage error before the learner's code runs
    if not file.is_file():
        raise UsageError(_("{path} is not a file").format(path=file))
    if file.suffix != ".py":
        raise UsageError(_("{path} is not a Python file (.py)").format(path=file))
    if json_out not in (None, "-") and not Path(json_out).parent.is_dir():
        raise UsageError(_("--json: the folder of {path} does not exist").format(path=json_out))
    try:
        report = grade_file(file, task)
    except ValueError as e:  # not Python, or no task / several: a usage error (exit 2), and --json gets
        # {"error": ..., "file": ..., (line, column)}: an autograder reads one format either way
        if json_out is not None:
            payload = e.to_dict() if isinstance(e, FileSyntaxError) else {"error": str(e), "file": str(file)}
            text = json.dumps(payload, ensure_ascii=False, indent=2) + "\n"
            if json_out == "-":
                sys.stdout.write(text)
                raise typer.Exit(2) from None
            Path(json_out).write_text(text, encoding="utf-8")
        raise UsageError(str(e)) from None
    if json_out == "-":
        sys.stdout.write(report.to_json() + "\n")
    else:
        if json_out is not None:
            Path(json_out).write_text(report.to_json() + "\n", encoding="utf-8")
        lines = report.lines()
        for i, line in enumerate(lines):
            style = None
            if i == len(lines) - 1:
                style = "bold green" if report.passed else "bold red"
            elif line.lstrip().startswith("✗ ["):
                style = "red"
            for part in wrap(line, max(console.width, 40)):
                text = escape(part)
                console.print(
                    f"[{style}]{text}[/{style}]" if style else text, highlight=False, soft_wrap=True
                )
    if not report.passed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("grade", help=_HELP)(grade_command)
