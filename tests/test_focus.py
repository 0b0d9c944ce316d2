"""selfattention.focus (which head and token to open on) against a brute-force loop, and lecture titles."""

from __future__ import annotations

import math

import pytest
import torch

from selfattention.focus import fallback_token, strongest_link, strongest_link_topk, word_tokens
from selfattention.lectures import LECTURES, lecture_title, name_lectures

TOKENS = [
    "[CLS]",
    "the",
    "animal",
    "didn",
    "'",
    "t",
    "cross",
    "the",
    "street",
    "##s",
    "it",
    "was",
    "Ġtired",
    ".",
]
SPECIAL = [True] + [False] * 13


def _oracle(w, tokens, special):
    """Plain loops over every layer, head and pair, straight from the rule's wording."""
    words = word_tokens(tokens, special)
    best = None
    for la in range(w.shape[0]):
        for h in range(w.shape[1]):
            for i in range(len(tokens)):
                for j in range(len(tokens)):
                    bare_i, bare_j = tokens[i].lstrip("Ġ").lower(), tokens[j].lstrip("Ġ").lower()
                    if not (words[i] and words[j]) or abs(i - j) < 2 or bare_i == bare_j:
                        continue
                    score = float(w[la, h, i, j]) * math.log2(abs(i - j))
                    if best is None or score > best[0]:
                        best = (score, la, h, i, j)
    return best


def test_word_tokens():
    assert word_tokens(TOKENS, SPECIAL) == [
        False,  # special
        True,
        True,
        True,
        False,  # punctuation
        False,  # one letter
        True,
        True,
        True,
        False,  # a word piece
        True,
        True,
        True,  # Ġ marks a word start (GPT-2)
        False,
    ]


@pytest.mark.parametrize("seed", range(5))
def test_strongest_link_is_the_brute_force_one(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.softmax(3 * torch.randn(3, 4, len(TOKENS), len(TOKENS), generator=g), dim=-1)
    link = strongest_link(w, TOKENS, SPECIAL)
    score, la, h, i, j = _oracle(w, TOKENS, SPECIAL)
    assert (link.layer, link.head, link.query, link.key) == (la, h, i, j)
    assert link.score == pytest.approx(score, rel=1e-12) and link.weight == pytest.approx(
        float(w[la, h, i, j])
    )
    # one layer at a time gives the same answer
    assert strongest_link(iter(w), TOKENS, SPECIAL) == link
    # and so do the top keys, when they include the winner
    top = torch.topk(w, len(TOKENS), dim=-1)
    sparse = strongest_link_topk(top.indices, top.values, TOKENS, SPECIAL)
    assert (sparse.layer, sparse.head, sparse.query, sparse.key) == (la, h, i, j)


def test_positional_and_sink_heads_are_not_links():
    t = len(TOKENS)
    w = torch.zeros(1, 3, t, t)
    w[0, 0] = torch.eye(t).roll(-1, dims=1)  # previous/next token
    w[0, 1, :, 0] = 1.0  # everything on [CLS]
    w[0, 2] = torch.eye(t)  # self
    assert strongest_link(w, TOKENS, SPECIAL) is None
    w[0, 2, 10, 2] = 0.3  # "it" -> "animal", 8 back: the only link
    link = strongest_link(w, TOKENS, SPECIAL)
    assert (link.head, link.query, link.key) == (2, 10, 2) and link.score == pytest.approx(0.3 * 3)
    w[0, 2, 7, 1] = 1.0  # "the" -> "the": the same word, not a link
    assert strongest_link(w, TOKENS, SPECIAL).query == 10


def test_fallback_token():
    assert fallback_token(TOKENS, SPECIAL) == 1
    assert fallback_token(["[CLS]", "1", "[SEP]"], [True, False, True]) == 1
    assert fallback_token(["[CLS]", "[SEP]"], [True, True]) == 0


def test_lecture_titles_replace_file_names():
    assert lecture_title("003") == "自注意力 Q/K/V" and set(LECTURES) == {"000", "003"}
    assert (
        name_lectures("lecture 000 (000_d8a7f694faaa8a59.txt), section x")
        == "lecture 000 (简化自注意力), section x"
    )
    assert name_lectures("no file here") == "no file here"
    with pytest.raises(KeyError, match="no lecture '007'"):
        lecture_title("007")
