"""Claims of the lectures with no honest measurement here, each with the reason (and checked examples)."""

from __future__ import annotations

from ..i18n import N_
from ._base import Lesson

DISCUSSED: tuple[Lesson, ...] = (
    Lesson(
        name="origin-bahdanau",
        summary=N_("attention's origin: Bahdanau 2015"),
        lecture="000",
        section="Bahdanau 2015: attention 的起源",
        claim_zh="Attention 起源是解决 RNN encoder-decoder 的信息瓶颈",
        claim_en=N_(
            "Attention was introduced (Bahdanau et al. 2015) to remove the fixed-vector bottleneck of "
            "RNN encoder–decoders."
        ),
        kind="discussed",
        reason=N_(
            "a historical statement about the literature; nothing to compute. Source: arXiv:1409.0473."
        ),
    ),
    Lesson(
        name="attention-is-the-skeleton",
        summary=N_("the Transformer's skeleton"),
        lecture="000",
        section="Transformer 把 attention 从配菜变主菜",
        claim_zh="“Attention Is All You Need”：attention 不只是 RNN 的补丁，它自己就是骨架",
        claim_en=N_(
            "The Transformer replaced recurrence with attention entirely; self-attention is its only "
            "new mechanism (003: 剩下的部分你已经全部见过)."
        ),
        kind="discussed",
        reason=N_("a statement about an architecture's design and history, not a measurable property."),
    ),
    Lesson(
        name="worked-example-000",
        summary=N_("'Your journey starts' numbers"),
        lecture="000",
        section="一个 3-token 例子从头到尾 (Your journey starts)",
        claim_zh="α_2 ≈ 0.21, 0.36, 0.43，Z ≈ 17.0",
        claim_en=N_("The printed scores, normaliser and weights of the 'Your journey starts' example."),
        kind="checker",
        reason=N_(
            "every printed number is recomputed by `selfattention check` on the shipped example file "
            "(the worked-example checker), which reports each as ok / within rounding / wrong."
        ),
    ),
    Lesson(
        name="worked-example-003",
        summary=N_("the 2-token hand example"),
        lecture="003",
        section="一个可以完全手算的例子",
        claim_zh="权重(1,1) ≈ 0.670，权重(1,2) ≈ 0.330，输出₁ = [1.340, 0.660]",
        claim_en=N_("The 2-token hand example with W_q = W_k = I, W_v = 2I."),
        kind="checker",
        reason=N_(
            "recomputed number by number by `selfattention check` on the shipped example file; its "
            "variants are the lessons value-scales-output (exercise 1) and set-operation-without-positions "
            "(exercise 3)."
        ),
    ),
    Lesson(
        name="library-analogy",
        summary=N_("Q/K/V as a library search"),
        lecture="003",
        section="二、打个比方：图书馆检索",
        claim_zh="每个词都带着一个“我想找什么”的查询，去和每一个词“贴的标签”做匹配，再按匹配程度把内容加权混合",
        claim_en=N_("Query / key / value are like a search question, index labels and book contents."),
        kind="discussed",
        reason=N_(
            "an analogy, not a claim with a number; the mechanism it explains is measured by every "
            "other lesson."
        ),
    ),
    Lesson(
        name="no-fixed-size-state",
        summary=N_("no fixed-size hidden state"),
        lecture="003",
        section="四、这一讲机制自带的代价 (RNN 瓶颈对照表)",
        claim_zh="每个位置直接拿到全部其他位置的 Value 加权，没有被压缩进一个固定容量的容器",
        claim_en=N_(
            "Unlike an RNN's hidden state, each position reads all value vectors directly; nothing is "
            "squeezed into a fixed-size container."
        ),
        kind="discussed",
        reason=N_(
            "true by construction (the weights have one column per key, the cache grows with T); "
            "its consequences are measured in distance-one-hop (gradient path) and n-squared-bill (the cost)."
        ),
    ),
    Lesson(
        name="needs-data-to-learn-where-to-look",
        summary=N_("learning where to look needs data"),
        lecture="003",
        section="四、这一讲机制自带的代价",
        claim_zh="具体该重点关注谁，完全靠训练从数据里学出来……需要足够多的数据和算力",
        claim_en=N_("Without a locality prior, where to look must be learned, which costs data and compute."),
        kind="discussed",
        reason=N_(
            "a data-efficiency claim needs training runs across data scales (lecture 14–15 material); "
            "the absence of the prior itself is measured in no-locality-prior."
        ),
    ),
    Lesson(
        name="parameter-free-on-edge-devices",
        summary=N_("parameter-free on small devices?"),
        lecture="000",
        section="开放问题 1",
        claim_zh="无参版本计算便宜，在某些低算力场景（移动端 / 边缘）是否仍有价值？",
        claim_en=N_("Open question: is the cheap parameter-free form still useful on low-compute devices?"),
        kind="discussed",
        reason=N_(
            "an open question about real tasks and devices; the lecture says it is unexplored. The "
            "expressiveness gap it mentions is measured in limitations-training."
        ),
    ),
)
