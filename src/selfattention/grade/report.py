"""The grader's report: findings (each mistake named, with its lecture passage), probes, text and JSON.

JSON schema (``Report.to_dict``; ``schema`` = 1)::

    {"schema": 1, "task": "scaled_dot_product_attention", "signature": "...", "passed": false,
     "language": "en", "file": "mine.py" | null,
     "findings": [{"code": "missing_scale", "message": "...", "lecture": "003",
                   "passage": "lecture 003 · 自注意力 Q/K/V, §三 …: “…”", "note": "", "detail": ""}],
     "probes": [{"name": "Tq = 3, Tk = 7, no mask", "matches_spec": false, "raised": null,
                 "max_error": 0.41}],
     "notes": ["..."]}

``passed`` is true exactly when every probe matches the spec (then ``findings`` is empty).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..i18n import _, language, ngettext
from ..lectures import label

__all__ = ["Finding", "ProbeResult", "Report", "SCHEMA"]

SCHEMA = 1


@dataclass(frozen=True)
class Finding:
    """One mistake found: its ``code`` (see :data:`selfattention.grade.MISTAKES`), the message in the
    interface language, the lecture ("000"/"003", or "" when none applies), the passage, a detail (the
    exception's last line, the shapes) and a note saying what the rule rests on where the lecture does not
    state it (masks, heads, the cache)."""

    code: str
    message: str
    lecture: str
    passage: str
    detail: str = ""
    note: str = ""

    def to_dict(self) -> dict[str, str]:
        return {
            "code": self.code,
            "message": self.message,
            "lecture": self.lecture,
            "passage": self.passage,
            "note": self.note,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class ProbeResult:
    """One probe: its name (interface language), whether the learner's output matched the spec, the last
    traceback line when their code raised, and the largest difference from the spec when comparable."""

    name: str
    matches_spec: bool
    raised: str | None = None
    max_error: float | None = None

    def to_dict(self) -> dict[str, Any]:
        err = self.max_error
        if (
            err is not None
        ):  # JSON has no inf: a non-finite difference (NaN where the spec has numbers) is null
            err = float(f"{err:.6g}") if math.isfinite(err) else None
        return {"name": self.name, "matches_spec": self.matches_spec, "raised": self.raised, "max_error": err}


@dataclass
class Report:
    """What :func:`selfattention.grade.grade` found. ``str(report)`` is the text the CLI prints."""

    task: str
    signature: str
    lecture: str
    contract: str = ""
    findings: list[Finding] = field(default_factory=list)
    probes: list[ProbeResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    file: str | None = None
    language: str = field(default_factory=language)

    @property
    def passed(self) -> bool:
        """True when every probe matched the spec and nothing was found."""
        return not self.findings and bool(self.probes) and all(p.matches_spec for p in self.probes)

    @property
    def codes(self) -> list[str]:
        """The mistake codes found, in report order."""
        return [f.code for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready report (schema in this module's docstring)."""
        return {
            "schema": SCHEMA,
            "task": self.task,
            "signature": self.signature,
            "contract": self.contract,
            "passed": self.passed,
            "language": self.language,
            "file": self.file,
            "findings": [f.to_dict() for f in self.findings],
            "probes": [p.to_dict() for p in self.probes],
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=2)

    def lines(self) -> list[str]:
        """The report as lines of plain text, in the interface language."""
        out = [
            _("grade · {task} ({lecture})").format(task=self.task, lecture=label(self.lecture)),
            "  " + _("expects: {signature}").format(signature=self.signature),
        ]
        if self.contract:
            out.append("    " + self.contract)
        ok = sum(p.matches_spec for p in self.probes)
        out.append(
            "  "
            + ngettext(
                "{ok} of {n} probe matches the spec", "{ok} of {n} probes match the spec", len(self.probes)
            ).format(ok=ok, n=len(self.probes))
        )
        for p in self.probes:
            mark = "✓" if p.matches_spec else "✗"
            what = ""
            if p.raised:
                what = _("raised {error}").format(error=p.raised)
            elif p.max_error is not None and not p.matches_spec:
                if math.isfinite(p.max_error):
                    what = _("largest difference {value:.3g}").format(value=p.max_error)
                else:
                    what = _("NaN or ∞ where the spec has numbers")
            text = _("{probe} — {what}").format(probe=p.name, what=what) if what else p.name
            out.append(f"    {mark} {text}")
        for f in self.findings:
            out.append(f"  ✗ [{f.code}] {f.message}")
            if f.passage:
                out.append("      " + _("see {passage}").format(passage=f.passage))
            if f.note:
                out.append("      " + f.note)
        for note in self.notes:
            out.append("  " + _("note: {note}").format(note=note))
        if self.passed:
            out.append(_("result: correct — every probe matches the spec"))
        else:
            n = len(self.findings)
            out.append(ngettext("result: {n} mistake found", "result: {n} mistakes found", n).format(n=n))
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def _repr_markdown_(self) -> str:  # notebooks show the report as text
        return "```text\n" + str(self) + "\n```"
