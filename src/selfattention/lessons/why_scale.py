"""Lesson ``why-scale-by-sqrt-dk`` (lecture 003, exercise 2): why divide the scores by √d_k.

For q, k with independent unit-variance entries, q·k is a sum of d_k products of variance 1, so its
standard deviation is √d_k: going from d_k = 2 to 200 multiplies the typical score by √100 = 10.
Unscaled, the softmax over such scores becomes nearly one-hot (max weight → 1, entropy → 0) and the
gradient through it shrinks; dividing by √d_k keeps the scores at unit scale for every d_k.

Everything is measured with :func:`selfattention.functional.attention_steps` (scale=1 vs scale=None,
i.e. 1/√d_k); the gradient is ∂L/∂(scaled scores) for L = Σ α·u with a random upstream u.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..functional import attention_steps
from ..i18n import N_, _
from ._base import FAILS, HOLDS, Lesson, LessonResult, ResultTable, Verdict

LESSON = Lesson(
    name="why-scale-by-sqrt-dk",
    summary=N_("why divide the scores by √d_k"),
    lecture="003",
    section="缩放：一个工程修正；思考题 2",
    claim_zh="点积是 dₖ 项数字相乘再相加，维度越高，数值的波动范围会越大……softmax 会过分尖锐，梯度变得极小；除以 √dₖ 把数值范围拉回",
    claim_en=N_(
        "Exercise 2: the std of q·k grows like √d_k (×10 from d_k = 2 to 200); unscaled, the softmax "
        "saturates and its gradient vanishes; dividing by √d_k keeps both steady."
    ),
    kind="exercise",
    module="why_scale",
)


def _stats(q: torch.Tensor, k: torch.Tensor, scale: float | None, upstream: torch.Tensor) -> dict[str, float]:
    q = q.clone().requires_grad_(True)
    steps = attention_steps(q, k, k, scale=scale)
    steps.scaled_scores.retain_grad()
    (steps.weights * upstream).sum().backward()
    w = steps.weights.detach()
    entropy = -(w * torch.log(w.clamp_min(1e-300))).sum(-1)
    return {
        "score_std": steps.scores.detach().std().item(),
        "max_weight": w.amax(-1).mean().item(),
        "entropy": entropy.mean().item(),
        "grad": steps.scaled_scores.grad.norm(dim=-1).mean().item(),
    }


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: per-d_k rows with ``d_k``, ``std``, and unscaled/scaled ``max_weight`` and ``grad``."""
    rows = m["rows"]
    off = max(abs(r["std"] / math.sqrt(r["d_k"]) - 1) for r in rows)
    if off > 0.15:
        return Verdict(FAILS, _("std(q·k) is {off:.0%} away from √d_k").format(off=off))
    last = rows[-1]
    saturated = (
        last["max_weight_unscaled"] > last["max_weight_scaled"]
        and last["grad_unscaled"] < last["grad_scaled"] / 2
    )
    steady = max(r["max_weight_scaled"] for r in rows) - min(r["max_weight_scaled"] for r in rows) < 0.25
    if not (saturated and steady):
        return Verdict(FAILS, _("std ∝ √d_k, but scaling did not prevent saturation or the gradient loss"))
    ratio = rows[-1]["std"] / rows[0]["std"]
    return Verdict(
        HOLDS,
        _(
            "std(q·k)/√d_k within {off:.0%} of 1; d_k {d_k} → {d_k2} multiplies the std by {ratio:.1f}; at d_k = {d_k2} unscaled max weight {max_weight_unscaled:.2f} and gradient {grad_unscaled:.2g} vs scaled {max_weight_scaled:.2f}, {grad_scaled:.2g}"
        ).format(
            off=off,
            d_k=rows[0]["d_k"],
            d_k2=last["d_k"],
            ratio=ratio,
            max_weight_unscaled=last["max_weight_unscaled"],
            grad_unscaled=last["grad_unscaled"],
            max_weight_scaled=last["max_weight_scaled"],
            grad_scaled=last["grad_scaled"],
        ),
    )


def run(
    out_dir: Path | None = None,
    progress: Any = None,
    *,
    dims: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 200),
    n_queries: int = 512,
    n_keys: int = 16,
    seed: int = 0,
) -> LessonResult:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    table = ResultTable(
        _("random unit-variance q, k ({n_queries} queries × {n_keys} keys), float64").format(
            n_queries=n_queries, n_keys=n_keys
        ),
        [
            "d_k",
            _("std(q·k)"),
            "√d_k",
            _("max weight raw / ÷√d_k"),
            _("entropy raw / ÷√d_k"),
            _("‖∂L/∂logits‖ raw / ÷√d_k"),
        ],
    )
    for d in dims:
        q = torch.randn(n_queries, 1, d, generator=gen, dtype=torch.float64)
        k = torch.randn(n_queries, n_keys, d, generator=gen, dtype=torch.float64)
        u = torch.randn(n_queries, 1, n_keys, generator=gen, dtype=torch.float64)
        raw, scaled = _stats(q, k, 1.0, u), _stats(q, k, None, u)
        rows.append(
            {
                "d_k": d,
                "std": raw["score_std"],
                "max_weight_unscaled": raw["max_weight"],
                "max_weight_scaled": scaled["max_weight"],
                "entropy_unscaled": raw["entropy"],
                "entropy_scaled": scaled["entropy"],
                "grad_unscaled": raw["grad"],
                "grad_scaled": scaled["grad"],
            }
        )
        table.rows.append(
            [
                d,
                f"{raw['score_std']:.2f}",
                f"{math.sqrt(d):.2f}",
                f"{raw['max_weight']:.2f} / {scaled['max_weight']:.2f}",
                f"{raw['entropy']:.2f} / {scaled['entropy']:.2f}",
                f"{raw['grad']:.3f} / {scaled['grad']:.3f}",
            ]
        )
    m = {"rows": rows, "uniform_entropy": math.log(n_keys)}
    figures = []
    if out_dir is not None:
        from ._base import new_figure, save_figure

        fig, axes = new_figure(12, 3.8, ncols=3)
        ds = [r["d_k"] for r in rows]
        axes[0].plot(ds, [r["std"] for r in rows], "o-", label=_("measured std(q·k)"))
        axes[0].plot(ds, [math.sqrt(d) for d in ds], "--", label="√d_k")
        axes[0].set_xlabel("d_k")
        axes[0].set_ylabel(_("std of the score q·k"))
        axes[0].legend()
        for key, ax, label in (
            ("max_weight", axes[1], _("mean max weight")),
            ("grad", axes[2], "‖∂L/∂logits‖"),
        ):
            ax.plot(ds, [r[f"{key}_unscaled"] for r in rows], "o-", label="q·k")
            ax.plot(ds, [r[f"{key}_scaled"] for r in rows], "s-", label="q·k / √d_k")
            ax.set_xlabel("d_k")
            ax.set_ylabel(label)
            ax.legend()
        fig.suptitle(_("lecture 003: why divide by √d_k"))
        figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(LESSON, m, verdict(m), tables=[table], figures=figures)
