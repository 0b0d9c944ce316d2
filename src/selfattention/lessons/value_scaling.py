"""Lesson ``value-scales-output`` (lecture 003, exercise 1): W_v = 3I instead of 2I.

The hand example: x₁ = [1, 0], x₂ = [0, 1], W_q = W_k = I. With W_v = 2I the weights of position 1 are
(0.670, 0.330) and its output is [1.340, 0.660]. With W_v = 3I the weights depend only on Q and K, so
they do not change; the output is 3/2 of the old one: [2.010, 0.990]. Q and K decide *where to look*,
V decides *what is fetched*.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..i18n import N_, _
from ..modules import SelfAttention
from ..trace import capture
from ._base import FAILS, HOLDS, Lesson, LessonResult, ResultTable, Verdict

LESSON = Lesson(
    name="value-scales-output",
    summary=N_("W_v = 3I scales the output only"),
    lecture="003",
    section="思考题 1",
    claim_zh="把 Wv 换成 3×单位矩阵（其他不变），重新算一遍位置 1 的输出。权重会变吗？输出向量的数值会怎么变？",
    claim_en=N_(
        "Exercise 1: with W_v = 3I the weights stay the same and every output is scaled by 3/2 "
        "(Q, K decide the weights; V decides the content)."
    ),
    kind="exercise",
    module="value_scaling",
)

TOLERANCE = 1e-12


def _layer(v_factor: float) -> SelfAttention:
    layer = SelfAttention(2, 2).double()
    with torch.no_grad():
        layer.W_query.weight.copy_(torch.eye(2))
        layer.W_key.weight.copy_(torch.eye(2))
        layer.W_value.weight.copy_(v_factor * torch.eye(2))
    return layer


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``weight_change`` = max|α(3I) − α(2I)|, ``output_error`` = max|z(3I) − 1.5·z(2I)|."""
    dw, dz = m["weight_change"], m["output_error"]
    if dw > TOLERANCE:
        return Verdict(FAILS, _("the weights changed by {dw:.3g}").format(dw=dw))
    if dz > TOLERANCE:
        return Verdict(FAILS, _("the weights are unchanged but z(3I) − 1.5·z(2I) = {dz:.3g}").format(dz=dz))
    return Verdict(
        HOLDS,
        _(
            "weights unchanged (max change {dw:.1g}); outputs exactly 1.5× (max error {dz:.1g}); position 1: {z1_3I}"
        ).format(dw=dw, dz=dz, z1_3I=m["z1_3I"]),
    )


def run(out_dir: Path | None = None, progress: Any = None) -> LessonResult:
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    results = {}
    for factor in (2.0, 3.0):
        with capture() as traces, torch.no_grad():
            out = _layer(factor)(x)
        results[factor] = (traces[0]["weights"], out)
    (w2, z2), (w3, z3) = results[2.0], results[3.0]
    m = {
        "weight_change": (w3 - w2).abs().max().item(),
        "output_error": (z3 - 1.5 * z2).abs().max().item(),
        "w1_2I": [round(v, 3) for v in w2[0].tolist()],
        "z1_2I": [round(v, 3) for v in z2[0].tolist()],
        "z1_3I": [round(v, 3) for v in z3[0].tolist()],
    }
    table = ResultTable(
        _("lecture 003 hand example, position 1 (x₁ = [1, 0], x₂ = [0, 1], W_q = W_k = I)"),
        ["W_v", _("weights (1,1), (1,2)"), _("output₁")],
        [
            [_("2I (lecture)"), f"{w2[0, 0]:.3f}, {w2[0, 1]:.3f}", f"[{z2[0, 0]:.3f}, {z2[0, 1]:.3f}]"],
            [_("3I (exercise)"), f"{w3[0, 0]:.3f}, {w3[0, 1]:.3f}", f"[{z3[0, 0]:.3f}, {z3[0, 1]:.3f}]"],
        ],
    )
    return LessonResult(
        LESSON,
        m,
        verdict(m),
        tables=[table],
        notes=[_("Q and K decide the weights (where to look); V decides what is fetched (the content).")],
    )
