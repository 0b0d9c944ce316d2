"""``selfattention fuzz --seconds N``: throw good and bad input at every public function for N seconds."""

from __future__ import annotations

from pathlib import Path

import typer

from ..i18n import N_, _
from . import UsageError, console

_HELP = N_(
    "Fuzz the public functions (hypothesis): only ValueError/TypeError with a clear message, never NaN "
    "where the float64 spec is finite, never a modified argument. Exit code 1 if anything else happened."
)


def fuzz(
    seconds: float = typer.Option(60.0, "--seconds", help=N_("How long to fuzz, in seconds.")),
    minutes: float | None = typer.Option(
        None, "--minutes", help=N_("How long to fuzz, in minutes (overrides --seconds).")
    ),
    seed: int | None = typer.Option(None, "--seed", help=N_("Make the run reproducible.")),
    json_path: Path | None = typer.Option(
        None, "--json", help=N_("Also write the report as JSON to this file.")
    ),
) -> None:
    import json

    from ..fuzz import format_report, run

    total = minutes * 60 if minutes is not None else seconds
    if not total > 0:
        raise UsageError(
            _("--seconds / --minutes: the fuzzing time must be positive, got {value:g} s").format(value=total)
        )
    if json_path is not None and json_path.parent and not json_path.parent.is_dir():
        raise UsageError(
            _("cannot write the report to {path}: folder {folder} does not exist").format(
                path=json_path, folder=json_path.parent
            )
        )
    with console.status(_("fuzzing …")) as status:

        def progress(r) -> None:
            status.update(
                _("fuzzing … {seconds:.0f}/{total:.0f} s, {inputs} inputs, {failures} failures").format(
                    seconds=r.seconds, total=total, inputs=r.inputs, failures=len(r.failures)
                )
            )

        report = run(total, seed=seed, progress=progress)
    console.print(format_report(report), highlight=False, markup=False)
    if json_path is not None:
        json_path.write_text(json.dumps(report.as_dict(), indent=2), encoding="utf-8")
    if not report.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("fuzz", help=_HELP)(fuzz)
