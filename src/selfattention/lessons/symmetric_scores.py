"""Lesson ``symmetric-scores`` (lecture 000, limitation 2): ω_ij = ω_ji in the parameter-free form.

Measured: the relative asymmetry max|S − Sᵀ| / max|S| of the score table S for (a) the parameter-free
form S = X Xᵀ, (b) tied projections W_q = W_k (S = X W Wᵀ Xᵀ, still symmetric), (c) a SelfAttention layer
with independent W_q ≠ W_k, and (d) every layer of MiniLM. Also the asymmetry of the *weights* α: the
lecture says "权重完全对称", but softmax normalises each row by its own sum, so α_ij ≠ α_ji in general
even when ω_ij = ω_ji.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..functional import attention_steps, simple_attention_steps
from ..i18n import N_, _
from ..modules import SelfAttention
from ._base import FAILS, HOLDS, ONLY_WHEN, Lesson, LessonResult, ResultTable, Verdict

LESSON = Lesson(
    name="symmetric-scores",
    summary=N_("scores symmetric without W_q, W_k"),
    lecture="000",
    section="这个版本的局限在哪？——无方向性",
    claim_zh="无方向性：ω_ij = ω_ji，“我看你”和“你看我”权重完全对称",
    claim_en=N_(
        "Without projections the scores are symmetric, ω_ij = ω_ji; learned W_q ≠ W_k "
        "(lecture 003) break the symmetry."
    ),
    kind="measured",
    module="symmetric_scores",
    needs_model=True,
)

TOLERANCE = 1e-12
SENTENCE = "The cat sat on the mat because it was tired."


def asymmetry(s: torch.Tensor) -> float:
    """max |S − Sᵀ| / max |S| over the last two dims of ``s`` (0 for a symmetric table)."""
    return ((s - s.transpose(-2, -1)).abs().amax() / s.abs().amax()).item()


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``parameter_free`` / ``tied`` / ``untied`` relative asymmetries of the score table."""
    free, tied, untied = m["parameter_free"], m["tied"], m["untied"]
    if free > TOLERANCE or tied > TOLERANCE:
        return Verdict(
            FAILS, _("max|S − Sᵀ|/max|S| = {max:.3g} without distinct W_q, W_k").format(max=max(free, tied))
        )
    if untied <= TOLERANCE:
        return Verdict(HOLDS, _("the scores stay symmetric even with W_q ≠ W_k"))
    return Verdict(
        ONLY_WHEN,
        _(
            "asymmetry {free:.0e} parameter-free, {tied:.0e} with W_q = W_k, {untied:.2f} with W_q ≠ W_k"
        ).format(free=free, tied=tied, untied=untied),
        condition=_(
            "the query and key of a token are the same vector (no or tied W_q, W_k); "
            "and for the scores ω, not the row-normalised weights α"
        ),
    )


def run(
    out_dir: Path | None = None,
    progress: Any = None,
    *,
    T: int = 9,
    d: int = 59,
    use_model: bool = True,
    seed: int = 0,
) -> LessonResult:
    torch.manual_seed(seed)
    x = torch.randn(T, d, dtype=torch.float64) * 2 / d**0.5  # scores of order 1
    free = simple_attention_steps(x)
    layer = SelfAttention(d, 16).double()
    with torch.no_grad():
        q, k, v = layer.W_query(x), layer.W_key(x), layer.W_value(x)
        untied = attention_steps(q, k, v)
        tied = attention_steps(q, q, v)  # W_k := W_q
    m: dict[str, Any] = {
        "parameter_free": asymmetry(free.scores),
        "tied": asymmetry(tied.scores),
        "untied": asymmetry(untied.scores),
        "parameter_free_weights": asymmetry(free.weights),
    }
    table = ResultTable(
        _("relative asymmetry max|S − Sᵀ| / max|S|, random float64 inputs T = {T}, d = {d}").format(T=T, d=d),
        [_("form"), _("scores ω"), _("weights α")],
        [
            [
                _("parameter-free X Xᵀ"),
                f"{m['parameter_free']:.1e}",
                f"{m['parameter_free_weights']:.3f}",
            ],
            [
                _("tied W_q = W_k"),
                f"{m['tied']:.1e}",
                f"{asymmetry(tied.weights):.3f}",
            ],
            [
                _("SelfAttention, W_q ≠ W_k"),
                f"{m['untied']:.3f}",
                f"{asymmetry(untied.weights):.3f}",
            ],
        ],
    )
    tables = [table]
    figures = []
    if use_model:
        from ..pretrained import run_text

        r = run_text(SENTENCE, compare=False)
        steps = attention_steps(r.queries.double(), r.keys.double(), r.values.double())
        s = steps.scores  # (layers, heads, T, T)
        per_head = (s - s.transpose(-2, -1)).abs().amax(dim=(-2, -1)) / s.abs().amax(dim=(-2, -1))
        per_layer = per_head.amax(dim=-1)
        m["model_min_head"] = per_head.min().item()
        m["model_per_layer"] = [round(v, 4) for v in per_layer.tolist()]
        tables.append(
            ResultTable(
                _(
                    "MiniLM, “{SENTENCE}”: max|S − Sᵀ| / max|S| of Q Kᵀ per layer (0-based; 12 heads each)"
                ).format(SENTENCE=SENTENCE),
                [_("layer"), _("largest over heads"), _("smallest over heads")],
                [
                    [i, f"{per_layer[i]:.3f}", f"{per_head[i].min().item():.3f}"]
                    for i in range(per_head.shape[0])
                ],
            )
        )
        if out_dir is not None:
            from ._base import new_figure, save_figure

            fig, axes = new_figure(10, 4.2, ncols=2)
            head = s[0, 0]
            lim = head.abs().max().item()
            axes[0].imshow(free.scores.numpy(), cmap="coolwarm")
            axes[0].set_title(_("parameter-free X Xᵀ (symmetric)"))
            axes[1].imshow(head.numpy(), cmap="coolwarm", vmin=-lim, vmax=lim)
            axes[1].set_xticks(range(len(r.tokens)), r.tokens, rotation=90, fontsize=7)
            axes[1].set_yticks(range(len(r.tokens)), r.tokens, fontsize=7)
            axes[1].set_title(_("MiniLM layer 0, head 0: Q Kᵀ (not symmetric)"))
            figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(
        LESSON,
        m,
        verdict(m),
        tables=tables,
        figures=figures,
        notes=[
            _(
                "The weights α are not symmetric even in the parameter-free form: each row is divided by its "
                "own softmax sum, so α_ij = α_ji only when rows i and j have the same normaliser."
            )
        ],
    )
