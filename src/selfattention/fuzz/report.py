"""What a fuzz run found: inputs tried, documented errors by type and message, failures."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

ALLOWED = (ValueError, TypeError)
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
BAD_DTYPES = [torch.int64, torch.bool, torch.complex64]


class FuzzFailure(AssertionError):
    """An input the library handled wrongly (raised inside a hypothesis example so that it shrinks)."""


@dataclass
class FuzzReport:
    """What one fuzz run did.

    Attributes:
        seconds: wall time spent.
        inputs: inputs tried (every call counts, including those that raised documented errors).
        by_target: inputs per public function.
        errors: documented exceptions seen, keyed by ``"Type: message pattern"`` (numbers replaced by #).
        failures: descriptions of inputs handled wrongly, each with the shrunk example (each bug once).
        repeats: how many more times each failure was met again (not shrunk again).
    """

    seconds: float = 0.0
    inputs: int = 0
    by_target: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    repeats: Counter = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 1),
            "inputs": self.inputs,
            "by_target": dict(self.by_target.most_common()),
            "errors": dict(self.errors.most_common()),
            "failures": self.failures,
            "failure_repeats": dict(self.repeats),
            "ok": self.ok,
        }


def error_pattern(e: BaseException) -> str:
    msg = str(e).split("\n")[0]
    msg = re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "#", msg)
    msg = re.sub(r"torch\.\w+", "<dtype>", msg)
    return f"{type(e).__name__}: {msg[:90]}"
