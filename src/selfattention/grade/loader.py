"""Loading a learner's file (which executes it) and telling which task it implements."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

from . import fit
from .attention_tasks import DECODE, MODULE, SDPA, SIMPLE
from .fit import last_line_of, quiet, time_limit
from .layout_tasks import CAUSAL, HEADS

__all__ = ["MODULE_NAME", "FileSyntaxError", "detect_tasks", "load_file", "tasks_in_source"]

#: ``__name__`` of a learner's file while it runs: its ``if __name__ == "__main__":`` block does not run
MODULE_NAME = "__grade__"

#: most specific first: a file with a SelfAttention class may also define the function it calls
_ORDER = (DECODE, MODULE, HEADS, CAUSAL, SDPA, SIMPLE)


class FileSyntaxError(ValueError):
    """The learner's file is not valid Python: a usage error (nothing ran), naming file, line and column."""

    def __init__(self, path: Path, error: SyntaxError) -> None:
        from ..i18n import _

        self.file = str(path)
        self.line = error.lineno or 0
        self.column = error.offset or 0
        self.detail = error.msg or type(error).__name__
        super().__init__(
            _("{path}, line {line}, column {column}: not valid Python ({message})").format(
                path=self.file, line=self.line, column=self.column, message=self.detail
            )
        )

    def to_dict(self) -> dict[str, Any]:
        return {"error": str(self), "file": self.file, "line": self.line, "column": self.column,
                "message": self.detail}  # fmt: skip


def load_file(path: Path) -> tuple[dict[str, Any], str | None]:
    """Run the learner's file; returns its namespace and None, or ``({}, last traceback line)`` when it
    raised. Raises OSError when the file cannot be read, :class:`FileSyntaxError` (a ValueError) when it
    is not valid Python (then nothing runs).

    The file runs with ``__name__ == "__grade__"``, its folder first on ``sys.path`` (for its own helper
    modules), its prints sent to stderr. Running it executes it: grade only code you trust.
    """
    source = Path(path).read_text(encoding="utf-8")
    namespace: dict[str, Any] = {"__name__": MODULE_NAME, "__file__": str(path)}
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as e:  # IndentationError, TabError included
        raise FileSyntaxError(Path(path), e) from None
    folder = str(Path(path).resolve().parent)
    sys.path.insert(0, folder)
    try:
        with quiet(), time_limit(fit.TIME_LIMIT):
            exec(code, namespace)  # noqa: S102 — the point of the grader
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # the learner's error (sys.exit, os._exit too) is a finding, never a crash
        return {}, last_line_of(e)
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return namespace, None


def _defined_here(obj: Any) -> bool:
    return getattr(obj, "__module__", None) == MODULE_NAME


def detect_tasks(namespace: dict[str, Any]) -> list[str]:
    """The tasks whose names ``namespace`` defines (every name of a task, e.g. split_heads and
    merge_heads), most specific first. Names defined in the learner's file count before imported ones."""
    present = [t for t in _ORDER if all(callable(namespace.get(n)) for n in t.names)]
    own = [t for t in present if any(_defined_here(namespace[n]) for n in t.names)]
    return [t.name for t in (own or present)]


def tasks_in_source(path: Path) -> list[str]:
    """The tasks whose names the file's top level defines (def, class, assignment), read from its source
    without running it (for a file that raised while it ran), most specific first."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return [t.name for t in _ORDER if all(n in names for n in t.names)]
