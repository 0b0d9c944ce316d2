"""Lesson ``set-operation-without-positions`` (lecture 003, exercise 3): without positions,
self-attention is a set operation.

Swap the inputs and the outputs swap, each value unchanged: f(P X) = P f(X) for every permutation P.
Measured on the lecture's 2-token example (W_q = W_k = I, W_v = 2I), on a random SelfAttention layer,
and on the real model: "dog bites man" vs "man bites dog" through all-MiniLM-L6-v2 with its position
embeddings, and with them set to zero (the same multiset of output vectors, permuted). A causal mask is
a positional signal too: with it the equivariance breaks.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..functional import scaled_dot_product_attention
from ..i18n import N_, _
from ..modules import SelfAttention
from ._base import FAILS, HOLDS, ONLY_WHEN, Lesson, LessonResult, ResultTable, Verdict

LESSON = Lesson(
    name="set-operation-without-positions",
    summary=N_("no positions: order doesn't count"),
    lecture="003",
    section="形式化验证：没有位置编码，自注意力真的是一个集合操作；思考题 3",
    claim_zh="调换输入顺序只会调换输出的顺序标签，每个位置各自算出的内容完全不变……无法区分“狗咬人”和“人咬狗”",
    claim_en=N_(
        "Exercise 3: without position information, permuting the inputs permutes the outputs and "
        "changes nothing else, so 'dog bites man' and 'man bites dog' give the same set of vectors."
    ),
    kind="exercise",
    module="set_operation",
    needs_model=True,
)

TOLERANCE = 1e-12  # float64 toy cases
MODEL_TOLERANCE = 1e-4  # float32 through 6 layers
SENTENCES = ("dog bites man", "man bites dog")


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``toy_error`` / ``random_error`` (float64, no mask), ``causal_error`` (with a causal mask);
    optional ``model_nopos_error`` and ``model_pos_error`` (max |h₁ − P h₂| over tokens, float32)."""
    if m["toy_error"] > TOLERANCE or m["random_error"] > TOLERANCE:
        return Verdict(
            FAILS,
            _("permuting inputs changed outputs by {max:.3g}").format(
                max=max(m["toy_error"], m["random_error"])
            ),
        )
    if m.get("model_nopos_error", 0.0) > MODEL_TOLERANCE:
        return Verdict(
            FAILS,
            _("MiniLM without positions: outputs differ by {model_nopos_error:.3g}").format(
                model_nopos_error=m["model_nopos_error"]
            ),
        )
    broken = m["causal_error"] > TOLERANCE and m.get("model_pos_error", 1.0) > MODEL_TOLERANCE
    if not broken:
        return Verdict(HOLDS, _("equivariant even with a causal mask / position embeddings"))
    parts = [
        _("|f(PX) − P f(X)| = {toy_error:.0e} (2 tokens), {random_error:.0e} (random)").format(
            toy_error=m["toy_error"], random_error=m["random_error"]
        )
    ]
    if "model_nopos_error" in m:
        parts.append(
            _("MiniLM {model_nopos_error:.1e} without positions vs {model_pos_error:.2f} with them").format(
                model_nopos_error=m["model_nopos_error"], model_pos_error=m["model_pos_error"]
            )
        )
    parts.append(_("{causal_error:.2f} with a causal mask").format(causal_error=m["causal_error"]))
    return Verdict(
        ONLY_WHEN,
        "; ".join(parts),
        condition=_("no position information enters (no position embeddings, no causal mask)"),
    )


@contextmanager
def without_positions(model: Any) -> Any:
    """Temporarily zero the model's position embeddings (restored on exit)."""
    weight = model.embeddings.position_embeddings.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.zero_()
    try:
        yield model
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def _model_part(m: dict[str, Any], tables: list[ResultTable]) -> None:
    from ..pretrained import load_model

    model, tok = load_model()
    enc = [tok(s, return_tensors="pt") for s in SENTENCES]
    t1 = tok.convert_ids_to_tokens(enc[0].input_ids[0].tolist())
    t2 = tok.convert_ids_to_tokens(enc[1].input_ids[0].tolist())
    perm = [t2.index(t) for t in t1]  # position in sentence 2 of each token of sentence 1
    rows = []
    for label, ctx in (
        (_("with position embeddings"), None),
        (_("position embeddings = 0"), without_positions),
    ):
        with torch.no_grad():
            if ctx is None:
                h = [model(**e).last_hidden_state[0] for e in enc]
            else:
                with ctx(model):
                    h = [model(**e).last_hidden_state[0] for e in enc]
        err = (h[0] - h[1][perm]).abs().max().item()
        cos = torch.nn.functional.cosine_similarity(h[0], h[1][perm], dim=-1)
        pooled = torch.nn.functional.cosine_similarity(h[0].mean(0), h[1].mean(0), dim=0).item()
        key = "model_pos_error" if ctx is None else "model_nopos_error"
        m[key] = err
        m[key.replace("error", "dog_cos")] = cos[t1.index("dog")].item()
        rows.append(
            [
                label,
                f"{err:.2e}",
                f"{cos[t1.index('dog')]:.6f}",
                f"{cos[t1.index('man')]:.6f}",
                f"{pooled:.6f}",
            ]
        )
    tables.append(
        ResultTable(
            _("MiniLM last layer: “{SENTENCES_0}” vs “{SENTENCES_1}” (tokens matched by word)").format(
                SENTENCES_0=SENTENCES[0], SENTENCES_1=SENTENCES[1]
            ),
            [_("model"), _("max |h₁ − P h₂|"), _("cos(dog, dog)"), _("cos(man, man)"), _("cos(mean-pooled)")],
            rows,
        )
    )


def run(
    out_dir: Path | None = None,
    progress: Any = None,
    *,
    T: int = 7,
    d: int = 59,
    use_model: bool = True,
    seed: int = 0,
) -> LessonResult:
    # the lecture's 2-token example, then swapped
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    out = scaled_dot_product_attention(x, x, 2 * x)
    xs = x.flip(0)
    out_s = scaled_dot_product_attention(xs, xs, 2 * xs)
    toy = (out_s - out.flip(0)).abs().max().item()

    torch.manual_seed(seed)
    layer = SelfAttention(d, 16).double()
    xr = torch.randn(T, d, dtype=torch.float64)
    p = torch.randperm(T)
    with torch.no_grad():
        rand_err = (layer(xr[p]) - layer(xr)[p]).abs().max().item()
        causal_err = (layer(xr[p], is_causal=True) - layer(xr, is_causal=True)[p]).abs().max().item()
    m: dict[str, Any] = {"toy_error": toy, "random_error": rand_err, "causal_error": causal_err}
    tables = [
        ResultTable(
            _("lecture 003 hand example, inputs swapped"),
            [_("order"), _("output position 1"), _("output position 2")],
            [
                ["x₁, x₂", f"[{out[0, 0]:.3f}, {out[0, 1]:.3f}]", f"[{out[1, 0]:.3f}, {out[1, 1]:.3f}]"],
                [
                    "x₂, x₁",
                    f"[{out_s[0, 0]:.3f}, {out_s[0, 1]:.3f}]",
                    f"[{out_s[1, 0]:.3f}, {out_s[1, 1]:.3f}]",
                ],
            ],
        ),
        ResultTable(
            _("random SelfAttention({d}, 16), T = {T}, random permutation P (float64)").format(d=d, T=T),
            [_("case"), _("max |f(PX) − P f(X)|")],
            [
                [_("2-token example"), f"{toy:.1e}"],
                [_("no mask"), f"{rand_err:.1e}"],
                [_("causal mask"), f"{causal_err:.3f}"],
            ],
        ),
    ]
    if use_model:
        _model_part(m, tables)
    return LessonResult(
        LESSON,
        m,
        verdict(m),
        tables=tables,
        notes=[
            _(
                "Zeroing the position embeddings leaves only token identity; MiniLM then cannot tell the "
                "two sentences apart beyond a relabelling of positions."
            )
        ],
    )
