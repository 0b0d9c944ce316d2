"""Lesson ``limitations-training`` (lecture 000, 局限 1–3): a task the parameter-free form cannot learn.

The task needs every token to fetch information from a *different, dissimilar* token. The vocabulary
has 24 symbols in 8 fixed cycles of three (a → b → c → a); each sequence holds 3 whole cycles (9 tokens,
shuffled), and every token carries a random payload (one of 4). Target for a token with symbol s: the
payload of the token whose symbol is π(s), its partner. The partner relation is directed (a's partner is
b, b's is c), so symmetric scores cannot make every token's partner its top key: in a cycle that would
need ω(a,b) > ω(a,c) = ω(c,a) > ω(c,b) = ω(b,c) > ω(b,a) = ω(a,b).

Both models get learnable embeddings (symbol + payload) and a linear readout; the only difference is the
attention: (a) parameter-free softmax(X Xᵀ) X (:class:`selfattention.SimpleSelfAttention`) versus
(b) learnable W_q, W_k, W_v (:class:`selfattention.SelfAttention`). Same steps, batch, optimiser and
learning rate, several seeds; accuracy on fresh sequences (chance = 1/4).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..i18n import N_, _
from ..modules import SelfAttention, SimpleSelfAttention
from ._base import FAILS, HOLDS, Lesson, LessonResult, ResultTable, Verdict, progress_steps, torch_threads

LESSON = Lesson(
    name="limitations-training",
    summary=N_("no parameters, no learned lookups"),
    lecture="000",
    section="这个版本的局限在哪？——三个表达力受限的具体表现",
    claim_zh="简化版只能学相似，学不出这些（反义/句法关系）；ω_ij = ω_ji 无方向性；内容与查询混淆——引入 W_Q, W_K, W_V 同时解掉三个限制",
    claim_en=N_(
        "With no learnable projections, attention can only follow similarity, is symmetric and ties "
        "query, key and content together, so it cannot learn to fetch from a dissimilar partner; Q/K/V can."
    ),
    kind="measured",
    module="limitations_training",
    budget="2 min",
)

N_CYCLES, CYCLE, PAYLOADS = 8, 3, 4


def make_batch(n: int, gen: torch.Generator, cycles_per_seq: int = 3) -> tuple[torch.Tensor, ...]:
    """(symbols, payloads, targets), each (n, cycles_per_seq·3) long."""
    choice = torch.rand(n, N_CYCLES, generator=gen).argsort(dim=-1)[:, :cycles_per_seq]  # (n, c)
    symbols = (choice[:, :, None] * CYCLE + torch.arange(CYCLE)).reshape(n, -1)  # whole cycles
    perm = torch.rand(symbols.shape, generator=gen).argsort(dim=-1)
    symbols = symbols.gather(1, perm)  # shuffled
    payloads = torch.randint(0, PAYLOADS, symbols.shape, generator=gen)
    partner = (symbols // CYCLE) * CYCLE + (symbols % CYCLE + 1) % CYCLE  # π(s): next in its cycle
    where = (symbols[:, None, :] == partner[:, :, None]).float().argmax(-1)  # position of the partner
    targets = payloads.gather(1, where)
    return symbols, payloads, targets


class TaskModel(nn.Module):
    """Embeddings (symbol + payload) → attention → linear readout to the 4 payload classes."""

    def __init__(self, attention: str, d: int) -> None:
        super().__init__()
        self.symbol = nn.Embedding(N_CYCLES * CYCLE, d)
        self.payload = nn.Embedding(PAYLOADS, d)
        self.attention = SimpleSelfAttention() if attention == "parameter-free" else SelfAttention(d, d)
        self.readout = nn.Linear(d, PAYLOADS)

    def forward(self, symbols: torch.Tensor, payloads: torch.Tensor) -> torch.Tensor:
        x = self.symbol(symbols) + self.payload(payloads)  # (B, T, d)
        return self.readout(self.attention(x))  # (B, T, PAYLOADS)


def train_one(
    attention: str, seed: int, steps: int, batch: int, d: int, lr: float, advance: Any
) -> dict[str, Any]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(10_000 + seed)
    model = TaskModel(attention, d)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _step in range(steps):
        s, p, y = make_batch(batch, gen)
        loss = nn.functional.cross_entropy(model(s, p).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        advance()
    test = torch.Generator().manual_seed(999)
    s, p, y = make_batch(2000, test)
    with torch.no_grad():
        acc = (model(s, p).argmax(-1) == y).float().mean().item()
    return {"accuracy": acc, "losses": losses}


#: the models' names, the keys of the measurements (shown translated)
_MODELS = (N_("parameter-free"), N_("Q/K/V"))


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``accuracy`` = {"parameter-free": [per seed], "Q/K/V": [per seed]}, ``chance``."""
    free, qkv = m["accuracy"]["parameter-free"], m["accuracy"]["Q/K/V"]
    mf, mq = statistics.mean(free), statistics.mean(qkv)
    spread = max(max(free) - min(free), max(qkv) - min(qkv))
    text = _(
        "accuracy parameter-free {mf:.2f} (range {free_lo:.2f}–{free_hi:.2f}) vs Q/K/V {mq:.2f} ({qkv_lo:.2f}–{qkv_hi:.2f}), chance {chance:.2f}"
    ).format(
        mf=mf,
        free_lo=min(free),
        free_hi=max(free),
        mq=mq,
        qkv_lo=min(qkv),
        qkv_hi=max(qkv),
        chance=m["chance"],
    )
    if mq >= 0.9 and min(qkv) > max(free) and mq - mf > max(0.2, spread):
        return Verdict(HOLDS, text)
    return Verdict(FAILS, text)


def run(
    out_dir: Path | None = None,
    progress: Any = None,
    *,
    seeds: int = 5,
    steps: int = 300,
    batch: int = 128,
    d: int = 32,
    lr: float = 1e-2,
    threads: int | None = 1,
) -> LessonResult:
    results: dict[str, list[dict[str, Any]]] = {"parameter-free": [], "Q/K/V": []}
    with (
        torch_threads(threads),
        progress_steps(progress, _("training 2 models × seeds"), 2 * seeds * steps) as advance,
    ):
        for kind in results:
            for seed in range(seeds):
                results[kind].append(train_one(kind, seed, steps, batch, d, lr, advance))
    m: dict[str, Any] = {
        "accuracy": {k: [r["accuracy"] for r in v] for k, v in results.items()},
        "final_loss": {k: [statistics.mean(r["losses"][-20:]) for r in v] for k, v in results.items()},
        "chance": 1 / PAYLOADS,
        "steps": steps,
        "seeds": seeds,
    }
    rows = []
    for k in results:
        acc = m["accuracy"][k]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        rows.append(
            [
                _(k),
                f"{statistics.mean(acc):.3f} ± {sd:.3f}",
                " ".join(f"{a:.3f}" for a in acc),
                f"{statistics.mean(m['final_loss'][k]):.3f}",
            ]
        )
    table = ResultTable(
        _(
            "fetch-your-partner task: {seeds} seeds × {steps} steps × batch {batch}, d = {d}, Adam lr {lr}; test on 2000 fresh sequences (chance {value:.2f})"
        ).format(seeds=seeds, steps=steps, batch=batch, d=d, lr=lr, value=1 / PAYLOADS),
        [_("attention"), _("accuracy mean ± sd"), _("per seed"), _("final train loss")],
        rows,
    )
    figures = []
    if out_dir is not None:
        from ._base import new_figure, save_figure

        fig, ax = new_figure()
        for k, color in (("parameter-free", "tab:red"), ("Q/K/V", "tab:blue")):
            for i, r in enumerate(results[k]):
                ax.plot(r["losses"], color=color, alpha=0.6, lw=0.8, label=_(k) if i == 0 else None)
        ax.axhline(
            torch.log(torch.tensor(float(PAYLOADS))).item(),
            color="grey",
            ls="--",
            lw=0.8,
            label=_("chance loss ln 4"),
        )
        ax.set_xlabel(_("training step"))
        ax.set_ylabel(_("cross-entropy"))
        ax.set_title(_("lecture 000: fetching a dissimilar partner"))
        ax.legend()
        figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(LESSON, m, verdict(m), tables=[table], figures=figures)
