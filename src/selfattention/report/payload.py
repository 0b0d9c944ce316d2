"""The report's payload pieces: array encodings, 8-bit weights, per-head statistics, the payload dict.

Shared by the worked-example reports (:mod:`selfattention.report`) and the model reports
(:mod:`selfattention.report.model`).
"""

from __future__ import annotations

import base64
import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..functional import AttentionSteps

__all__ = [
    "CAVEAT",
    "CAVEAT_ZH",
    "decode_array",
    "encode_array",
    "head_statistics",
    "quantise_weights",
]

CAVEAT = (
    "Attention weights are not by themselves an explanation of the model's reasoning. Lecture 003 §5 "
    "(looking ahead to lecture 31 on interpretability) warns that softmax weights are often read as "
    "evidence of “what the model is paying attention to”, and that this reading is disputed: a weight "
    "says how much of a token's value vector one head mixes into one position in one layer — the values "
    "themselves, the other heads, the residual stream and the feed-forward layers all shape what the "
    "model computes."
)
CAVEAT_ZH = "不能想当然地把注意力权重等同于“模型的推理过程”。（第 3 讲 §5 → 第 31 讲）"

_DTYPES = {"f32": np.dtype("<f4"), "f64": np.dtype("<f8"), "u8": np.dtype("u1"), "i32": np.dtype("<i4")}
_FORMAT_VERSION = 1


def encode_array(
    a: torch.Tensor | np.ndarray, dtype: str = "f32", deflate: bool | None = None
) -> dict[str, Any]:
    """An array as ``{"dtype", "shape", "deflate", "b64"}``: little-endian bytes, optionally zlib, base64.

    ``dtype`` is ``"f32"``, ``"f64"``, ``"u8"`` or ``"i32"``. ``deflate=None`` compresses only ``u8`` data (8-bit
    attention maps shrink ~2×; float weights only ~10%, not worth an asynchronous decode in the page,
    which uses ``DecompressionStream``).

    >>> e = encode_array(np.array([[0.5, 0.25]]), "f32")
    >>> e["dtype"], e["shape"], decode_array(e).tolist()
    ('f32', [1, 2], [[0.5, 0.25]])
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(a), dtype=_DTYPES[dtype])
    raw = arr.tobytes()
    if deflate is None:
        deflate = dtype == "u8"
    if deflate:
        raw = zlib.compress(raw, 1)  # level 1: 5× faster than 6, ~8% larger
    return {
        "dtype": dtype,
        "shape": list(arr.shape),
        "deflate": deflate,
        "b64": base64.b64encode(raw).decode(),
    }


def decode_array(enc: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`encode_array` (for tests and for reading a report back)."""
    raw = base64.b64decode(enc["b64"])
    if enc.get("deflate"):
        raw = zlib.decompress(raw)
    return np.frombuffer(raw, dtype=_DTYPES[enc["dtype"]]).reshape(enc["shape"])


def quantise_weights(weights: torch.Tensor) -> np.ndarray:
    """Weights in [0, 1] → uint8 on a square-root scale: ``q = round(255·√w)``; ``w ≈ (q/255)²``.

    The square root spreads the many small weights of a long text over the colour scale.

    >>> quantise_weights(torch.tensor([0.0, 0.25, 1.0])).tolist()
    [0, 128, 255]
    """
    w = weights.detach().cpu()
    w = w.double() if w.dtype == torch.float64 else w.float()  # float32 data: quantise in float32
    w = w.nan_to_num(0.0).clamp(0.0, 1.0)
    return torch.round(255.0 * w.sqrt()).to(torch.uint8).numpy()


def head_statistics(weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-head summaries of attention weights ``(..., T, T)`` (rows = queries, summing to 1).

    Returns float64 tensors of shape ``(...)``:

    * ``entropy`` — mean over query rows of −Σⱼ wᵢⱼ log₂ wᵢⱼ, in bits (0 = every query looks at one
      token; log₂ T = uniform);
    * ``self`` — mean over rows of wᵢᵢ, the share of weight a token puts on itself;
    * ``first`` — mean of wᵢ₀, the share on the first token (``[CLS]`` for the model);
    * ``last`` — mean of wᵢ,T−1, the share on the last token (``[SEP]`` for the model).

    >>> s = head_statistics(torch.tensor([[1.0, 0.0], [0.5, 0.5]]))
    >>> [round(float(s[k]), 4) for k in ("entropy", "self", "first", "last")]
    [0.5, 0.75, 0.75, 0.25]
    """
    w = torch.as_tensor(weights).detach().to("cpu", torch.float64)
    if w.dim() < 2 or w.shape[-1] != w.shape[-2] or w.shape[-1] == 0:
        raise ValueError(f"weights must be (..., T, T) with T >= 1, got shape {tuple(w.shape)}")
    nats = -torch.special.xlogy(w, w).sum(-1)  # xlogy(0, 0) = 0: a zero weight adds nothing
    return {
        "entropy": (nats / math.log(2.0)).mean(-1),
        "self": w.diagonal(dim1=-2, dim2=-1).mean(-1),
        "first": w[..., :, 0].mean(-1),
        "last": w[..., :, -1].mean(-1),
    }


def _round_list(t: torch.Tensor, digits: int = 6) -> list:
    def r(x: float) -> float:
        return float(f"{x:.{digits}g}")

    return [_round_list(row, digits) for row in t] if t.dim() > 1 else [r(float(x)) for x in t]


def steps_record(steps: AttentionSteps, dtype: str, with_qkv: bool) -> dict[str, Any]:
    rec = {
        "scores": encode_array(steps.scores, dtype),
        "scaled": encode_array(steps.scaled_scores, dtype),
        "weights": encode_array(steps.weights, dtype),
        "context": encode_array(steps.context, dtype),
        "scale": float(steps.scale),
    }
    if with_qkv:
        rec.update(
            query=encode_array(steps.query, dtype),
            key=encode_array(steps.key, dtype),
            value=encode_array(steps.value, dtype),
        )
    return rec


def exact_bytes(t: int, d: int, dv: int, itemsize: int, with_qkv: bool) -> int:
    return itemsize * (3 * t * t + t * dv + (t * (2 * d + dv) if with_qkv else 0))


def build_payload(
    *,
    title: str,
    subtitle: str,
    source: str,
    tokens: Sequence[str],
    shape: tuple[int, int, int],
    u8: np.ndarray,
    stats: dict[str, torch.Tensor],
    exact: dict[str, Any],
    head: tuple[int, int],
    token: int,
    head_dim: int,
    notes: list[str],
    facts: list[tuple[str, str]],
    exact_note: str,
    u8_heads: list[str] | None = None,
    topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    special: Sequence[bool] | None = None,
) -> dict[str, Any]:
    """The JSON-able payload. ``shape`` is (layers, heads, T); ``u8`` holds the 8-bit weights of every
    head in order, or only of the heads named in ``u8_heads`` ("layer.head", in that order); ``topk``
    (indices, weights), each (L, H, T, k), is each query's heaviest keys (for heads without a matrix)."""
    n_layers, n_heads, t = shape
    payload = {
        "format": _FORMAT_VERSION,
        "title": title,
        "subtitle": subtitle,
        "source": source,
        "tokens": [str(s) for s in tokens],
        "n_tokens": t,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "head_dim": head_dim,
        "weights_u8": encode_array(u8, "u8"),
        "exact": exact,
        "exact_note": exact_note,
        "stats": {k: _round_list(v) for k, v in stats.items()},
        "initial": {"layer": head[0], "head": head[1], "token": token},
        "facts": [list(f) for f in facts],
        "notes": notes,
        "caveat": CAVEAT,
        "caveat_zh": CAVEAT_ZH,
    }
    if u8_heads is not None:
        payload["u8_heads"] = list(u8_heads)
    if topk is not None:
        payload["topk"] = {"indices": encode_array(topk[0], "i32"), "weights": encode_array(topk[1], "f32")}
    if special is not None:
        payload["special"] = [bool(x) for x in special]
    return payload
