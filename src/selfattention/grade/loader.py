"""Loading a learner's file (which executes it) and telling which task it implements."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from . import fit
from .attention_tasks import DECODE, MODULE, SDPA, SIMPLE
from .fit import last_line_of, quiet, time_limit
from .layout_tasks import CAUSAL, HEADS

__all__ = ["MODULE_NAME", "detect_tasks", "load_file"]

#: ``__name__`` of a learner's file while it runs: its ``if __name__ == "__main__":`` block does not run
MODULE_NAME = "__grade__"

#: most specific first: a file with a SelfAttention class may also define the function it calls
_ORDER = (DECODE, MODULE, HEADS, CAUSAL, SDPA, SIMPLE)


def load_file(path: Path) -> tuple[dict[str, Any], str | None]:
    """Run the learner's file; returns its namespace and None, or ``({}, last traceback line)`` when it
    raised (a SyntaxError included). Raises OSError when the file cannot be read.

    The file runs with ``__name__ == "__grade__"``, its folder first on ``sys.path`` (for its own helper
    modules), its prints sent to stderr. Running it executes it: grade only code you trust.
    """
    source = Path(path).read_text(encoding="utf-8")
    namespace: dict[str, Any] = {"__name__": MODULE_NAME, "__file__": str(path)}
    folder = str(Path(path).resolve().parent)
    sys.path.insert(0, folder)
    try:
        with quiet(), time_limit(fit.TIME_LIMIT):
            exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 — the point of the grader
    except (Exception, SystemExit) as e:  # the learner's error is a finding, never a crash
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
