"""Lesson ``weights-are-distributions`` (lecture 003 §3): softmax turns a row of scores into legal weights.

"一组非负、加起来等于 1 的权重": measured on random scores of growing size (up to |score| ~ 10⁴ in
float32, where a naive exp would overflow) and on every layer and head of MiniLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..functional import attention_weights
from ..i18n import N_, _
from ._base import FAILS, HOLDS, Lesson, LessonResult, ResultTable, Verdict

LESSON = Lesson(
    name="weights-are-distributions",
    summary=N_("each row of weights sums to 1"),
    lecture="003",
    section="softmax：把打分变成合法权重",
    claim_zh="套 softmax，变成一组非负、加起来等于 1 的权重",
    claim_en=N_(
        "Softmax turns each row of scores into non-negative weights that sum to 1, whatever the scores."
    ),
    kind="measured",
    module="weights_distribution",
    needs_model=True,
)

TOLERANCE = 1e-5  # float32


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``min_weight``, ``max_sum_error`` (max |Σ_j α_ij − 1|), ``finite`` (no NaN/inf)."""
    if not m["finite"] or m["min_weight"] < 0 or m["max_sum_error"] > TOLERANCE:
        return Verdict(
            FAILS,
            _("min weight {min_weight:.3g}, max |row sum − 1| {max_sum_error:.3g}, finite {finite}").format(
                min_weight=m["min_weight"], max_sum_error=m["max_sum_error"], finite=m["finite"]
            ),
        )
    return Verdict(
        HOLDS,
        _(
            "min weight {min_weight:.2g} ≥ 0, max |row sum − 1| = {max_sum_error:.1e} over {rows:,} rows"
        ).format(min_weight=m["min_weight"], max_sum_error=m["max_sum_error"], rows=m["rows"]),
    )


def run(
    out_dir: Path | None = None, progress: Any = None, *, use_model: bool = True, seed: int = 0
) -> LessonResult:
    gen = torch.Generator().manual_seed(seed)
    rows, mins, errs, finite, count = [], [], [], True, 0
    for magnitude in (1e-3, 1.0, 1e2, 1e4):
        q = torch.randn(8, 33, 16, generator=gen) * magnitude**0.5
        k = torch.randn(8, 47, 16, generator=gen) * magnitude**0.5
        w = attention_weights(q, k, scale=1.0)
        err = (w.sum(-1) - 1).abs().max().item()
        finite &= bool(torch.isfinite(w).all())
        mins.append(w.min().item())
        errs.append(err)
        count += w.shape[0] * w.shape[1]
        rows.append(
            [_("random, |score| ~ {value:g}").format(value=magnitude * 4), f"{w.min():.2g}", f"{err:.1e}"]
        )
    if use_model:
        from ..pretrained import run_text

        r = run_text("Attention turns scores into weights that sum to one.", compare=False)
        w = r.attentions
        err = (w.sum(-1) - 1).abs().max().item()
        finite &= bool(torch.isfinite(w).all())
        mins.append(w.min().item())
        errs.append(err)
        count += w.numel() // w.shape[-1]
        rows.append([_("MiniLM, 6 layers × 12 heads"), f"{w.min():.2g}", f"{err:.1e}"])
    m = {"min_weight": min(mins), "max_sum_error": max(errs), "finite": finite, "rows": count}
    table = ResultTable(
        _("softmax rows (float32)"), [_("input"), _("min weight"), _("max |row sum − 1|")], rows
    )
    return LessonResult(LESSON, m, verdict(m), tables=[table])
