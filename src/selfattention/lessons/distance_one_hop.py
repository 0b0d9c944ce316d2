"""Lesson ``distance-one-hop`` (lectures 000 and 003): any two tokens are one step apart.

In attention the output at position i reads every input x_j directly, so the gradient ∂z_i/∂x_j does
not shrink with the distance i − j; in an RNN it must pass through every step in between and decays.
Measured: ‖∂(u·z_last)/∂x_j‖ against the distance from the last position, for a randomly initialised
:class:`selfattention.SelfAttention` and for ``torch.nn.RNN`` (tanh) of the same width, averaged over seeds
and random directions u.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..i18n import N_, _
from ..modules import SelfAttention
from ._base import FAILS, HOLDS, Lesson, LessonResult, ResultTable, Verdict

LESSON = Lesson(
    name="distance-one-hop",
    summary=N_("any two positions: one step apart"),
    lecture="000",
    section="Self-attention 相对 RNN 的两个根本变化；003 §4 对照表",
    claim_zh="任意两 token 距离 1 跳：不依赖中间，无梯度沿时间衰减（003：路径长度恒为 1，不随距离增长而衰减）",
    claim_en=N_(
        "Any two positions are one step apart: the gradient from an output to a distant input does "
        "not decay with distance, unlike an RNN's."
    ),
    kind="measured",
    module="distance_one_hop",
)

NEAR = (1, 2, 3, 4)


def grad_by_distance(model: Any, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """‖∂(u·out[last])/∂x_j‖ for j = last … 0, indexed by distance. x (T, d), model maps (1, T, d) → (1, T, d)."""
    x = x.clone().requires_grad_(True)
    out = model(x[None])
    out = out[0] if isinstance(out, tuple) else out
    (out[0, -1] @ u).backward()
    return x.grad.norm(dim=-1).flip(0)  # distance 0 = last position


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``attention_far_over_near`` and ``rnn_far_over_near`` (mean gradient norm at distances ≥ T/2
    over the mean at distances 1–4)."""
    a, r = m["attention_far_over_near"], m["rnn_far_over_near"]
    text = _("far/near gradient ratio: attention {a:.2f}, RNN {r:.1e}").format(a=a, r=r)
    if a < 0.2:
        return Verdict(FAILS, text)
    return Verdict(HOLDS, text)


def run(
    out_dir: Path | None = None, progress: Any = None, *, T: int = 64, d: int = 32, seeds: int = 5
) -> LessonResult:
    att = torch.zeros(T, dtype=torch.float64)
    rnn = torch.zeros(T, dtype=torch.float64)
    for seed in range(seeds):
        torch.manual_seed(seed)
        layer = SelfAttention(d, d).double()
        cell = torch.nn.RNN(d, d, batch_first=True).double()
        x = torch.randn(T, d, dtype=torch.float64)
        u = torch.randn(d, dtype=torch.float64)
        att += grad_by_distance(layer, x, u) / seeds
        rnn += grad_by_distance(cell, x, u) / seeds
    far = slice(T // 2, T)
    near = list(NEAR)
    m = {
        "attention_far_over_near": (att[far].mean() / att[near].mean()).item(),
        "rnn_far_over_near": (rnn[far].mean() / rnn[near].mean()).item(),
        "attention": att.tolist(),
        "rnn": rnn.tolist(),
    }
    shown = [1, 2, 4, 8, 16, 32, T - 1]
    table = ResultTable(
        _("‖∂(u·z_last)/∂x_j‖ by distance, T = {T}, d = {d}, mean of {seeds} random models (float64)").format(
            T=T, d=d, seeds=seeds
        ),
        [_("distance"), _("SelfAttention"), _("torch.nn.RNN (tanh)")],
        [[k, f"{att[k]:.3e}", f"{rnn[k]:.3e}"] for k in shown if k < T],
    )
    figures = []
    if out_dir is not None:
        from ._base import new_figure, save_figure

        fig, ax = new_figure()
        ax.semilogy(range(1, T), att[1:].numpy(), label=_("self-attention"))
        ax.semilogy(range(1, T), rnn[1:].clamp_min(1e-300).numpy(), label="RNN (tanh)")
        ax.set_xlabel(_("distance from the output position"))
        ax.set_ylabel(_("gradient norm"))
        ax.set_title(_("one hop: the attention gradient does not decay with distance"))
        ax.legend()
        figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(LESSON, m, verdict(m), tables=[table], figures=figures)
