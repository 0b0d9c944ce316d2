"""The mistakes the grader can name, each with the lecture passage that covers it.

A mistake has a stable ``code`` (what autograders match on), a message telling the learner what their code
does and what the lecture asks for (English message id, translated through the catalog), and where the
lectures say it: the lecture number, the section (the lecture's own heading, in Chinese) and a short quote.
Where the lectures do not treat a subject (masks, multi-head layout, the cache's bookkeeping: lecture 003
only points ahead to 第 10 讲 and 第 22 讲), ``lecture`` names the nearest passage and ``note`` says what the
rule rests on instead (this library's documented convention), so no passage is claimed that is not there.

>>> MISTAKES["missing_scale"].lecture
'003'
>>> "√dₖ" in MISTAKES["missing_scale"].quote
True
"""

from __future__ import annotations

from dataclasses import dataclass

from ..i18n import N_, _
from ..lectures import label

__all__ = ["Mistake", "MISTAKES", "cited", "passage"]


@dataclass(frozen=True)
class Mistake:
    """One mistake the grader names.

    Attributes:
        code: stable identifier (snake_case), what autograders match on.
        message: English message id (translated with ``_`` where shown).
        lecture: "000" or "003", or "" when no lecture passage applies at all.
        section: where in the lecture (its own heading, quoted as the lecture writes it).
        quote: a short quote of the passage (Chinese, as the lecture words it).
        note: English message id saying what the rule rests on when the lecture does not state it.
        other: (lecture, section, quote) of the same rule in the other lecture, cited instead when the
            task graded is that lecture's (lecture 000's ``simple_attention`` has no Q, K or √dₖ).
    """

    code: str
    message: str
    lecture: str
    section: str
    quote: str
    note: str = ""
    other: tuple[str, str, str] | None = None


_SCALE_003 = ("003", "§三 缩放：一个工程修正", "把每个分数除以 √dₖ（dₖ 是 Key 向量的维度）")
_SOFTMAX_000 = ("000", "三步走的算法 · Step 2", "沿 j 维做 softmax 归一化，让所有 j 的权重和为 1")
_SOFTMAX_003 = (
    "003",
    "§三 softmax：把打分变成合法权重",
    "对每个位置 i 算出的一整行分数 … 变成一组非负、加起来等于 1 的权重",
)
_SCORE_003 = ("003", "§三 打分：用点积衡量匹配程度", "score(i, j) = Qᵢ · Kⱼ")
_FORMULA_003 = ("003", "§三 加权求和：算出新的表示", "Attention(Q, K, V) = softmax(QKᵀ / √dₖ) · V")
_FORMULA_000 = ("000", "矩阵形式：一次算完整个序列", "Z = softmax(X Xᵀ) X")
_SCORES_000 = ("000", "矩阵形式：一次算完整个序列", "所有 token 两两内积矩阵，第 (i, j) 项就是 ω_ij")
_OUTPUT_000 = ("000", "三步走的算法 · Step 3", "z_i 就是位置 i 的新表示")
_CACHE_003 = (
    "003",
    "§五 和后面课程的关系",
    "第 22 讲的 KV Cache … 生成文字时，之前位置的 K、V 一旦算过就不会变，可以缓存下来避免重复计算",
)
_HEADS_003 = ("003", "§五 和后面课程的关系", "第 10 讲要做两件事：一是同时算好几组不同的 Q/K/V（“多头”…）")
_MASK_NOTE = N_(
    "The lectures do not treat masks; the rule is this library's convention (docs/edge-cases.md): "
    "a bool mask is True where the query may attend, a query that sees no key gets a zero vector."
)
_HEADS_NOTE = N_(
    "Lecture 003 only announces multi-head attention (lecture 10); the layout is the field's: "
    "(B, T, H·D) ↔ (B, H, T, D), head h holding features h·D … h·D + D − 1."
)
_CACHE_NOTE = N_(
    "Lecture 003 announces the KV cache (lecture 22); the rule follows from it: the new token's key and "
    "value are written at its position pos, and its query attends to positions 0 … pos, itself included."
)

_ALL = [
    Mistake(
        "mutates_input",
        N_(
            "Your code changes its input {detail} in place (an in-place op such as div_, masked_fill_ or "
            "`x /= …` on an argument): the caller's tensor changes too. Compute into a new tensor instead "
            "(q = q / √d_k, not q /= √d_k)."
        ),
        "",
        "",
        "",
    ),
    Mistake(
        "exception",
        N_("Your code raised an exception: {detail}"),
        "",
        "",
        "",
    ),
    Mistake(
        "wrong_shape",
        N_("The output has the wrong shape: {detail}"),
        "003",
        "§三 加权求和：算出新的表示",
        "输出ᵢ = Σⱼ softmax(score(i,·))ⱼ × Vⱼ",
        other=_OUTPUT_000,
    ),
    Mistake(
        "unrecognised",
        N_(
            "The output differs from the spec in a way none of the known mistakes explains: {detail}. "
            "Compare your steps one by one with the lecture's (scores, scaling, softmax, weighted sum)."
        ),
        *_FORMULA_003,
        other=_FORMULA_000,
    ),
    Mistake(
        "low_precision",
        N_(
            "Your outputs are {detail} numbers: some step runs in half precision, or the result is "
            "rounded to it (a .half(), a float16 tensor, autocast), which keeps about 3 significant digits, "
            "so no output can match the spec closer than ≈ 1e-3. The inputs are float32: compute and return "
            "float32."
        ),
        *_FORMULA_003,
        other=_FORMULA_000,
    ),
    Mistake(
        "not_gradable",
        N_("This code cannot be graded: {detail}"),
        "",
        "",
        "",
    ),
    Mistake(
        "softmax_axis",
        N_(
            "The softmax runs over the wrong axis (over the queries, dim=0 / dim=-2): it must run over "
            "the keys, the last axis, so that each query's weights sum to 1."
        ),
        *_SOFTMAX_000,
    ),
    Mistake(
        "missing_scale",
        N_("The scores are not scaled: divide Q Kᵀ by √d_k (d_k = the key dimension) before the softmax."),
        *_SCALE_003,
    ),
    Mistake(
        "scale_d_k",
        N_("The scores are divided by d_k instead of √d_k: take the square root of the key dimension."),
        *_SCALE_003,
    ),
    Mistake(
        "scale_d_model",
        N_(
            "The scores are divided by √d_model (the input/embedding size) instead of √d_k (the size of "
            "one key vector, the head dimension)."
        ),
        *_SCALE_003,
    ),
    Mistake(
        "scale_inverted",
        N_(
            "The scores are multiplied by √d_k instead of divided by it (a factor d_k**-0.5 used as a "
            "divisor, or d_k**0.5 as a multiplier)."
        ),
        *_SCALE_003,
    ),
    Mistake(
        "extra_scale",
        N_(
            "Lecture 000's simplified attention has no scaling: ω_ij = x_i · x_j, Z = softmax(X Xᵀ) X; "
            "your code divides the scores by √d."
        ),
        "000",
        "三步走的算法 · Step 1",
        "ω_ij = x_i · x_j",
    ),
    Mistake(
        "missing_transpose",
        N_(
            "The scores are computed without the transpose: score(i, j) = query i · key j is Q Kᵀ "
            "(X Xᵀ in lecture 000): q @ k.T, or k.transpose(-2, -1) for batches. Without it the "
            "product runs only when the number of keys happens to equal the vector size, and then "
            "multiplies the wrong numbers."
        ),
        *_FORMULA_003,
        other=_SCORES_000,
    ),
    Mistake(
        "transposed_scores",
        N_(
            "The score table is transposed: your code computes K Qᵀ (or uses the weights transposed), "
            "so row i holds what keys ask of query i. Score(i, j) is query i against key j: Q Kᵀ."
        ),
        *_SCORE_003,
    ),
    Mistake(
        "rows_not_normalized",
        N_(
            "The weights of a query do not sum to 1: the softmax (exp, then divide by the row's sum) is "
            "missing or incomplete, or the mask is applied after the softmax without renormalising."
        ),
        *_SOFTMAX_003,
        other=_SOFTMAX_000,
    ),
    Mistake(
        "value_not_projected",
        N_(
            "The weighted sum uses the input X instead of the values V = X·W_v: W_v is never applied "
            "to what is summed."
        ),
        "003",
        "§三 三个投影：Query、Key、Value",
        "V = X·Wv （这个词真正的“内容”，被参考时实际拿走的东西）",
    ),
    Mistake(
        "mask_polarity",
        N_(
            "The mask is read the wrong way round: True (1) means this query MAY attend to this key, "
            "your code hides the keys the mask allows and shows the ones it hides."
        ),
        *_SOFTMAX_003,
        note=_MASK_NOTE,
    ),
    Mistake(
        "mask_ignored",
        N_("The mask is ignored: hidden keys still get weight."),
        *_SOFTMAX_003,
        note=_MASK_NOTE,
    ),
    Mistake(
        "mask_fill_zero",
        N_(
            "Hidden keys get the score 0 (the scores are multiplied by the mask, or filled with 0) "
            "instead of −∞: exp(0) = 1, so they still get weight."
        ),
        *_SOFTMAX_003,
        note=_MASK_NOTE,
    ),
    Mistake(
        "masked_row_nan",
        N_(
            "A query that sees no key (a fully masked row) gets NaN: softmax of a row of −∞ is 0/0. "
            "Such a query must get a zero vector (set its weights to 0)."
        ),
        *_SOFTMAX_003,
        note=_MASK_NOTE,
    ),
    Mistake(
        "masked_row_uniform",
        N_(
            "A query that sees no key (a fully masked row) gets uniform weights over all keys, the mean "
            "of the values of keys it may not see (a large negative fill such as -1e9 instead of −∞). "
            "Such a query must get a zero vector."
        ),
        *_SOFTMAX_003,
        note=_MASK_NOTE,
    ),
    Mistake(
        "causal_top_left",
        N_(
            "The causal mask is aligned top-left: with fewer queries than keys (Tq < Tk, new tokens after "
            "cached ones) query i must sit at key position Tk − Tq + i and see keys 0 … Tk − Tq + i."
        ),
        *_CACHE_003,
        note=_MASK_NOTE,
    ),
    Mistake(
        "causal_diagonal",
        N_(
            "The causal mask's diagonal is off by one: each query must see itself and the keys before it, "
            "no more (a query that cannot see itself, or sees the next key)."
        ),
        *_CACHE_003,
        note=_MASK_NOTE,
    ),
    Mistake(
        "causal_future",
        N_(
            "The causal mask lets each query see the future instead of the past (the upper triangle "
            "instead of the lower one)."
        ),
        *_CACHE_003,
        note=_MASK_NOTE,
    ),
    Mistake(
        "heads_split_order",
        N_(
            "The heads are split in the wrong order: (B, T, H·D) must become (B, T, H, D) and then be "
            "transposed to (B, H, T, D); a direct view as (B, H, T, D), or heads taking every H-th "
            "feature, mixes tokens and features."
        ),
        *_HEADS_003,
        note=_HEADS_NOTE,
    ),
    Mistake(
        "heads_merge_order",
        N_(
            "The heads are merged in the wrong order: (B, H, T, D) must be transposed to (B, T, H, D) "
            "before the reshape to (B, T, H·D); reshaping directly mixes tokens of different positions."
        ),
        *_HEADS_003,
        note=_HEADS_NOTE,
    ),
    Mistake(
        "cache_off_by_one",
        N_(
            "The cache position is off by one: the new key/value go to index pos and the query attends "
            "to cache[0 … pos] (pos + 1 entries, itself included) — your code writes or reads one slot off."
        ),
        *_CACHE_003,
        note=_CACHE_NOTE,
    ),
    Mistake(
        "cache_not_written",
        N_(
            "The new key/value are not written into the cache (at index pos): the next decode step will "
            "not see this token."
        ),
        *_CACHE_003,
        note=_CACHE_NOTE,
    ),
]

MISTAKES: dict[str, Mistake] = {m.code: m for m in _ALL}
"""Every mistake the grader names, by code."""


def cited(mistake: Mistake, lecture: str | None = None) -> tuple[str, str, str]:
    """(lecture, section, quote) cited for ``mistake`` when grading a task of ``lecture``: its ``other``
    passage when that one is from the task's lecture, else its own."""
    if lecture and mistake.other is not None and mistake.other[0] == lecture:
        return mistake.other
    return mistake.lecture, mistake.section, mistake.quote


def passage(mistake: Mistake, lecture: str | None = None) -> str:
    """Where the lectures cover ``mistake``, in the interface language: ``lecture NNN · title, section:
    “quote”``; ``""`` when no passage applies (an exception, code that cannot be graded). ``lecture``: the
    graded task's lecture (see :func:`cited`). What the rule rests on when the lecture does not state it
    is ``_(mistake.note)``."""
    number, section, quote = cited(mistake, lecture)
    if not number:
        return ""
    return _("{label}, {section}: “{quote}”").format(label=label(number), section=section, quote=quote)
