"""Worked examples as data, recomputed exactly, with every printed number checked.

A course author writes a TOML file with the inputs (token vectors, optionally projection matrices) and
the numbers their text prints, with the decimals shown; :func:`load_example` reads it,
:meth:`WorkedExample.steps` recomputes every step with :mod:`selfattention.functional` in float64, and
:meth:`WorkedExample.check` reports each printed number as ``ok``, ``within rounding`` or ``wrong``.

File format (``kind = "simple"``: lecture 000's query = key = value = inputs, no scaling;
``kind = "qkv"``: Q = X·W_query, K = X·W_key, V = X·W_value, scale 1/√d_k unless ``scale`` is given)::

    title = "Two tokens by hand"
    kind = "qkv"
    tokens = ["x1", "x2"]
    inputs = [[1.0, 0.0], [0.0, 1.0]]      # (T, d_in), one row per token
    W_query = [[1.0, 0.0], [0.0, 1.0]]     # (d_in, d_k): the lecture's row-vector convention x·W
    W_key = [[1.0, 0.0], [0.0, 1.0]]
    W_value = [[2.0, 0.0], [0.0, 2.0]]

    [[printed]]
    step = "weights"       # inputs query key value scores scale scaled_scores exp_scores normaliser weights context
    at = [0, 0]            # row (query token), column; [i] for normaliser; omit for scale
    value = "0.670"        # a string keeps the decimals shown ("0.670" = 3 decimals); or a number plus
    text = "weight(1,1)"   #   decimals = 3
                           # optional: text (the sentence in the source), text_zh, decimals
    # optional top-level: name, source, scale (default 1 for simple, 1/√d_k for qkv), focus (a token
    # index whose weighted sum the demo writes out)

Verdicts, with d the decimals shown and e the exact value:
    ok               |printed - e| ≤ ½·10⁻ᵈ (correctly rounded)
    within rounding  |printed - e| ≤ 1·10⁻ᵈ (one unit in the last digit: computed from rounded
                     intermediates)
    wrong            anything further off

Source of the shipped examples: lecture 000 (``journey``) and lecture 003 (``two-token``).
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from .functional import AttentionSteps, attention_steps
from .i18n import _, language

__all__ = [
    "WorkedExample",
    "PrintedNumber",
    "CheckResult",
    "WorkedExampleError",
    "list_examples",
    "load_example",
    "STEPS",
]

STEPS = (
    "inputs",
    "query",
    "key",
    "value",
    "scores",
    "scale",
    "scaled_scores",
    "exp_scores",
    "normaliser",
    "weights",
    "context",
)

OK, WITHIN, WRONG = "ok", "within rounding", "wrong"


class WorkedExampleError(ValueError):
    """A worked-example file that cannot be read: says which file, which field and why."""


@dataclass(frozen=True)
class PrintedNumber:
    """One number a text prints: ``step[at]`` shown as ``printed`` with ``decimals`` decimals."""

    step: str
    at: tuple[int, ...]
    printed: float
    decimals: int
    text: str = ""
    text_zh: str = ""  # the text in Chinese, shown under --lang zh when the file has one

    def display_text(self) -> str:
        """The text in the interface language: ``text_zh`` under ``--lang zh`` when the file has one."""
        return self.text_zh if language() == "zh" and self.text_zh else self.text


@dataclass(frozen=True)
class CheckResult:
    """A printed number against the exact value; ``error`` = printed − exact."""

    number: PrintedNumber
    exact: float
    error: float
    status: str

    @property
    def units_off(self) -> float:
        """|error| in units of the last printed digit."""
        return abs(self.error) * 10**self.number.decimals


def classify(printed: float, exact: float, decimals: int) -> str:
    """``ok`` / ``within rounding`` / ``wrong`` (see the module docstring).

    >>> classify(0.36, 0.37209, 2), classify(0.21, 0.21254, 2), classify(0.66, 0.6698, 2)
    ('wrong', 'ok', 'within rounding')
    """
    err = abs(printed - exact)
    unit = 10.0**-decimals
    slack = 1e-9 * max(1.0, abs(exact))
    if err <= 0.5 * unit + slack:
        return OK
    if err <= unit + slack:
        return WITHIN
    return WRONG


@dataclass
class WorkedExample:
    """A worked example: inputs, optional projections, and the numbers a text prints about it."""

    name: str
    title: str
    kind: str
    tokens: list[str]
    inputs: torch.Tensor  # (T, d_in) float64
    W_query: torch.Tensor | None = None  # (d_in, d_k)
    W_key: torch.Tensor | None = None
    W_value: torch.Tensor | None = None
    scale: float | None = None
    source: str = ""
    printed: list[PrintedNumber] = field(default_factory=list)
    path: Path | None = None
    focus: int | None = None  # a token whose context vector the text works out
    title_zh: str = ""  # the title in Chinese, shown when the interface speaks Chinese (--lang zh)
    source_zh: str = ""  # and the source

    def display_title(self) -> str:
        """The title in the interface language: ``title_zh`` under ``--lang zh`` when the file has one."""
        return self.title_zh if language() == "zh" and self.title_zh else self.title

    def display_source(self) -> str:
        """The source in the interface language: ``source_zh`` under ``--lang zh`` when the file has one."""
        return self.source_zh if language() == "zh" and self.source_zh else self.source

    @property
    def steps(self) -> AttentionSteps:
        """Every step, recomputed in float64 by :func:`selfattention.functional.attention_steps`."""
        x = self.inputs
        if self.kind == "simple":
            return attention_steps(x, x, x, scale=1.0 if self.scale is None else self.scale)
        assert self.W_query is not None and self.W_key is not None and self.W_value is not None
        return attention_steps(x @ self.W_query, x @ self.W_key, x @ self.W_value, scale=self.scale)

    def values(self) -> dict[str, torch.Tensor]:
        """All steps by name, plus the derived ``exp_scores`` (exp of the scaled scores, before
        normalising) and ``normaliser`` (their row sums, the softmax denominator)."""
        s = self.steps
        exp_scores = torch.exp(s.masked_scores)
        return {
            "inputs": self.inputs,
            "query": s.query,
            "key": s.key,
            "value": s.value,
            "scores": s.scores,
            "scale": torch.tensor(s.scale, dtype=torch.float64),
            "scaled_scores": s.scaled_scores,
            "exp_scores": exp_scores,
            "normaliser": exp_scores.sum(-1),
            "weights": s.weights,
            "context": s.context,
        }

    def check(self) -> list[CheckResult]:
        """Recompute every printed number; one :class:`CheckResult` each, in file order.

        Raises :class:`WorkedExampleError` if a step is not finite (inputs that overflow float64)."""
        vals = self.values()
        for name in ("scores", "weights", "context", *{n.step for n in self.printed}):
            if not bool(torch.isfinite(vals[name]).all()):
                raise WorkedExampleError(
                    _(
                        "{where}: step {name!r} is not finite in float64 (the inputs or projections are too large: their products overflow); use smaller numbers"
                    ).format(where=self._where(), name=name)
                )
        out = []
        for n in self.printed:
            t = vals[n.step]
            try:
                exact = float(t[n.at] if n.at else t)
            except (IndexError, RuntimeError, ValueError):
                raise WorkedExampleError(
                    _(
                        "{where}: printed number {value!r}: index {at} is out of range for step {step!r} of shape {shape}"
                    ).format(
                        where=self._where(),
                        value=n.text or n.step,
                        at=list(n.at),
                        step=n.step,
                        shape=tuple(t.shape),
                    )
                ) from None
            out.append(CheckResult(n, exact, n.printed - exact, classify(n.printed, exact, n.decimals)))
        return out

    def _where(self) -> str:
        return str(self.path) if self.path else self.name


def list_examples() -> list[str]:
    """Names of the shipped worked examples.

    >>> list_examples()
    ['journey', 'two-token']
    """
    folder = resources.files("selfattention") / "examples"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_example(name_or_path: str | Path) -> WorkedExample:
    """Load a shipped example by name (see :func:`list_examples`) or a TOML file by path.

    Raises :class:`WorkedExampleError` (a ``ValueError``) naming the file and the problem for a missing
    file, malformed TOML, missing or ill-shaped fields, unknown steps, and non-finite numbers.

    >>> ex = load_example("two-token")
    >>> [(r.number.text, r.status) for r in ex.check()][9]
    ('weight(1,1) ≈ 2.028 / 3.028 ≈ 0.670', 'ok')
    """
    p = Path(name_or_path)
    if p.suffix != ".toml" and str(name_or_path) in list_examples():
        resource = resources.files("selfattention") / "examples" / f"{name_or_path}.toml"
        text, where = resource.read_text(encoding="utf-8"), Path(str(resource))
    else:
        if not p.exists():
            shipped = ", ".join(list_examples())
            raise WorkedExampleError(
                _("no such worked example or file: {name!r} (shipped: {shipped})").format(
                    name=str(name_or_path), shipped=shipped
                )
            )
        if p.is_dir():
            raise WorkedExampleError(_("{path} is a directory, expected a .toml file").format(path=p))
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise WorkedExampleError(_("{path}: not a UTF-8 text file").format(path=p)) from None
        where = p
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise WorkedExampleError(_toml_error(where, e)) from None
    return _parse(data, where)


def _toml_error(where, e: tomllib.TOMLDecodeError) -> str:
    """tomllib's English message as the detail of a translated sentence that names the line and column."""
    found = re.fullmatch(r"(.*) \(at line (\d+), column (\d+)\)", str(e), flags=re.DOTALL)
    if found is None:
        return _("{where}: malformed TOML ({error})").format(where=where, error=e)
    detail, line, column = found.groups()
    return _("{where}: malformed TOML at line {line}, column {column} ({error})").format(
        where=where, line=line, column=column, error=detail
    )


def _matrix(data: dict, key: str, where: Path, required: bool = True) -> torch.Tensor | None:
    if key not in data:
        if required:
            raise WorkedExampleError(_("{where}: missing field {key!r}").format(where=where, key=key))
        return None
    rows = data[key]
    if (
        not isinstance(rows, list)
        or not rows
        or not all(isinstance(r, list) and r and all(_is_number(v) for v in r) for r in rows)
    ):
        raise WorkedExampleError(
            _("{where}: {key!r} must be a non-empty list of rows of numbers").format(where=where, key=key)
        )
    if len({len(r) for r in rows}) != 1:
        raise WorkedExampleError(
            _("{where}: the rows of {key!r} have different lengths {value}").format(
                where=where, key=key, value=[len(r) for r in rows]
            )
        )
    m = torch.tensor(rows, dtype=torch.float64)
    if not torch.isfinite(m).all():
        raise WorkedExampleError(
            _("{where}: {key!r} contains a non-finite number").format(where=where, key=key)
        )
    return m


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _decimals(s: str) -> int:
    s = s.strip().lower()
    if "e" in s:
        raise ValueError
    return len(s.split(".", 1)[1]) if "." in s else 0


_KEYS = (
    "kind", "inputs", "tokens", "W_query", "W_key", "W_value", "scale", "focus", "printed", "name", "title",
    "title_zh", "source", "source_zh",
)  # fmt: skip
_PRINTED_KEYS = ("step", "value", "decimals", "at", "text", "text_zh")


def _unknown_keys(table: dict, known: tuple[str, ...], where: str) -> None:
    """Refuse a key the checker does not read (a typo such as ``scael`` would be silently ignored)."""
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = _(" (did you mean {close!r}?)").format(close=close[0]) if close else ""
            raise WorkedExampleError(
                _("{where}: unknown key {key!r}{hint}; known keys: {known}").format(
                    where=where, key=key, hint=hint, known=", ".join(known)
                )
            )


def _parse(data: dict, where: Path) -> WorkedExample:
    _unknown_keys(data, _KEYS, str(where))
    kind = data.get("kind", "simple")
    if kind not in ("simple", "qkv"):
        raise WorkedExampleError(
            _("{where}: kind must be 'simple' or 'qkv', got {kind!r}").format(where=where, kind=kind)
        )
    inputs = _matrix(data, "inputs", where)
    assert inputs is not None
    n_tokens, d_in = inputs.shape
    tokens = data.get("tokens", [f"x{i + 1}" for i in range(n_tokens)])
    if not isinstance(tokens, list) or len(tokens) != n_tokens:
        raise WorkedExampleError(
            _("{where}: 'tokens' must list one name per input row ({n_tokens})").format(
                where=where, n_tokens=n_tokens
            )
        )
    mats: dict[str, torch.Tensor | None] = {}
    for key in ("W_query", "W_key", "W_value"):
        mats[key] = _matrix(data, key, where, required=kind == "qkv")
        if kind == "simple" and mats[key] is not None:
            raise WorkedExampleError(
                _("{where}: {key!r} given but kind = 'simple' (use kind = 'qkv')").format(
                    where=where, key=key
                )
            )
        if mats[key] is not None and mats[key].shape[0] != d_in:
            raise WorkedExampleError(
                _(
                    "{where}: {key!r} has {shape_0} rows but the inputs have d_in = {d_in} columns (inputs are rows: x·W needs W of shape (d_in, d_out))"
                ).format(where=where, key=key, shape_0=mats[key].shape[0], d_in=d_in)
            )
    if kind == "qkv" and mats["W_query"].shape[1] != mats["W_key"].shape[1]:
        raise WorkedExampleError(
            _(
                "{where}: W_query {shape_q} and W_key {shape_k} must have the same number of columns (d_k)"
            ).format(where=where, shape_q=tuple(mats["W_query"].shape), shape_k=tuple(mats["W_key"].shape))
        )
    scale = data.get("scale")
    if scale is not None and (not _is_number(scale) or not math.isfinite(scale)):
        raise WorkedExampleError(
            _("{where}: scale must be a finite number, got {scale!r}").format(where=where, scale=scale)
        )
    focus = data.get("focus")
    if focus is not None and (
        not isinstance(focus, int) or isinstance(focus, bool) or not 0 <= focus < n_tokens
    ):
        raise WorkedExampleError(
            _("{where}: focus must be a token index in 0..{last}, got {focus!r}").format(
                where=where, last=n_tokens - 1, focus=focus
            )
        )
    printed = []
    entries = data.get("printed", [])
    if not isinstance(entries, list):
        raise WorkedExampleError(
            _("{where}: 'printed' must be an array of tables ([[printed]])").format(where=where)
        )
    for i, entry in enumerate(entries, 1):
        printed.append(_parse_printed(entry, i, where))
    return WorkedExample(
        name=str(data.get("name", where.stem)),
        title=str(data.get("title", where.stem)),
        title_zh=str(data.get("title_zh", "")),
        kind=kind,
        tokens=[str(t) for t in tokens],
        inputs=inputs,
        W_query=mats["W_query"],
        W_key=mats["W_key"],
        W_value=mats["W_value"],
        scale=float(scale) if scale is not None else None,
        source=str(data.get("source", "")),
        source_zh=str(data.get("source_zh", "")),
        printed=printed,
        path=where,
        focus=focus,
    )


def _parse_printed(entry: object, i: int, where: Path) -> PrintedNumber:
    ctx = f"{where}: [[printed]] entry {i}"
    if not isinstance(entry, dict):
        raise WorkedExampleError(_("{ctx} must be a table").format(ctx=ctx))
    _unknown_keys(entry, _PRINTED_KEYS, ctx)
    step = entry.get("step")
    if step not in STEPS:
        raise WorkedExampleError(
            _("{ctx}: step must be one of {steps}; got {step!r}").format(
                ctx=ctx, steps=", ".join(STEPS), step=step
            )
        )
    if "value" not in entry:
        raise WorkedExampleError(
            _("{ctx}: missing 'value' (the number as printed, e.g. \"0.670\")").format(ctx=ctx)
        )
    raw = entry["value"]
    if _is_number(raw) and "decimals" not in entry:
        raise WorkedExampleError(
            _(
                "{ctx}: a numeric value needs 'decimals' (TOML drops trailing zeros); or write the value as a string, e.g. \"{raw}\""
            ).format(ctx=ctx, raw=raw)
        )
    try:
        if isinstance(raw, str):
            printed = float(raw)
            decimals = int(entry["decimals"]) if "decimals" in entry else _decimals(raw)
        elif _is_number(raw):
            printed, decimals = float(raw), int(entry["decimals"])
        else:
            raise ValueError
    except (ValueError, TypeError):
        raise WorkedExampleError(
            _('{ctx}: value must be a decimal number or a string like "0.670", got {raw!r}').format(
                ctx=ctx, raw=raw
            )
        ) from None
    if not math.isfinite(printed) or decimals < 0 or decimals > 15:
        raise WorkedExampleError(
            _("{ctx}: value {raw!r} / decimals {decimals} out of range").format(
                ctx=ctx, raw=raw, decimals=decimals
            )
        )
    at = entry.get("at", [])
    if not isinstance(at, list) or not all(
        isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in at
    ):
        raise WorkedExampleError(
            _("{ctx}: 'at' must be a list of non-negative integers, got {at!r}").format(ctx=ctx, at=at)
        )
    expected_rank = {"scale": 0, "normaliser": 1}.get(step, 2)
    if len(at) != expected_rank:
        raise WorkedExampleError(
            _("{ctx}: step {step!r} needs 'at' with {expected_rank} indices, got {at!r}").format(
                ctx=ctx, step=step, expected_rank=expected_rank, at=at
            )
        )
    return PrintedNumber(
        step=step,
        at=tuple(at),
        printed=printed,
        decimals=decimals,
        text=str(entry.get("text", "")),
        text_zh=str(entry.get("text_zh", "")),
    )
