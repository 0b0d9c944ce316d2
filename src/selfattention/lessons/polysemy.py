"""Lesson ``polysemy`` (lecture 003, 定性验证): one static embedding, different contextual vectors.

"apple" in three English sentences (all-MiniLM-L6-v2 is an uncased English model, so "Apple" and "apple"
are the same token): its row of the word-embedding table is identical, its vector after each layer is
not. Measured: cosine similarity of the three "apple" vectors per layer, and whether the two fruit
sentences end up closer to each other than to the company sentence. Also how the attention row of
"apple" differs between sentences (the mixing weights are computed from the sentence, not stored).

The lecture's own pair (“苹果公司发布了新款” / “他咬了一口苹果”) cannot go through MiniLM: its WordPiece
vocabulary has no 苹 or 果, so 苹果 becomes [UNK] [UNK]; the lesson prints the tokenizer's output to
show it. With m3e-small installed (``make zh``), the lesson measures the pair on it
(:mod:`selfattention.lessons._polysemy_zh`) and the verdict comes from that measurement; without it,
the verdict comes from the English sentences and a note says how to install it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..i18n import N_, _
from . import _polysemy_zh
from ._base import FAILS, HOLDS, ONLY_WHEN, Lesson, LessonResult, ResultTable, Verdict

LESSON = Lesson(
    name="polysemy",
    summary=N_("one word, many contextual vectors"),
    lecture="003",
    section="定性验证：一词多义问题解决了吗",
    claim_zh="两句话里“苹果”查表查出来的初始向量完全相同，但自注意力算出来的最终表示完全不同",
    claim_en=N_(
        "The same word has one static embedding but different contextual vectors in different "
        "sentences, because the mixing weights are computed from the sentence (company vs fruit sense)."
    ),
    kind="measured",
    module="polysemy",
    needs_model=True,
)

SENTENCES = (
    "Apple released a new phone.",
    "He took a bite of the apple.",
    "She ate an apple for lunch.",
)
CHINESE = _polysemy_zh.SENTENCES_ZH
WORD = "apple"


def _layer_label(k: int, short: bool = False) -> str:
    """Row ``k`` of the hidden states: 0 = the embeddings, k ≥ 1 = the output of layer k − 1 (0-based)."""
    if short:  # figure ticks, the same in every language: the translated x label says what emb is
        return "emb" if k == 0 else str(k - 1)
    return _("embeddings (+ position)") if k == 0 else _("after layer {layer}").format(layer=k - 1)


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: with ``m["zh"]`` (the lecture's pair measured on m3e-small) the verdict on it
    (:func:`~selfattention.lessons._polysemy_zh.verdict_zh`); otherwise on the English sentences:
    ``static_cos`` (word-embedding rows), ``last_cos`` = {"12", "13", "23"} cosines after the last layer
    (1 = company sentence, 2 and 3 = fruit sentences)."""
    if m.get("zh") is not None:
        return _polysemy_zh.verdict_zh(m["zh"])
    if m["static_cos"] < 1 - 1e-6:
        return Verdict(FAILS, _("the static embeddings differ (cos {cos:.4f})").format(cos=m["static_cos"]))
    last = m["last_cos"]
    if max(last.values()) > 0.99:
        return Verdict(
            FAILS,
            _("the contextual vectors are nearly identical (cos up to {cos:.3f})").format(
                cos=max(last.values())
            ),
        )
    by_sense = last["23"] > max(last["12"], last["13"])
    # said in the verdict itself: without m3e-small it is not the lecture's pair that was measured
    where = _(
        "on the English “apple” sentences with MiniLM, not the lecture's 苹果 pair (that needs `make zh`)"
    )
    if by_sense:
        return Verdict(
            HOLDS,
            _(
                "{where}: static cos = {static:.3f}; last layer cos fruit–fruit {c23:.3f} > company–fruit "
                "{c12:.3f}, {c13:.3f}"
            ).format(where=where, static=m["static_cos"], c12=last["12"], c13=last["13"], c23=last["23"]),
        )
    return Verdict(
        ONLY_WHEN,
        _("{where}: vectors differ (cos {c12:.3f}, {c13:.3f}, {c23:.3f}) but not grouped by sense").format(
            where=where, c12=last["12"], c13=last["13"], c23=last["23"]
        ),
        condition=_("'different' is enough: the vectors differ but do not group by sense"),
    )


def run(out_dir: Path | None = None, progress: Any = None) -> LessonResult:
    from ..pretrained import load_model, run_text

    model, tok = load_model()
    runs = [run_text(s, compare=False) for s in SENTENCES]
    idx = [r.tokens.index(WORD) for r in runs]
    ids = [int(r.input_ids[0, i]) for r, i in zip(runs, idx, strict=True)]
    emb = model.embeddings.word_embeddings.weight.detach()
    static = [emb[i] for i in ids]
    cos = torch.nn.functional.cosine_similarity
    static_cos = min(cos(static[0], s, dim=0).item() for s in static[1:])
    per_layer = []
    n_layers = len(runs[0].hidden_states)
    for layer in range(n_layers):
        v = [r.hidden_states[layer][0, i] for r, i in zip(runs, idx, strict=True)]
        per_layer.append(
            {
                "12": cos(v[0], v[1], dim=0).item(),
                "13": cos(v[0], v[2], dim=0).item(),
                "23": cos(v[1], v[2], dim=0).item(),
            }
        )
    m: dict[str, Any] = {
        "token_ids": ids,
        "static_cos": static_cos,
        "per_layer": per_layer,
        "last_cos": per_layer[-1],
    }
    table = ResultTable(
        _("cosine of the “{word}” vectors: 1 = “{s1}”, 2 = “{s2}”, 3 = “{s3}”").format(
            word=WORD, s1=SENTENCES[0], s2=SENTENCES[1], s3=SENTENCES[2]
        ),
        [_("layer"), "cos(1, 2)", "cos(1, 3)", "cos(2, 3)"],
        [[_("static word embedding"), f"{static_cos:.4f}", f"{static_cos:.4f}", f"{static_cos:.4f}"]]
        + [
            [
                _layer_label(k),
                f"{c['12']:.4f}",
                f"{c['13']:.4f}",
                f"{c['23']:.4f}",
            ]
            for k, c in enumerate(per_layer)
        ],
    )
    top = []
    for r, i in zip(runs, idx, strict=True):
        row = r.attentions[:, :, i, :].mean(dim=(0, 1))  # mean over layers and heads, (T,)
        best = row.argsort(descending=True)[:3].tolist()
        top.append([r.text, ", ".join(f"{r.tokens[j]} {row[j]:.2f}" for j in best)])
    zh = [[s, " ".join(tok.tokenize(s))] for s in CHINESE]
    m["chinese_tokens"] = [row[1] for row in zh]
    tables = [
        table,
        ResultTable(
            _("where “{word}” looks (weights averaged over {layers} layers × {heads} heads, top 3)").format(
                word=WORD, layers=runs[0].attentions.shape[0], heads=runs[0].attentions.shape[1]
            ),
            [_("sentence"), _("keys")],
            top,
        ),
        ResultTable(
            _("the lecture's Chinese pair through MiniLM's tokenizer"), [_("text"), _("MiniLM's tokens")], zh
        ),
    ]
    figures = []
    if out_dir is not None:
        from ._base import new_figure, save_figure

        fig, ax = new_figure()
        layers = list(range(n_layers))  # 0 = embeddings, k = after layer k - 1 (0-based layers)
        for key, label in (
            ("12", _("company vs fruit (1,2)")),
            ("13", _("company vs fruit (1,3)")),
            ("23", _("fruit vs fruit (2,3)")),
        ):
            ax.plot(layers, [c[key] for c in per_layer], "o-", label=label)
        ax.set_xticks(layers, [_layer_label(k, short=True) for k in layers])
        ax.set_xlabel(_("after layer (0-based; emb = embeddings incl. position)"))
        ax.set_ylabel(_("cosine of the “{word}” vectors").format(word=WORD))
        ax.set_title(_("lecture 003: one static embedding, different contextual vectors"))
        ax.legend()
        figures.append(save_figure(fig, out_dir, LESSON.name))
    notes = [
        _(
            "Layers count from 0, as in `explain` and `report`. The embeddings already differ because the "
            "position embedding is added before layer 0; the static word-embedding rows themselves are "
            "identical (same token id)."
        ),
        _(
            "The lecture's 苹果 pair: MiniLM tokenizes “{sentence}” as {tokens}: 苹果 is [UNK] [UNK], so it "
            "cannot be measured with MiniLM."
        ).format(sentence=CHINESE[1], tokens=m["chinese_tokens"][1]),
    ]
    try:
        m["zh"] = _polysemy_zh.measure()
    except ImportError as e:
        m["zh"] = None
        notes.append(_("The lecture's pair needs a Chinese model: {error}").format(error=e))
    if m["zh"] is not None:
        tables.extend(_polysemy_zh.tables(m["zh"]))
        notes.append(
            _(
                "The verdict is measured on the lecture's own pair with m3e-small (moka-ai; non-commercial / "
                "research use). 苹果 is two tokens there (苹 果): its vector is their mean; each anchor word "
                "ran through the model alone."
            )
        )
        if out_dir is not None:
            figures.append(_figure_zh(m["zh"], out_dir))
    return LessonResult(LESSON, m, verdict(m), tables=tables, figures=figures, notes=notes)


def _figure_zh(zh: dict[str, Any], out_dir: Path) -> Path:
    """Cosines per layer on the lecture's pair (Chinese labels: drawn with a CJK font when installed)."""
    from ._base import new_figure, save_figure

    fig, ax = new_figure()
    rows = list(range(len(zh["sentence_cos"])))
    word = _polysemy_zh.WORD_ZH
    ax.plot(rows, zh["sentence_cos"], "o-", color="black", label=f"两句中的“{word}”之间")
    company, fruit = _polysemy_zh.ANCHORS["company"][0], _polysemy_zh.ANCHORS["fruit"][1]
    for anchor, colour in ((company, "tab:blue"), (fruit, "tab:red")):
        a = zh["anchors"][anchor]
        ax.plot(rows, a["company"], "s-", color=colour, label=f"公司句的“{word}” ↔ {anchor}")
        ax.plot(rows, a["fruit"], "^--", color=colour, label=f"水果句的“{word}” ↔ {anchor}")
    ax.set_xticks(rows, [_layer_label(k, short=True) for k in rows])
    ax.set_xlabel(_("after layer (0-based; emb = embeddings incl. position)"))
    ax.set_ylabel(_("cosine"))
    ax.set_title(f"第 3 讲：“{_polysemy_zh.SENTENCES_ZH[0]}” / “{_polysemy_zh.SENTENCES_ZH[1]}” (m3e-small)")
    ax.legend(fontsize=8)
    return save_figure(fig, out_dir, LESSON.name + "-zh")
