"""Lesson ``no-locality-prior`` (lecture 003 §4): attention has no built-in preference for neighbours.

The score q_i·k_j depends only on the two vectors, never on |i − j|. Measured: in a random
:class:`selfattention.SelfAttention` layer, the weight from token a to token b while b is moved to every
distance (the other tokens keep their contents) — constant to rounding. Then what training made of it:
all-MiniLM-L6-v2 (with position embeddings) puts more weight on near tokens — a learned preference.
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
    name="no-locality-prior",
    summary=N_("no built-in bias to near tokens"),
    lecture="003",
    section="四、这一讲机制自带的代价",
    claim_zh="自注意力本身对“该往哪看”没有任何预先设定的偏好……对序列里任意两个位置一视同仁，具体该重点关注谁，完全靠训练从数据里学出来",
    claim_en=N_(
        "Attention treats every pair of positions alike: no locality prior is built in; any "
        "preference for near tokens must be learned (with position information)."
    ),
    kind="measured",
    module="no_locality_prior",
    needs_model=True,
)

TOLERANCE = 1e-12
TEXT = (
    "The committee met on Monday to discuss the budget, and after a long debate the members agreed "
    "to fund the new library, the park and two schools in the north of the city."
)


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``weight_spread`` = max − min of α(a→b) over all distances (float64, no positions)."""
    spread = m["weight_spread"]
    if spread > TOLERANCE:
        return Verdict(FAILS, _("the weight a→b changes by {spread:.3g} with distance").format(spread=spread))
    learned = m.get("model_near_over_far")
    extra = (
        _(
            "; MiniLM learned a neighbour preference: weight at distance 1 is {learned:.1f}× that at ≥ 8"
        ).format(learned=learned)
        if learned
        else ""
    )
    return Verdict(
        HOLDS,
        _("α(a→b) constant over {distances} distances (spread {spread:.0e}){extra}").format(
            distances=m["distances"], spread=spread, extra=extra
        ),
    )


def run(
    out_dir: Path | None = None,
    progress: Any = None,
    *,
    T: int = 32,
    d: int = 16,
    use_model: bool = True,
    seed: int = 0,
) -> LessonResult:
    torch.manual_seed(seed)
    layer = SelfAttention(d, d).double()
    tokens = torch.randn(T, d, dtype=torch.float64)  # token 0 = a, token 1 = b, the rest fillers
    weights = []
    for pos_b in range(1, T):
        order = [0] + [i for i in range(2, T)]
        order.insert(pos_b, 1)  # b at position pos_b, a stays at position 0
        with capture() as traces, torch.no_grad():
            layer(tokens[order])
        weights.append(traces[0]["weights"][0, pos_b].item())
    w = torch.tensor(weights)
    m: dict[str, Any] = {"weight_spread": (w.max() - w.min()).item(), "distances": T - 1}
    tables = [
        ResultTable(
            _(
                "random SelfAttention({d}, {d}), no positions: weight of a (position 0) on b at distance δ"
            ).format(d=d),
            ["δ", "α(a→b)"],
            [[k, f"{weights[k - 1]:.12f}"] for k in (1, 2, 4, 8, 16, T - 1) if k < T],
        )
    ]
    figures = []
    if use_model:
        from ..pretrained import run_text

        r = run_text(TEXT, compare=False)
        att = r.attentions.double().mean(dim=(0, 1))  # (T, T), mean over layers and heads
        n = att.shape[-1]
        i = torch.arange(n)
        dist = (i[:, None] - i[None, :]).abs()
        inner = (
            (i[:, None] > 0) & (i[:, None] < n - 1) & (i[None, :] > 0) & (i[None, :] < n - 1)
        )  # no [CLS]/[SEP]
        profile = [att[(dist == k) & inner].mean().item() for k in range(1, min(n - 2, 25))]
        far = att[(dist >= 8) & inner].mean().item()
        m["model_near_over_far"] = profile[0] / far
        m["model_profile"] = profile
        tables.append(
            ResultTable(
                _(
                    "MiniLM ({n} tokens), mean weight between words at distance δ (layers × heads averaged, no [CLS]/[SEP])"
                ).format(n=n),
                ["δ", _("mean weight")],
                [[k, f"{profile[k - 1]:.4f}"] for k in (1, 2, 3, 4, 8, 16) if k <= len(profile)]
                + [["≥ 8", f"{far:.4f}"]],
            )
        )
        if out_dir is not None:
            from ._base import new_figure, save_figure

            fig, ax = new_figure()
            ax.plot(range(1, len(profile) + 1), profile, "o-", label=_("MiniLM (trained, with positions)"))
            ax.axhline(1 / n, color="grey", ls="--", lw=0.8, label=_("uniform 1/T"))
            ax.set_xlabel(_("distance |i − j|"))
            ax.set_ylabel(_("mean attention weight"))
            ax.set_title(_("no locality prior is built in; MiniLM learned one"))
            ax.legend()
            figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(LESSON, m, verdict(m), tables=tables, figures=figures)
