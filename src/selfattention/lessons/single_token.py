"""Lesson ``single-token`` (lecture 003, exercise 4): with n = 1 attention degenerates.

One token: one score, softmax of one number is exactly 1, so the output is the token's own value
vector v = x·W_v (and z = x for the parameter-free form). Measured for random d, W and x in float64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..functional import simple_attention
from ..i18n import N_, _
from ..modules import SelfAttention
from ..trace import capture
from ._base import FAILS, HOLDS, Lesson, LessonResult, ResultTable, Verdict

LESSON = Lesson(
    name="single-token",
    summary=N_("one token: weight 1, output = v"),
    lecture="003",
    section="思考题 4",
    claim_zh="如果一句话只有一个词（n=1），打分、softmax、加权求和会发生什么退化？这时候输出和输入是什么关系？",
    claim_en=N_(
        "Exercise 4: with n = 1 the single weight is 1 and the output is the token's value vector "
        "v = x·W_v (z = x without projections), whatever the scores are."
    ),
    kind="exercise",
    module="single_token",
)

TOLERANCE = 1e-12


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``weight_error`` = max|α − 1|, ``output_error`` = max|z − v|, ``free_error`` = max|z − x|."""
    worst = max(m["weight_error"], m["output_error"], m["free_error"])
    if worst > TOLERANCE:
        return Verdict(FAILS, _("max deviation {worst:.3g} from weight 1 / output = v").format(worst=worst))
    return Verdict(
        HOLDS,
        _("over {cases} random cases: |α − 1| ≤ {weight_error:.0e}, |z − v| ≤ {output_error:.0e}").format(
            cases=m["cases"], weight_error=m["weight_error"], output_error=m["output_error"]
        ),
    )


def run(out_dir: Path | None = None, progress: Any = None, *, cases: int = 20, seed: int = 0) -> LessonResult:
    torch.manual_seed(seed)
    w_err = z_err = free_err = 0.0
    rows = []
    for i in range(cases):
        d_in, d_out = int(torch.randint(1, 80, ())), int(torch.randint(1, 80, ()))
        layer = SelfAttention(d_in, d_out).double()
        x = torch.randn(1, d_in, dtype=torch.float64) * 10  # large scores: still weight 1
        with capture() as traces, torch.no_grad():
            z = layer(x)
            v = layer.W_value(x)
        w = traces[0]["weights"]
        w_err = max(w_err, (w - 1).abs().max().item())
        z_err = max(z_err, (z - v).abs().max().item())
        free_err = max(free_err, (simple_attention(x) - x).abs().max().item())
        if i < 3:
            rows.append(
                [
                    d_in,
                    d_out,
                    f"{traces[0]['scores'].item():.3g}",
                    f"{w.item():.1f}",
                    f"{(z - v).abs().max():.0e}",
                ]
            )
    m = {"cases": cases, "weight_error": w_err, "output_error": z_err, "free_error": free_err}
    table = ResultTable(
        _("n = 1: the first random cases (float64)"),
        [_("d_in"), _("d_out"), _("score q·k"), _("weight"), _("max|z − v|")],
        rows,
    )
    return LessonResult(LESSON, m, verdict(m), tables=[table])
