"""Lesson ``similarity-driven-heads`` (lecture 000, open question 2): are a trained model's attention
scores still mostly similarity?

For every layer and head of all-MiniLM-L6-v2: the Pearson correlation between the head's scores Q Kᵀ and
the similarities X Xᵀ of that layer's input (both centred per row, since softmax ignores a per-row
shift), and how often a query's largest weight is on itself (always, for the parameter-free form with
equal norms). Averaged over a few sentences.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..functional import attention_steps, simple_attention_steps
from ..i18n import N_, _
from ._base import FAILS, HOLDS, ONLY_WHEN, Lesson, LessonResult, ResultTable, Verdict

LESSON = Lesson(
    name="similarity-driven-heads",
    summary=N_("trained heads: similarity-driven?"),
    lecture="000",
    section="开放问题 2",
    claim_zh="“相似才关注”的限制是否被高估：训练后的 Q/K/V 投影是否真的让 attention 学反义关系，还是仍以相似为主？",
    claim_en=N_(
        "Open question: after training, is attention still mostly driven by similarity (scores ≈ "
        "X Xᵀ, top key = the token itself)? Measured per layer and head of MiniLM."
    ),
    kind="measured",
    module="similarity_heads",
    needs_model=True,
)

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Apple released a new phone and the shares went up.",
    "She went down the stairs while he walked up the hill.",
)
STRONG = 0.5  # |r| above this: the head's scores follow similarity


def _row_centred_corr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pearson r over the last two dims after subtracting each row's mean. a (..., T, T), b broadcastable."""
    a = a - a.mean(-1, keepdim=True)
    b = b - b.mean(-1, keepdim=True)
    b = b.expand_as(a)
    num = (a * b).sum((-2, -1))
    return num / (a.norm(dim=(-2, -1)) * b.norm(dim=(-2, -1))).clamp_min(1e-30)


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``corr`` and ``self_top`` as (layers × heads) nested lists."""
    corr = torch.tensor(m["corr"]).flatten()
    top = torch.tensor(m["self_top"]).flatten()
    n = corr.numel()
    median, strong = corr.median().item(), int((corr > STRONG).sum())
    top_mean, top_heads = top.mean().item(), int((top > 0.5).sum())
    text = _(
        "median r(QKᵀ, XXᵀ) = {median:.2f}, {strong}/{n} heads with r > {STRONG}; top key = itself in {top_mean:.0%} of rows ({top_heads}/{n} heads mostly self)"
    ).format(median=median, strong=strong, n=n, STRONG=STRONG, top_mean=top_mean, top_heads=top_heads)
    if median > STRONG and top_mean > 0.5:
        return Verdict(HOLDS, text)
    if strong == 0 and top_heads == 0:
        return Verdict(FAILS, text)
    return Verdict(
        ONLY_WHEN,
        text,
        condition=_("for a minority of heads ({max}/{n})").format(max=max(strong, top_heads), n=n),
    )


def run(
    out_dir: Path | None = None, progress: Any = None, *, sentences: tuple[str, ...] = SENTENCES
) -> LessonResult:
    from ..pretrained import run_text

    corr_sum = top_sum = None
    for text in sentences:
        r = run_text(text, compare=False)
        n_layers = r.queries.shape[0]
        scores = attention_steps(
            r.queries.double(), r.keys.double(), r.values.double()
        ).scores  # (L, H, T, T)
        xs = torch.stack([h[0] for h in r.hidden_states[:n_layers]]).double()  # (L, T, 384), layer inputs
        sims = simple_attention_steps(xs).scores  # X Xᵀ, (L, T, T)
        corr = _row_centred_corr(scores, sims[:, None])  # (L, H)
        own = torch.arange(scores.shape[-1])
        top = (r.attentions.argmax(-1) == own).double().mean(-1)  # (L, H)
        corr_sum = corr if corr_sum is None else corr_sum + corr
        top_sum = top if top_sum is None else top_sum + top
    corr_mean = corr_sum / len(sentences)
    top_mean = top_sum / len(sentences)
    m = {"corr": corr_mean.tolist(), "self_top": top_mean.tolist()}
    table = ResultTable(
        _("MiniLM, mean over {n_sentences} sentences: per layer (0-based), over its 12 heads").format(
            n_sentences=len(sentences)
        ),
        [
            _("layer"),
            _("r(QKᵀ, XXᵀ) median"),
            _("max"),
            _("heads r > 0.5"),
            _("top key = self (mean)"),
            _("max head"),
        ],
        [
            [
                i,
                f"{corr_mean[i].median():.2f}",
                f"{corr_mean[i].max():.2f}",
                int((corr_mean[i] > STRONG).sum()),
                f"{top_mean[i].mean():.0%}",
                f"{top_mean[i].max():.0%}",
            ]
            for i in range(corr_mean.shape[0])
        ],
    )
    figures = []
    if out_dir is not None:
        from ._base import new_figure, save_figure

        fig, axes = new_figure(11, 3.6, ncols=2)
        for ax, mat, title, lim in (
            (axes[0], corr_mean, _("r(Q Kᵀ, X Xᵀ), row-centred"), (-1, 1)),
            (axes[1], top_mean, _("fraction of queries whose top key is itself"), (0, 1)),
        ):
            im = ax.imshow(
                mat.numpy(), cmap="coolwarm" if lim[0] < 0 else "viridis", vmin=lim[0], vmax=lim[1]
            )
            ax.set_xlabel(_("head (0-based)"))
            ax.set_ylabel(_("layer (0-based)"))
            ax.set_xticks(range(mat.shape[1]), [str(h) for h in range(mat.shape[1])])
            ax.set_yticks(range(mat.shape[0]), [str(i) for i in range(mat.shape[0])])
            ax.set_title(title)
            fig.colorbar(im, ax=ax, shrink=0.8)
        figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(
        LESSON,
        m,
        verdict(m),
        tables=[table],
        figures=figures,
        notes=[
            _(
                "For the parameter-free form r = 1 and the top key is the token itself in every row (equal "
                "norms); a trained head that does something else has learned a relation other than similarity."
            )
        ],
    )
