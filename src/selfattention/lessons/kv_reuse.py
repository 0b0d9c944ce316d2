"""Lesson ``kv-reuse`` (lecture 003 §5): earlier positions' K, V do not change, so they can be cached.

Measured on a 2-layer stack of random :class:`selfattention.SelfAttention` layers (residual), float64:
the K and V of the first T−1 positions computed with and without a new token appended, with a causal
mask and without one, and the new token's output computed from cached K, V (one query, bottom-right
causal) against the full recomputation. On the bidirectional all-MiniLM-L6-v2 the prefix's keys change
from layer 1 on (layers count from 0) when words are appended.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..functional import scaled_dot_product_attention
from ..i18n import N_, _
from ..modules import SelfAttention
from ._base import FAILS, HOLDS, ONLY_WHEN, Lesson, LessonResult, ResultTable, Verdict

LESSON = Lesson(
    name="kv-reuse",
    summary=N_("past K and V never change: cache"),
    lecture="003",
    section="五、和后面课程的关系 (第 22 讲 KV Cache)",
    claim_zh="生成文字时，之前位置的 K、V 一旦算过就不会变，可以缓存下来避免重复计算",
    claim_en=N_(
        "When generating, the K and V of earlier positions never change once computed, so they can be cached."
    ),
    kind="measured",
    module="kv_reuse",
    needs_model=True,
)

TOLERANCE = 1e-12


def stack_kv(
    layers: list[SelfAttention], x: torch.Tensor, causal: bool
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """K, V of every layer ([(T, 2d)] per layer: K and V side by side) and the output, x (T, d)."""
    kvs = []
    for layer in layers:
        q, k, v = layer.W_query(x), layer.W_key(x), layer.W_value(x)
        kvs.append(torch.cat([k, v], dim=-1))
        x = x + scaled_dot_product_attention(q, k, v, is_causal=causal)
    return kvs, x


def verdict(m: dict[str, Any]) -> Verdict:
    """Pure: ``causal_prefix_change`` (max change of the prefix K/V when a token is appended, causal),
    ``cached_output_error`` (cached vs full output), ``bidirectional_prefix_change``."""
    c, e, b = m["causal_prefix_change"], m["cached_output_error"], m["bidirectional_prefix_change"]
    if c > TOLERANCE or e > TOLERANCE:
        return Verdict(
            FAILS, _("causal: prefix K/V changed by {c:.3g}, cached output off by {e:.3g}").format(c=c, e=e)
        )
    if b <= TOLERANCE:
        return Verdict(HOLDS, _("prefix K/V unchanged with and without a causal mask"))
    return Verdict(
        ONLY_WHEN,
        _(
            "causal: prefix K/V change {c:.0e}, cached output error {e:.0e}; bidirectional: prefix K/V of layer 1 change by {b:.2f}"
        ).format(c=c, e=e, b=b),
        condition=_(
            "attention is causal (a decoder); in a bidirectional encoder later tokens change earlier K/V from layer 1 on (0-based)"
        ),
    )


def run(
    out_dir: Path | None = None,
    progress: Any = None,
    *,
    T: int = 12,
    d: int = 16,
    use_model: bool = True,
    seed: int = 0,
) -> LessonResult:
    torch.manual_seed(seed)
    layers = [SelfAttention(d, d).double() for _ in range(2)]
    x = torch.randn(T, d, dtype=torch.float64)
    rows = []
    m: dict[str, Any] = {}
    with torch.no_grad():
        for causal in (True, False):
            kv_full, out_full = stack_kv(layers, x, causal)
            kv_prefix, _out = stack_kv(layers, x[:-1], causal)
            per_layer = [(a[:-1] - b).abs().max().item() for a, b in zip(kv_full, kv_prefix, strict=True)]
            key = "causal_prefix_change" if causal else "bidirectional_prefix_change"
            m[key] = max(per_layer)
            rows.append([_("causal") if causal else _("bidirectional"), *(f"{v:.1e}" for v in per_layer)])
            if causal:
                # decode the last token from the cache: one query against all T cached keys
                h, err = x, 0.0
                for layer, kv in zip(layers, kv_full, strict=True):
                    q_new = layer.W_query(h[-1:])
                    k_cache, v_cache = kv[:, :d], kv[:, d:]
                    step = h[-1:] + scaled_dot_product_attention(q_new, k_cache, v_cache, is_causal=True)
                    h = torch.cat([h[:-1], step])  # only the last row is used by the next layer's query
                err = (h[-1] - out_full[-1]).abs().max().item()
                m["cached_output_error"] = err
    tables = [
        ResultTable(
            _(
                "2 random SelfAttention layers, T = {T}: max change of the first T−1 positions' K, V when token T is appended"
            ).format(T=T),
            [_("attention"), _("layer 0"), _("layer 1")],
            rows,
        ),
        ResultTable(
            _("the new token from cached K, V (Tq = 1, bottom-right causal) vs full recomputation"),
            [_("quantity"), _("value")],
            [
                [
                    _("max |cached − full|"),
                    f"{m['cached_output_error']:.1e}",
                ]
            ],
        ),
    ]
    if use_model:
        from ..pretrained import run_text

        short, long = (
            run_text("The cat sat", compare=False),
            run_text("The cat sat on the mat.", compare=False),
        )
        n = len(short.tokens) - 1  # shared prefix: [CLS] the cat sat
        change = (long.keys[:, :, :n] - short.keys[:, :, :n]).abs().amax(dim=(1, 2, 3))  # per layer
        m["model_key_change"] = change.tolist()
        tables.append(
            ResultTable(
                _("MiniLM (bidirectional): keys of '[CLS] the cat sat' alone vs followed by 'on the mat.'"),
                [_("layer"), _("max |ΔK|")],
                [[i, f"{v:.2e}"] for i, v in enumerate(change.tolist())],
            )
        )
    return LessonResult(
        LESSON,
        m,
        verdict(m),
        tables=tables,
        notes=[
            _(
                "Layers count from 0. Layer 0's K and V are x·W of the inputs and never change; from layer 1 on "
                "they depend on "
                "attention outputs, which only a causal mask keeps independent of later tokens."
            )
        ],
    )
