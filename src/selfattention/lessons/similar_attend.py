"""Lesson ``similar-means-attend`` (lecture 000, limitation 1): the parameter-free form attends by
similarity, and with equal norms the largest weight always goes to the token itself.

Cauchy–Schwarz: x_i · x_j ≤ ‖x_i‖ ‖x_j‖ = ‖x_i‖² = x_i · x_i when all norms are equal, so in
softmax(X Xᵀ) the diagonal is the row maximum. With unequal norms a long vector can out-score the
token itself. On MiniLM's LayerNorm'd input embeddings (norms ≈ 7–12, d = 384) the unscaled scores are
so large that softmax(X Xᵀ) is almost the identity, so Z ≈ X: the token attends (almost) only to itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..functional import attention_weights, simple_attention_steps
from ..i18n import N_, _
from ._base import FAILS, HOLDS, ONLY_WHEN, Lesson, LessonResult, ResultTable, Verdict

LESSON = Lesson(
    name="similar-means-attend",
    summary=N_("the most similar gets most weight"),
    lecture="000",
    section="这个版本的局限在哪？——相似 = 关注",
    claim_zh="相似 = 关注：ω_ij 就是 x_i 和 x_j 的余弦相似度方向（没缩放的内积），语义相似的 token 必然互相关注",
    claim_en=N_(
        "In softmax(X Xᵀ) X the weights follow similarity: the most similar token — the token "
        "itself — gets the largest weight (exactly so when all norms are equal, by Cauchy–Schwarz)."
    ),
    kind="measured",
    module="similar_attend",
    needs_model=True,
)

SENTENCE = "The quick brown fox jumps over the lazy dog."


def self_argmax_rate(x: torch.Tensor) -> float:
    """Fraction of query rows of softmax(X Xᵀ) whose largest weight is on the diagonal. x (N, T, d)."""
    w = simple_attention_steps(x).weights  # (N, T, T)
    own = torch.arange(x.shape[-2])
    return (w.argmax(dim=-1) == own).double().mean().item()


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``equal_norm_self_rate`` and ``unequal_norm_self_rate`` (fractions of rows with argmax = self)."""
    eq, uneq = m["equal_norm_self_rate"], m["unequal_norm_self_rate"]
    if eq < 1.0:
        return Verdict(FAILS, _("with equal norms argmax = self in only {eq:.1%} of rows").format(eq=eq))
    if uneq >= 1.0:
        return Verdict(HOLDS, _("argmax = self in every row, with equal and with unequal norms"))
    return Verdict(
        ONLY_WHEN,
        _("argmax = self in {eq:.0%} of rows with equal norms, {uneq:.1%} with unequal norms").format(
            eq=eq, uneq=uneq
        ),
        condition=_("all input vectors have the same norm (Cauchy–Schwarz)"),
    )


def run(
    out_dir: Path | None = None,
    progress: Any = None,
    *,
    trials: int = 2000,
    T: int = 16,
    d: int = 32,
    use_model: bool = True,
    seed: int = 0,
) -> LessonResult:
    """Random (trials, T, d) float64 inputs with equal norms (all 3.0) and log-normal norms; MiniLM."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(trials, T, d, generator=gen, dtype=torch.float64)
    unit = x / x.norm(dim=-1, keepdim=True)
    equal = 3.0 * unit
    norms = torch.exp(0.5 * torch.randn(trials, T, 1, generator=gen, dtype=torch.float64)) * 3.0
    unequal = unit * norms
    m: dict[str, Any] = {
        "equal_norm_self_rate": self_argmax_rate(equal),
        "unequal_norm_self_rate": self_argmax_rate(unequal),
    }
    table = ResultTable(
        _(
            "argmax of softmax(X Xᵀ) row = the token itself ({trials} random sequences, T = {T}, d = {d})"
        ).format(trials=trials, T=T, d=d),
        [_("inputs"), _("rows with argmax = self")],
        [
            [
                _("all norms = 3"),
                f"{m['equal_norm_self_rate']:.2%}",
            ],
            [
                _("norms 3·exp(0.5·N(0,1))"),
                f"{m['unequal_norm_self_rate']:.2%}",
            ],
        ],
    )
    tables = [table]
    notes = []
    figures = []
    if use_model:
        from ..pretrained import run_text

        r = run_text(SENTENCE, compare=False)
        X = r.hidden_states[0][0].double()  # (T, 384): MiniLM's embeddings after LayerNorm
        w = simple_attention_steps(X).weights
        ws = attention_weights(X, X)  # scale 1/√384
        z = simple_attention_steps(X).context
        diag, diag_s = w.diagonal(), ws.diagonal()
        m.update(
            model_self_rate=self_argmax_rate(X[None]),
            model_norm_min=X.norm(dim=-1).min().item(),
            model_norm_max=X.norm(dim=-1).max().item(),
            model_diag_mean=diag.mean().item(),
            model_diag_min=diag.min().item(),
            model_rel_change=((z - X).norm() / X.norm()).item(),
            model_scaled_diag_mean=diag_s.mean().item(),
            model_scaled_diag_min=diag_s.min().item(),
            model_scaled_self_rate=(ws.argmax(-1) == torch.arange(X.shape[0])).double().mean().item(),
        )
        tables.append(
            ResultTable(
                _("MiniLM input embeddings (after LayerNorm) of “{SENTENCE}”, {shape_0} tokens").format(
                    SENTENCE=SENTENCE, shape_0=X.shape[0]
                ),
                [_("quantity"), _("softmax(X Xᵀ)"), _("softmax(X Xᵀ/√384)")],
                [
                    [
                        _("‖x‖ range"),
                        f"{m['model_norm_min']:.2f} – {m['model_norm_max']:.2f}",
                        "",
                    ],
                    [
                        _("rows with argmax = self"),
                        f"{m['model_self_rate']:.0%}",
                        f"{m['model_scaled_self_rate']:.0%}",
                    ],
                    [
                        _("mean diagonal weight"),
                        f"{m['model_diag_mean']:.6f}",
                        f"{m['model_scaled_diag_mean']:.3f}",
                    ],
                    [
                        _("min diagonal weight"),
                        f"{m['model_diag_min']:.6f}",
                        f"{m['model_scaled_diag_min']:.3f}",
                    ],
                    ["‖Z − X‖ / ‖X‖", f"{m['model_rel_change']:.2e}", ""],
                ],
            )
        )
        notes.append(
            _(
                "On real embeddings the unscaled parameter-free form barely mixes anything: Z ≈ X. Dividing "
                "by √d (lecture 003) lets other tokens in, but the token itself still gets the most weight."
            )
        )
        if out_dir is not None:
            from ._base import new_figure, save_figure

            fig, axes = new_figure(10, 4.2, ncols=2)
            for ax, mat, title in ((axes[0], w, "softmax(X Xᵀ)"), (axes[1], ws, "softmax(X Xᵀ / √384)")):
                im = ax.imshow(mat.numpy(), vmin=0, vmax=1, cmap="viridis")
                ax.set_xticks(range(len(r.tokens)), r.tokens, rotation=90, fontsize=7)
                ax.set_yticks(range(len(r.tokens)), r.tokens, fontsize=7)
                ax.set_title(_("{title}, MiniLM embeddings").format(title=title))
            fig.colorbar(im, ax=list(axes), shrink=0.8)
            figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(LESSON, m, verdict(m), tables=tables, figures=figures, notes=notes)
