"""Lesson ``weights-not-explanation`` (lecture 003 §5): attention weights are not simply "what the model
looks at".

One concrete, measurable reason (Kobayashi et al. 2020, "Attention is Not Only a Weight"): what a key
contributes to a query's output is α_ij v_j, so its size is α_ij ‖v_j‖, not α_ij. Measured on
all-MiniLM-L6-v2 per layer: the share of attention weight the heads put on [CLS]/[SEP] against the share
of the contribution norm ‖α_ij v_j‖ those tokens actually deliver, and the rank agreement between the
two readings. Where they disagree, reading weights as explanations misleads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..i18n import N_, _
from ._base import FAILS, HOLDS, Lesson, LessonResult, ResultTable, Verdict

LESSON = Lesson(
    name="weights-not-explanation",
    summary=N_("weights are not an explanation"),
    lecture="003",
    section="五、和后面课程的关系 (第 31 讲 可解释性)",
    claim_zh="softmax 权重经常被直接当成“模型在关注什么”的证据来解读，但这个解读本身是有争议的，不能想当然地把注意力权重等同于“模型的推理过程”",
    claim_en=N_(
        "Attention weights should not be read as 'what the model attends to': the weight of a key "
        "and what it contributes (α‖v‖) can disagree."
    ),
    kind="measured",
    module="weights_not_explanation",
    needs_model=True,
)

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Apple released a new phone and the shares went up.",
    "She ate an apple for lunch because she was hungry.",
)
OVERSTATED = 1.5  # weight share / contribution share on special tokens counted as misleading


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: per layer ``weight_share`` and ``norm_share`` of [CLS]/[SEP] (fractions)."""
    ratios = [w / max(n, 1e-12) for w, n in zip(m["weight_share"], m["norm_share"], strict=True)]
    worst = max(range(len(ratios)), key=lambda i: ratios[i])
    text = _(
        "layer {worst}: [CLS]/[SEP] get {weight_share:.0%} of the weight but deliver {norm_share:.0%} of the contribution norm ({ratio:.1f}×)"
    ).format(
        worst=worst,
        weight_share=m["weight_share"][worst],
        norm_share=m["norm_share"][worst],
        ratio=ratios[worst],
    )
    if ratios[worst] >= OVERSTATED:
        return Verdict(HOLDS, text)
    return Verdict(FAILS, text + _("; weights and contributions agree"))


def run(
    out_dir: Path | None = None, progress: Any = None, *, sentences: tuple[str, ...] = SENTENCES
) -> LessonResult:
    from ..pretrained import run_text

    w_share = n_share = None
    for text in sentences:
        r = run_text(text, compare=False)
        special = torch.tensor([t in ("[CLS]", "[SEP]") for t in r.tokens])
        att = r.attentions.double()  # (L, H, T, T)
        contrib = att * r.values.double().norm(dim=-1)[:, :, None, :]  # α_ij ‖v_j‖, (L, H, T, T)
        contrib = contrib / contrib.sum(-1, keepdim=True)
        ws = att[..., special].sum(-1).mean(dim=(1, 2))  # (L,)
        ns = contrib[..., special].sum(-1).mean(dim=(1, 2))
        w_share = ws if w_share is None else w_share + ws
        n_share = ns if n_share is None else n_share + ns
    w_share, n_share = w_share / len(sentences), n_share / len(sentences)
    m = {"weight_share": w_share.tolist(), "norm_share": n_share.tolist()}
    table = ResultTable(
        _("MiniLM, mean over {n_sentences} sentences, all heads and queries (layers count from 0)").format(
            n_sentences=len(sentences)
        ),
        [_("layer"), _("weight on [CLS]/[SEP]"), _("share of ‖α v‖ from [CLS]/[SEP]"), _("ratio")],
        [
            [i, f"{w:.1%}", f"{n:.1%}", f"{w / n:.1f}×"]
            for i, (w, n) in enumerate(zip(m["weight_share"], m["norm_share"], strict=True))
        ],
    )
    figures = []
    if out_dir is not None:
        from ._base import new_figure, save_figure

        fig, ax = new_figure()
        layers = range(len(m["weight_share"]))  # 0-based, as in `explain` and `report`
        ax.bar([x - 0.2 for x in layers], m["weight_share"], width=0.4, label="attention weight α")
        ax.bar([x + 0.2 for x in layers], m["norm_share"], width=0.4, label="contribution ‖α v‖")
        ax.set_xlabel("layer (0-based)")
        ax.set_ylabel("share on [CLS]/[SEP]")
        ax.set_title("weights overstate what [CLS]/[SEP] contribute")
        ax.set_xticks(list(layers))
        # below the axes, so that no bar is hidden behind it
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=2, frameon=False)
        figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(
        LESSON,
        m,
        verdict(m),
        tables=[table],
        figures=figures,
        notes=[
            _(
                "This backs one concrete reason for the lecture's caution; it does not settle what a faithful "
                "explanation is (the output projection, residual stream and later layers matter too)."
            )
        ],
    )
