"""Lesson ``weights-not-explanation`` (lecture 003 §5): attention weights are not simply "what the model
looks at".

Measured on all-MiniLM-L6-v2, whose output is the mean of its last hidden states (a sentence embedding):

1. **Against an ablation.** Drop one word token from the input, run the model again and measure how far
   the output moves (1 − cosine similarity): that is how much the output depends on the token. Four
   readings of the attention each give every token a share of the output — the last layer's raw
   weights (heads and queries averaged), ‖α f(x)‖ (Kobayashi et al. 2020: the weight times the norm of
   the value through the output projection), attention rollout and attention flow (Abnar & Zuidema
   2020, "Quantifying Attention Flow in Transformers": heads averaged, the residual as 0.5·A + 0.5·I,
   multiplied through the layers, or pushed through them as a max-flow) — and each is compared with the
   ablation by Spearman's rank correlation ρ over the word tokens. The verdict comes from this: the
   claim holds when the raw weights rank the tokens poorly (mean ρ < :data:`AGREES`).
2. **The [CLS]/[SEP] share** (Kobayashi et al.): per layer, the share of weight the heads put on
   [CLS]/[SEP] against the share of ‖α v‖ those tokens deliver.
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
        "Attention weights should not be read as 'what the model attends to': ranked against an "
        "ablation (drop a token, see how far the output moves), raw weights, ‖α f(x)‖, rollout and flow "
        "disagree."
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
MEASURES = ("raw", "norm", "rollout", "flow")
AGREES = 0.5
"""Below this mean Spearman ρ with the ablation, the raw weights rank the tokens poorly."""
MARGIN = 0.1
"""A reading whose mean ρ beats the raw weights' by this much reads the model better than the weights."""
_NAMES = {"raw": N_("raw weights"), "norm": "‖α f(x)‖", "rollout": N_("rollout"), "flow": N_("flow")}


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``m["rho"][measure]`` is the Spearman ρ of each sentence between that measure's token shares
    and the ablation's. The claim holds when the raw weights rank the tokens poorly (mean ρ <
    :data:`AGREES`) or another reading ranks them better by at least :data:`MARGIN`."""
    means = {k: sum(v) / len(v) for k, v in m["rho"].items()}
    best = max(means, key=lambda k: means[k])
    text = _(
        "Spearman ρ with the ablation, mean over {n} sentences: raw weights {raw:.2f}, "
        "‖α f(x)‖ {norm:.2f}, rollout {rollout:.2f}, flow {flow:.2f}"
    ).format(n=len(m["rho"]["raw"]), **{k: means[k] for k in MEASURES})
    if means["raw"] < AGREES:
        return Verdict(HOLDS, text + _("; the raw weights rank the tokens poorly"))
    if means[best] - means["raw"] >= MARGIN:
        return Verdict(
            HOLDS, text + _("; {best} ranks them better than the weights").format(best=_(_NAMES[best]))
        )
    return Verdict(FAILS, text + _("; the raw weights rank the tokens as well as any reading"))


def ablation(net: Any, input_ids: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """How far the output (mean of the last hidden states) moves when each token of ``positions`` is
    dropped from the input: 1 − cos(output, output without it), float64 (len(positions),)."""
    ids = input_ids.reshape(1, -1)
    with torch.no_grad():
        full = net(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0].double().mean(0)
        out = []
        for j in positions:
            cut = torch.cat([ids[:, :j], ids[:, j + 1 :]], dim=1)  # (1, T − 1): token j dropped
            e = net(input_ids=cut, attention_mask=torch.ones_like(cut)).last_hidden_state[0].double().mean(0)
            out.append(1.0 - torch.nn.functional.cosine_similarity(full, e, dim=0))
    return torch.stack(out)


def token_shares(run: Any, net: Any) -> dict[str, torch.Tensor]:
    """Each measure's share of the output for every token, (T,) float64: the output is the mean over
    positions of the last layer, so a token's share is its column mean in the last layer's matrix (raw
    and ‖α f(x)‖ also averaged over heads; rollout and flow are whole-model already)."""
    from ..attribution import measure

    shares = {}
    for name in MEASURES:
        mat = measure(run, name, net)  # (L, H, T, T), (L, T, T) or (T, T), rows summing to 1
        last = mat[-1] if name != "flow" else mat
        shares[name] = (last.mean(0) if name in ("raw", "norm") else last).mean(0)  # mean over queries
    return shares


def run(
    out_dir: Path | None = None, progress: Any = None, *, sentences: tuple[str, ...] = SENTENCES
) -> LessonResult:
    from ..attribution import spearman
    from ..pretrained import load_model, run_text

    net, _tok = load_model()
    rho: dict[str, list[float]] = {k: [] for k in MEASURES}
    w_share = n_share = None
    for text in sentences:
        r = run_text(text, compare=False)
        special = torch.tensor(r.special if r.special else [t in ("[CLS]", "[SEP]") for t in r.tokens])
        words = [j for j in range(len(r.tokens)) if not bool(special[j])]
        effect = ablation(net, r.input_ids, words)
        for name, share in token_shares(r, net).items():
            rho[name].append(spearman(share[words], effect))
        att = r.attentions.double()  # (L, H, T, T)
        contrib = att * r.values.double().norm(dim=-1)[:, :, None, :]  # α_ij ‖v_j‖, (L, H, T, T)
        contrib = contrib / contrib.sum(-1, keepdim=True)
        ws = att[..., special].sum(-1).mean(dim=(1, 2))  # (L,)
        ns = contrib[..., special].sum(-1).mean(dim=(1, 2))
        w_share = ws if w_share is None else w_share + ws
        n_share = ns if n_share is None else n_share + ns
    w_share, n_share = w_share / len(sentences), n_share / len(sentences)
    m = {"rho": rho, "weight_share": w_share.tolist(), "norm_share": n_share.tolist()}
    labels = {k: _(v) for k, v in _NAMES.items()}
    agreement = ResultTable(
        _(
            "Spearman ρ between each reading's token shares and the ablation (drop the token, 1 − cos of "
            "the output), word tokens only; MiniLM"
        ),
        [_("reading"), *[_("sentence {i}").format(i=i + 1) for i in range(len(sentences))], _("mean")],
        [[labels[k], *[f"{x:+.2f}" for x in rho[k]], f"{sum(rho[k]) / len(rho[k]):+.2f}"] for k in MEASURES],
    )
    shares = ResultTable(
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
        xs = range(len(MEASURES))
        ax.bar(list(xs), [sum(rho[k]) / len(rho[k]) for k in MEASURES], width=0.6)
        ax.axhline(AGREES, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(list(xs), [_("raw α"), "‖α f(x)‖", "rollout", "flow"])
        ax.set_ylabel(_("Spearman ρ with the ablation"))
        ax.set_ylim(-1, 1)
        ax.set_title(_("which reading ranks tokens as dropping them does"))
        figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(
        LESSON,
        m,
        verdict(m),
        tables=[agreement, shares],
        figures=figures,
        notes=[
            _(
                "The ablation is one measure of what the output depends on (others: gradients, other "
                "outputs); agreeing with it does not make a reading a faithful explanation."
            ),
            _(
                "Each reading's shares are the column means of the last layer's matrix (the output is the "
                "mean of the last hidden states); raw weights and ‖α f(x)‖ are also averaged over heads."
            ),
        ],
    )
