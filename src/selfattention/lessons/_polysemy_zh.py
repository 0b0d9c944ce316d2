"""The polysemy lesson on the lecture's own pair, “苹果公司发布了新款” / “他咬了一口苹果”, with m3e-small.

Lecture 003 (定性验证): in the first sentence 苹果 should be pulled towards “公司”“发布” (brand, technology),
in the second towards “咬”“一口” (fruit, food). m3e-small (``make zh``) reads one token per Chinese
character, so 苹果 is the two tokens 苹 果; its vector here is the mean of their two vectors.

Measured per row of the hidden states (0 = the embeddings incl. position, k ≥ 1 = after layer k − 1):

* the cosine of 苹果's vectors between the two sentences;
* the cosine of each 苹果 with anchor words of the two senses — company: 手机, 公司, 发布; fruit: 水果,
  咬, 吃 — each anchor run through the model on its own (``[CLS] 手 机 [SEP]``, the mean of its characters'
  vectors at the same row).

The verdict (:func:`verdict_zh`) is computed from those numbers: the two 苹果 vectors must differ at the
last layer, and each sense's 苹果 must sit nearer its own anchors than the other 苹果 does.
"""

from __future__ import annotations

from typing import Any

import torch

from ..i18n import _
from ._base import FAILS, HOLDS, ONLY_WHEN, ResultTable, Verdict

__all__ = ["ANCHORS", "SENTENCES_ZH", "WORD_ZH", "measure", "tables", "verdict_zh"]

SENTENCES_ZH = ("苹果公司发布了新款", "他咬了一口苹果")
"""The lecture's pair, quoted exactly (lecture 003, 定性验证)."""
WORD_ZH = "苹果"
ANCHORS = {"company": ("手机", "公司", "发布"), "fruit": ("水果", "咬", "吃")}
"""Anchor words of the two senses (company / fruit), each run through the model alone."""
SENSE_ZH = {"company": "公司", "fruit": "水果"}


def _span(tokens: list[str], word_tokens: list[str]) -> slice:
    """Where ``word_tokens`` first occurs in ``tokens``."""
    n = len(word_tokens)
    for i in range(len(tokens) - n + 1):
        if tokens[i : i + n] == word_tokens:
            return slice(i, i + n)
    raise ValueError(f"{''.join(word_tokens)} is not among the tokens {tokens}")


def _word_vectors(run: Any, word_tokens: list[str]) -> list[torch.Tensor]:
    """The word's vector (mean of its tokens) at every row of ``run.hidden_states``, float64."""
    where = _span(run.tokens, word_tokens)
    return [h[0, where].double().mean(dim=0) for h in run.hidden_states]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def measure(model: str = "m3e-small") -> dict[str, Any]:
    """Run the lecture's pair and the anchors through ``model`` on our attention; see the module docstring.

    Returns a dict: ``tokens`` (the two token lists), ``static_cos`` (the word-embedding rows of 苹果 in
    the two sentences), ``sentence_cos`` (one cosine per row: embeddings, then after each layer),
    ``anchors`` = {word: {"sense", "company": [per row], "fruit": [per row]}} (cosines of the company
    and the fruit 苹果 with the anchor), ``attended`` (for each sentence the 3 other non-special
    tokens 苹果 attends to most, weights averaged over layers, heads and its two tokens).

    Raises:
        ImportError: the model is not installed (the message says how to install it).
    """
    from ..pretrained import load_model, run_text

    net, tokenizer = load_model(model)
    word = tokenizer.tokenize(WORD_ZH)
    runs = [run_text(s, model=model, compare=False) for s in SENTENCES_ZH]
    apple = [_word_vectors(r, word) for r in runs]
    table = net.embeddings.word_embeddings.weight.detach().double()
    static = [table[r.input_ids[0, _span(r.tokens, word)]].mean(dim=0) for r in runs]
    anchors: dict[str, dict[str, Any]] = {}
    for sense, words in ANCHORS.items():
        for w in words:
            vec = _word_vectors(run_text(w, model=model, compare=False), tokenizer.tokenize(w))
            anchors[w] = {
                "sense": sense,
                "company": [_cos(a, v) for a, v in zip(apple[0], vec, strict=True)],
                "fruit": [_cos(a, v) for a, v in zip(apple[1], vec, strict=True)],
            }
    attended = []
    for r in runs:
        where = _span(r.tokens, word)
        row = r.attentions[:, :, where, :].mean(dim=(0, 1, 2))  # over layers, heads and 苹/果: (T,)
        others = [j for j in range(len(r.tokens)) if not r.special[j] and not where.start <= j < where.stop]
        best = sorted(others, key=lambda j: -float(row[j]))[:3]
        attended.append([(r.tokens[j], float(row[j])) for j in best])
    return {
        "tokens": [r.tokens for r in runs],
        "static_cos": _cos(static[0], static[1]),
        "sentence_cos": [_cos(a, b) for a, b in zip(apple[0], apple[1], strict=True)],
        "anchors": anchors,
        "attended": attended,
    }


def verdict_zh(zh: dict[str, Any]) -> Verdict:
    """Pure: from :func:`measure`'s ``static_cos``, ``sentence_cos`` and ``anchors`` (last row decides).

    Holds when the static rows are identical, the two 苹果 vectors differ at the last layer (cos < 0.99)
    and every anchor is nearer the 苹果 of its own sense than the other 苹果.
    """
    if zh["static_cos"] < 1 - 1e-6:
        return Verdict(
            FAILS, _("the static embeddings of 苹果 differ (cos {cos:.4f})").format(cos=zh["static_cos"])
        )
    first, last = zh["sentence_cos"][0], zh["sentence_cos"][-1]
    if last > 0.99:
        return Verdict(
            FAILS,
            _("the two 苹果 vectors are nearly identical after the last layer (cos {cos:.3f})").format(
                cos=last
            ),
        )
    own = {
        w: a[a["sense"]][-1] - a["fruit" if a["sense"] == "company" else "company"][-1]
        for w, a in zh["anchors"].items()
    }
    grouped = [w for w, gap in own.items() if gap > 0]
    spread = _("cos of the two 苹果 {first:.3f} at the embeddings, {last:.3f} after the last layer").format(
        first=first, last=last
    )
    company, fruit = ANCHORS["company"][0], ANCHORS["fruit"][1]  # 手机, 咬: the comparison
    pair = _(
        "the company 苹果 is at cos {company_company:.3f} to {company} and {fruit_company:.3f} to {fruit}; "
        "the fruit 苹果 at {company_fruit:.3f} and {fruit_fruit:.3f}"
    ).format(
        company=company,
        fruit=fruit,
        company_company=zh["anchors"][company]["company"][-1],
        fruit_company=zh["anchors"][fruit]["company"][-1],
        company_fruit=zh["anchors"][company]["fruit"][-1],
        fruit_fruit=zh["anchors"][fruit]["fruit"][-1],
    )
    if len(grouped) == len(own):
        return Verdict(
            HOLDS,
            _(
                "static cos = {static:.3f}; {spread}; each of the {n} anchors is nearer the 苹果 of its own "
                "sense ({pair})"
            ).format(static=zh["static_cos"], spread=spread, n=len(own), pair=pair),
        )
    missed = ", ".join(w for w in own if w not in grouped)
    return Verdict(
        ONLY_WHEN,
        _("{spread}, but {missed} sit nearer the 苹果 of the other sense ({pair})").format(
            spread=spread, missed=missed, pair=pair
        ),
        condition=_(
            "'different' is enough: the two 苹果 vectors differ but do not move towards their own sense"
        ),
    )


def _row_label(k: int) -> str:
    return _("embeddings") if k == 0 else _("after layer {layer}").format(layer=k - 1)


def tables(zh: dict[str, Any]) -> list[ResultTable]:
    """The measurement as tables: per layer, and per anchor (embeddings → last layer)."""
    s1, s2 = SENTENCES_ZH
    company, fruit = ANCHORS["company"][0], ANCHORS["fruit"][1]  # 手机, 咬
    a, b = zh["anchors"][company], zh["anchors"][fruit]
    per_layer = ResultTable(
        _("{word} in 1 = “{s1}” and 2 = “{s2}” (m3e-small): cosines per layer").format(
            word=WORD_ZH, s1=s1, s2=s2
        ),
        [_("layer"), "1 ↔ 2", f"1 ↔ {company}", f"1 ↔ {fruit}", f"2 ↔ {company}", f"2 ↔ {fruit}"],
        [
            [_row_label(k), f"{c:.3f}", f"{a['company'][k]:.3f}", f"{b['company'][k]:.3f}"]
            + [f"{a['fruit'][k]:.3f}", f"{b['fruit'][k]:.3f}"]
            for k, c in enumerate(zh["sentence_cos"])
        ],
    )
    moves = ResultTable(
        _("which words {word} moves towards: cos with each anchor, embeddings → last layer").format(
            word=WORD_ZH
        ),
        [_("anchor"), _("sense"), _("company 苹果"), _("fruit 苹果"), _("fruit − company (last)")],
        [
            [
                w,
                SENSE_ZH[a["sense"]],
                f"{a['company'][0]:.3f} → {a['company'][-1]:.3f}",
                f"{a['fruit'][0]:.3f} → {a['fruit'][-1]:.3f}",
                f"{a['fruit'][-1] - a['company'][-1]:+.3f}",
            ]
            for w, a in zh["anchors"].items()
        ],
    )
    looks = ResultTable(
        _(
            "where {word} looks: its top 3 other words (weights averaged over layers, heads, 苹 and 果)"
        ).format(word=WORD_ZH),
        [_("sentence"), _("keys")],
        [
            [s, ", ".join(f"{t} {v:.2f}" for t, v in top)]
            for s, top in zip(SENTENCES_ZH, zh["attended"], strict=True)
        ],
    )
    return [per_layer, moves, looks]
