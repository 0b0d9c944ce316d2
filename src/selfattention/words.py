"""Words, not tokens: group a run's tokens into words and aggregate attention matrices over them.

A tokenizer cuts text into pieces that are not the words a reader (or the lecture) speaks of: m3e-small
reads 苹果 as 苹 and 果, MiniLM reads "unbelievable" as ``un ##bel ##ie ##vable``. A *word view* groups
the tokens into words and turns every (…, T, T) attention matrix into a (…, W, W) one.

Where the words come from (:func:`word_groups`):

* **Chinese** (the text has CJK characters): the PyPI segmenter `jieba <https://github.com/fxsjy/jieba>`_
  (its bundled dictionary, offline) cuts the text into words; each token joins the word that holds the
  first character of the token (the tokenizer's character offsets). Needs ``pip install jieba`` (the
  ``zh`` extra).
* **Other text**: the fast tokenizer's own word ids (``BatchEncoding.word_ids()``): the sub-word pieces of
  one pre-tokenized word (``un ##bel ##ie ##vable``) form one word.
* Special tokens (``[CLS]``, ``[SEP]``) are words of their own.

The aggregation rule (:func:`aggregate`) is the one of Clark et al. 2019, "What Does BERT Look At? An
Analysis of BERT's Attention" (BlackboxNLP 2019; their word-level attention maps, used for probing
individual heads): **the weight *to* a word is the sum of the
weights to its tokens** (keys summed), and **the weight *from* a word is the mean of its tokens' rows**
(queries averaged). Written with the (W, T) membership matrix M (M[w, t] = 1 when token t is in word w)
and its row-normalised form M̄ = M / (tokens per word)::

    A_words = M̄ · A · Mᵀ          (…, W, W)

so each word row of a row-stochastic A still sums to 1.

>>> import torch
>>> groups = [[0], [1, 2], [3]]                # [CLS] 苹 果 [SEP]: 苹果 is one word
>>> A = torch.tensor([[1.0, 0.0, 0.0, 0.0],
...                   [0.1, 0.2, 0.3, 0.4],
...                   [0.3, 0.3, 0.2, 0.2],
...                   [0.0, 0.5, 0.5, 0.0]])
>>> aggregate(A, groups)                      # row 苹果 = mean of rows 苹 and 果, column 苹果 = 苹 + 果
tensor([[1.0000, 0.0000, 0.0000],
        [0.2000, 0.5000, 0.3000],
        [0.0000, 1.0000, 0.0000]])
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SEGMENTERS", "WordGroups", "aggregate", "groups_from_spans", "membership", "word_groups"]

SEGMENTERS = ("auto", "jieba", "word_ids")
"""``auto``: jieba for text with CJK characters, else the tokenizer's word ids."""

JIEBA_MISSING = (
    "the word view of Chinese text needs the segmenter jieba: pip install jieba "
    '(or pip install "selfattention[zh]")'
)


@dataclass(frozen=True)
class WordGroups:
    """Tokens grouped into words.

    Attributes:
        words: the W word labels, in text order: the text the word covers (``苹果``, ``unbelievable``),
            or the token itself for special tokens.
        groups: W lists of token indices (0-based, ascending, consecutive); together they hold every
            token 0 .. T−1 exactly once.
        segmenter: ``"jieba"`` or ``"word_ids"``: where the words came from.
    """

    words: list[str]
    groups: list[list[int]]
    segmenter: str

    @property
    def n_tokens(self) -> int:
        return sum(len(g) for g in self.groups)

    def word_of(self, token: int) -> int:
        """The index of the word that holds ``token``."""
        for w, g in enumerate(self.groups):
            if token in g:
                return w
        raise ValueError(f"token must be in 0..{self.n_tokens - 1}, got {token}")


def membership(groups: Sequence[Sequence[int]], n_tokens: int) -> torch.Tensor:
    """The (W, T) float64 0/1 matrix M with M[w, t] = 1 when token t is in word w.

    Raises:
        ValueError: the groups do not hold every token 0 .. n_tokens−1 exactly once, or a group is empty.

    >>> membership([[0], [1, 2]], 3).tolist()
    [[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]
    """
    seen = [t for g in groups for t in g]
    if any(len(g) == 0 for g in groups):
        raise ValueError("groups: every word needs at least one token")
    if sorted(seen) != list(range(n_tokens)):
        raise ValueError(
            f"groups must hold every token 0..{n_tokens - 1} exactly once, got {[list(g) for g in groups]}"
        )
    m = torch.zeros(len(groups), n_tokens, dtype=torch.float64)
    for w, g in enumerate(groups):
        m[w, list(g)] = 1.0
    return m


def aggregate(weights: torch.Tensor, groups: Sequence[Sequence[int]]) -> torch.Tensor:
    """Attention over tokens → attention over words (Clark et al. 2019): keys summed, queries averaged.

    Args:
        weights: (…, T, T) — rows are queries, columns keys (any real matrix: raw weights, rollout,
            flow, norms).
        groups: W lists of token indices covering 0 .. T−1 once each (:attr:`WordGroups.groups`).

    Returns:
        (…, W, W) in the dtype of ``weights`` (computed in float64): entry (a, b) is the mean over the
        tokens i of word a of Σ_{j in word b} weights[i, j]. Rows that summed to 1 still do.

    Raises:
        ValueError: ``weights`` is not (…, T, T) or the groups do not cover its T tokens.
    """
    w = torch.as_tensor(weights)
    if w.dim() < 2 or w.shape[-1] != w.shape[-2]:
        raise ValueError(f"weights must be (..., T, T), got shape {tuple(w.shape)}")
    m = membership(groups, w.shape[-1])  # (W, T)
    mean_q = m / m.sum(-1, keepdim=True)  # (W, T): each word's row averages its tokens
    out = mean_q @ w.detach().to("cpu", torch.float64) @ m.T  # (…, W, W)
    return out.to(w.dtype if w.dtype.is_floating_point else torch.float64)


def groups_from_spans(
    token_spans: Sequence[tuple[int, int] | None], word_spans: Sequence[tuple[int, int]], text: str
) -> tuple[list[list[int]], list[str]]:
    """Group tokens by the word span holding each token's first character.

    Args:
        token_spans: per token, its (start, end) character offsets in ``text``, or None for a special
            token (a word of its own). An empty span (0, 0) counts as special too.
        word_spans: the words' (start, end) character offsets, ascending, not overlapping.
        text: the text (for the labels).

    Returns:
        (groups, labels): consecutive tokens in one word span form one group, labelled with the text of
        the span; a token outside every span (e.g. a space) forms a group labelled with its own text.

    >>> groups_from_spans([None, (0, 1), (1, 2), (2, 3), None], [(0, 2), (2, 3)], "苹果甜")
    ([[0], [1, 2], [3], [4]], [None, '苹果', '甜', None])
    """
    groups: list[list[int]] = []
    labels: list[str | None] = []
    current: Any = object()  # the word (span index) of the previous token
    for t, span in enumerate(token_spans):
        if span is None or span[0] == span[1]:
            groups.append([t])
            labels.append(None)
            current = object()
            continue
        start = span[0]
        w = next((i for i, (a, b) in enumerate(word_spans) if a <= start < b), None)
        if w is not None and w == current:
            groups[-1].append(t)
            continue
        groups.append([t])
        labels.append(text[word_spans[w][0] : word_spans[w][1]] if w is not None else text[span[0] : span[1]])
        current = w if w is not None else object()
    return groups, labels  # type: ignore[return-value]


def _jieba_spans(text: str) -> list[tuple[int, int]]:
    try:
        import jieba
    except ImportError as e:
        raise ImportError(JIEBA_MISSING) from e
    jieba.setLogLevel(logging.WARNING)  # no "Building prefix dict" lines in our output
    return [(a, b) for _w, a, b in jieba.tokenize(text) if text[a:b].strip()]


def word_groups(
    text: str,
    tokenizer: Any,
    input_ids: Sequence[int] | torch.Tensor,
    segmenter: str = "auto",
) -> WordGroups:
    """The words of a tokenized text (see the module docstring for where they come from).

    Args:
        text: the text the run tokenized.
        tokenizer: the run's fast Hugging Face tokenizer (``pretrained.load_model(model)[1]``): it must
            give character offsets (``return_offsets_mapping``) and, for ``word_ids``, word ids.
        input_ids: the T token ids the model read (``run.input_ids``), special tokens included; a text cut
            to T tokens is re-tokenized with the same cut.
        segmenter: ``"auto"`` (jieba for text with CJK characters, else ``"word_ids"``), ``"jieba"``
            or ``"word_ids"``.

    Raises:
        ValueError: unknown ``segmenter``; a tokenizer without offsets (a slow tokenizer); the tokens do
            not re-tokenize to ``input_ids``.
        ImportError: jieba is needed and not installed (the message says how to install it).
    """
    from ._scripts import has_cjk

    if segmenter not in SEGMENTERS:
        raise ValueError(f"segmenter must be one of {SEGMENTERS}, got {segmenter!r}")
    ids = torch.as_tensor(input_ids).reshape(-1).tolist()
    if segmenter == "auto":
        segmenter = "jieba" if has_cjk(text) else "word_ids"
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("the word view needs a fast tokenizer (character offsets and word ids)")
    enc = tokenizer(
        text,
        truncation=True,
        max_length=len(ids),
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
    )
    if list(enc["input_ids"]) != ids:
        raise ValueError(
            "input_ids are not what the tokenizer makes of text: give the run's own text and ids"
        )
    # the tokens the tokenizer added ([CLS], [SEP]); an [UNK] stands for characters of the text and has
    # their offsets, so it belongs to its word (all_special_ids lists [UNK] too)
    spans: list[tuple[int, int] | None] = [
        None if added else (int(a), int(b))
        for added, (a, b) in zip(enc["special_tokens_mask"], enc["offset_mapping"], strict=True)
    ]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    if segmenter == "jieba":
        groups, labels = groups_from_spans(spans, _jieba_spans(text), text)
    else:
        word_ids = enc.word_ids()
        groups, labels = [], []
        previous = None
        for t, (wid, span) in enumerate(zip(word_ids, spans, strict=True)):
            if wid is not None and span is not None and wid == previous:
                groups[-1].append(t)
                continue
            groups.append([t])
            labels.append(None)
            previous = wid if span is not None else None
        # each word's label: the text from its first token's start to its last token's end
        for w, g in enumerate(groups):
            if spans[g[0]] is not None:
                labels[w] = text[spans[g[0]][0] : spans[g[-1]][1]]  # type: ignore[index]
    words = [tokens[g[0]] if label is None else label for g, label in zip(groups, labels, strict=True)]
    return WordGroups(words=words, groups=groups, segmenter=segmenter)
