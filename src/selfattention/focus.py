"""Which head and which token to show first: the strongest long-range link between two words.

Opening a report or an explanation on a positional head ("every token looks at the one before it") or on
a head that parks its weight on ``[CLS]`` shows attention's habits, not what it does with content. The
rule here is computed from the weights alone and is the same everywhere (report, explain):

    Over every layer, head and pair (query i, key j) of **word tokens** at least two positions apart,
    take the largest  weight(i → j) · log₂|i − j|  — a weight, discounted for being near. Open on that
    head and on query i.

A word token is not a special token (``[CLS]``, ``<s>`` …), is at least two letters (or one CJK
character: Chinese models such as m3e-small read one token per character), all alphabetic once
a word-piece marker (``Ġ``, ``▁``) is removed, does not continue a word (``##…``), and differs from the
other token of the pair (repeated-word heads are a positional habit too). On the built-in sentence "The
animal didn't cross the street because it was too tired." this picks layer 3, head 1 and "it" (0.68 of its
weight on "animal", 8 tokens back).

>>> import torch
>>> w = torch.zeros(1, 2, 5, 5)
>>> w[0, 0] = torch.eye(5).roll(-1, dims=1)       # head 0: every token looks at the next one
>>> w[0, 1] = torch.eye(5)
>>> w[0, 1, 4] = torch.tensor([0.1, 0.7, 0.0, 0.0, 0.2])   # head 1: "it" looks 3 back at "cat"
>>> link = strongest_link(w, ["[CLS]", "cat", "sat", "and", "it"], [True, False, False, False, False])
>>> link.layer, link.head, link.query, link.key, round(link.weight, 3), round(link.score, 3)
(0, 1, 4, 1, 0.7, 1.109)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ._scripts import has_cjk

__all__ = ["Link", "fallback_token", "strongest_link", "strongest_link_topk", "word_tokens"]

_MARKER = re.compile(r"^(Ġ|▁|Ċ)")


@dataclass(frozen=True)
class Link:
    """The chosen pair: ``layer``, ``head`` (0-based), ``query`` → ``key`` (token positions), the weight
    of that pair and its score weight · log₂ distance."""

    layer: int
    head: int
    query: int
    key: int
    weight: float
    score: float


def word_tokens(tokens: Sequence[str], special: Sequence[bool]) -> list[bool]:
    """Which tokens are words in the sense of the module doc (not special, ≥ 2 letters or one Chinese
    character, not ``##…``)."""
    out = []
    for tok, is_special in zip(tokens, special, strict=True):
        bare = _MARKER.sub("", tok)
        long_enough = len(bare) >= 2 or has_cjk(bare)  # one Chinese character is a token of its own
        out.append(not is_special and not tok.startswith("##") and long_enough and bare.isalpha())
    return out


def strongest_link(
    weights: torch.Tensor | Iterable[torch.Tensor], tokens: Sequence[str], special: Sequence[bool]
) -> Link | None:
    """The link of the module doc, or None when no two word tokens are two or more positions apart.

    Args:
        weights: (L, H, T, T) attention weights, or an iterable of L tensors (H, T, T) (one layer at a
            time, so long inputs never hold every layer at once).
        tokens: the T tokens; special: whether each is a special token.
    """
    t = len(tokens)
    gain = _gain(tokens, special)
    best: Link | None = None
    for layer, w in enumerate(weights):
        w = w.detach().to("cpu", torch.float64)
        score = w * gain  # (H, T, T)
        flat = int(score.flatten().argmax())
        head, rest = divmod(flat, t * t)
        q, k = divmod(rest, t)
        value = float(score[head, q, k])
        if value > 0 and (best is None or value > best.score):
            best = Link(layer, head, q, k, float(w[head, q, k]), value)
    return best


def strongest_link_topk(
    indices: torch.Tensor, weights: torch.Tensor, tokens: Sequence[str], special: Sequence[bool]
) -> Link | None:
    """:func:`strongest_link` over each query's heaviest keys only (for inputs too long for matrices).

    Args:
        indices: (L, H, T, k) key positions of each query's k largest weights (-1 or ≥ T: none).
        weights: (L, H, T, k) those weights.
    """
    t = len(tokens)
    gain = _gain(tokens, special)
    idx = indices.detach().to("cpu", torch.int64)
    valid = (idx >= 0) & (idx < t)
    rows = torch.arange(t)[:, None].expand(t, idx.shape[-1])  # query position of each entry
    g = torch.where(valid, gain[rows, idx.clamp(0, t - 1)], torch.zeros((), dtype=torch.float64))
    score = weights.detach().to("cpu", torch.float64) * g  # (L, H, T, k)
    flat = int(score.flatten().argmax())
    if float(score.flatten()[flat]) <= 0:
        return None
    layer, head, q, slot = (int(x) for x in torch.unravel_index(torch.tensor(flat), score.shape))
    return Link(
        layer,
        head,
        q,
        int(idx[layer, head, q, slot]),
        float(weights[layer, head, q, slot]),
        float(score[layer, head, q, slot]),
    )


def _gain(tokens: Sequence[str], special: Sequence[bool]) -> torch.Tensor:
    """(T, T) float64: log₂|i − j| for allowed word pairs (see the module doc), 0 elsewhere."""
    words = torch.tensor(word_tokens(tokens, special), dtype=torch.bool)
    t = len(tokens)
    lower = [_MARKER.sub("", tok).lower() for tok in tokens]
    dist = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).abs()
    same = torch.tensor([[a == b for b in lower] for a in lower], dtype=torch.bool).reshape(t, t)
    allowed = words[:, None] & words[None, :] & (dist >= 2) & ~same
    return torch.where(allowed, torch.log2(dist.clamp_min(1).double()), torch.zeros((), dtype=torch.float64))


def fallback_token(tokens: Sequence[str], special: Sequence[bool]) -> int:
    """The first word token (or the first non-special one, or 0): the query to open on without a link."""
    words = word_tokens(tokens, special)
    for candidates in (words, [not s for s in special]):
        if any(candidates):
            return candidates.index(True)
    return 0
