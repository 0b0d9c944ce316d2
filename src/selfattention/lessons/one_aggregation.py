"""Lesson ``one-aggregation-per-layer`` (lecture 003 §4): one layer gathers once; chaining needs layers.

A two-hop task: each of 8 items carries a name, a pointer (the name of another item, random per
sequence) and a payload (one of 4). Target for item i: the payload of next(next(i)), the item its item
points to. One attention layer can find next(i) and fetch what it holds (its pointer and payload), but
cannot use the fetched pointer to look again in the same layer; a second layer can. Trained: learnable
embeddings → 1 or 2 residual :class:`selfattention.SelfAttention` layers → linear readout, same steps,
batch, optimiser, several seeds; accuracy on fresh sequences.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..i18n import N_, _
from ..modules import SelfAttention
from ._base import FAILS, HOLDS, Lesson, LessonResult, ResultTable, Verdict, progress_steps, torch_threads

LESSON = Lesson(
    name="one-aggregation-per-layer",
    summary=N_("one layer gathers once"),
    lecture="003",
    section="四、这一讲机制自带的代价",
    claim_zh="一层自注意力只做了一次“信息汇聚”……更复杂的推理往往需要好几层自注意力叠加、反复汇聚才能做到",
    claim_en=N_(
        "One attention layer aggregates once; a chain of lookups (here: two hops) needs stacked layers."
    ),
    kind="measured",
    module="one_aggregation",
    budget="2 min",
)

NAMES, PAYLOADS, ITEMS = 16, 4, 8


def make_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(names, pointers, payloads, targets), each (n, 8); target = payload of next(next(i))."""
    names = torch.rand(n, NAMES, generator=gen).argsort(-1)[:, :ITEMS]  # distinct names
    nxt = torch.randint(0, ITEMS - 1, (n, ITEMS), generator=gen)
    nxt = nxt + (nxt >= torch.arange(ITEMS)).long()  # index of the next item, never itself
    pointers = names.gather(1, nxt)
    payloads = torch.randint(0, PAYLOADS, (n, ITEMS), generator=gen)
    targets = payloads.gather(1, nxt.gather(1, nxt))
    return names, pointers, payloads, targets


class HopModel(nn.Module):
    """Embeddings (name + pointer + payload) → ``layers`` × (x + SelfAttention(x)) → readout."""

    def __init__(self, layers: int, d: int) -> None:
        super().__init__()
        self.name = nn.Embedding(NAMES, d)
        self.pointer = nn.Embedding(NAMES, d)
        self.payload = nn.Embedding(PAYLOADS, d)
        self.layers = nn.ModuleList(SelfAttention(d, d) for _ in range(layers))
        self.readout = nn.Linear(d, PAYLOADS)

    def forward(self, names: torch.Tensor, pointers: torch.Tensor, payloads: torch.Tensor) -> torch.Tensor:
        x = self.name(names) + self.pointer(pointers) + self.payload(payloads)  # (B, T, d)
        for layer in self.layers:
            x = x + layer(x)
        return self.readout(x)


def train_one(
    layers: int, seed: int, steps: int, batch: int, d: int, lr: float, advance: Any
) -> dict[str, Any]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(20_000 + seed)
    model = HopModel(layers, d)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _step in range(steps):
        a, b, c, y = make_batch(batch, gen)
        loss = nn.functional.cross_entropy(model(a, b, c).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        advance()
    a, b, c, y = make_batch(2000, torch.Generator().manual_seed(999))
    with torch.no_grad():
        acc = (model(a, b, c).argmax(-1) == y).float().mean().item()
    return {"accuracy": acc, "losses": losses}


#: the models' names, the keys of the measurements (shown translated)
_MODELS = (N_("1 layer"), N_("2 layers"))


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``accuracy`` = {"1 layer": [per seed], "2 layers": [per seed]}."""
    one, two = m["accuracy"]["1 layer"], m["accuracy"]["2 layers"]
    m1, m2 = statistics.mean(one), statistics.mean(two)
    text = _(
        "two-hop accuracy: 1 layer {m1:.2f} ({one_lo:.2f}–{one_hi:.2f}), 2 layers {m2:.2f} ({two_lo:.2f}–{two_hi:.2f}), chance {chance:.2f}"
    ).format(
        m1=m1, one_lo=min(one), one_hi=max(one), m2=m2, two_lo=min(two), two_hi=max(two), chance=1 / PAYLOADS
    )
    if m2 >= 0.9 and min(two) > max(one) and m2 - m1 > 0.2:
        return Verdict(HOLDS, text)
    return Verdict(FAILS, text)


def run(
    out_dir: Path | None = None,
    progress: Any = None,
    *,
    seeds: int = 3,
    steps: int = 300,
    batch: int = 64,
    d: int = 32,
    lr: float = 1e-2,
    threads: int | None = 1,
) -> LessonResult:
    results: dict[str, list[dict[str, Any]]] = {"1 layer": [], "2 layers": []}
    with (
        torch_threads(threads),
        progress_steps(progress, _("training 1- and 2-layer models"), 2 * seeds * steps) as advance,
    ):
        for layers, key in ((1, "1 layer"), (2, "2 layers")):
            for seed in range(seeds):
                results[key].append(train_one(layers, seed, steps, batch, d, lr, advance))
    m: dict[str, Any] = {"accuracy": {k: [r["accuracy"] for r in v] for k, v in results.items()}}
    rows = []
    for k, acc in m["accuracy"].items():
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        rows.append([_(k), f"{statistics.mean(acc):.3f} ± {sd:.3f}", " ".join(f"{a:.3f}" for a in acc)])
    table = ResultTable(
        _(
            "two-hop pointer task: {seeds} seeds × {steps} steps × batch {batch}, d = {d}, Adam lr {lr}; test on 2000 fresh sequences (chance {value:.2f})"
        ).format(seeds=seeds, steps=steps, batch=batch, d=d, lr=lr, value=1 / PAYLOADS),
        [_("model"), _("accuracy mean ± sd"), _("per seed")],
        rows,
    )
    figures = []
    if out_dir is not None:
        from ._base import new_figure, save_figure

        fig, ax = new_figure()
        for k, color in (("1 layer", "tab:red"), ("2 layers", "tab:blue")):
            for i, r in enumerate(results[k]):
                ax.plot(r["losses"], color=color, alpha=0.6, lw=0.8, label=_(k) if i == 0 else None)
        ax.set_xlabel(_("training step"))
        ax.set_ylabel(_("cross-entropy"))
        ax.set_title(_("lecture 003: two hops need two layers"))
        ax.legend()
        figures.append(save_figure(fig, out_dir, LESSON.name))
    return LessonResult(
        LESSON,
        m,
        verdict(m),
        tables=[table],
        figures=figures,
        notes=[
            _(
                "One layer still beats chance: when next(next(i)) = i the answer is the item's own payload, "
                "and one hop narrows the candidates; it cannot follow the second pointer."
            )
        ],
    )
