"""The self-contained HTML attention report: one file, no network, opens from disk.

A report is built in two steps: a *payload* (a JSON-able ``dict``: tokens, every head's weights, the
exact trace of some heads, per-head statistics) from a model run or a worked example, then
:func:`render_html`, which inlines the payload, ``report.js`` and ``report.css`` (package data next to
this file) into ``report.html``. Nothing is loaded from a CDN; the page draws on ``<canvas>``, one
pixel block per cell, so 512 tokens × 72 heads stay responsive.

How the numbers are stored (sizes matter: 512 tokens × 72 heads are 18.9 million weights):

* ``weights_u8`` — every head's weights, quantised to 8 bits on a square-root scale
  (``q = round(255·√w)``, so ``w ≈ (q/255)²``), zlib-deflated, base64. Only for colours and for the
  approximate value shown for heads whose exact values are not stored.
* ``exact`` — for some heads (all of them when they fit in ``exact_budget_mb``, else the selected head
  and its neighbours), the trace of lecture 003 §3 exactly as :func:`selfattention.functional.attention_steps`
  computed it, as float32 (float64 for the worked examples): scores Q Kᵀ, scaled scores, weights,
  context vectors (and Q, K, V when the head is small). The page shows these numbers unrounded on hover.
* ``stats`` — per-head entropy (bits), share of weight on self, on the first and on the last token
  (:func:`head_statistics`), rounded to 6 significant digits.

The page's caveat is the lecture's (003 §5, pointing to lecture 31): attention weights are not by
themselves an explanation of the model's reasoning.

>>> import torch
>>> from selfattention.functional import attention_steps
>>> q = k = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
>>> payload = steps_report(attention_steps(q, k, 2 * k), ["x1", "x2"], title="lecture 003")
>>> payload["n_tokens"], payload["n_layers"], payload["n_heads"]
(2, 1, 1)
>>> [[round(float(x), 4) for x in row] for row in decode_array(payload["exact"]["0.0"]["weights"])]
[[0.6698, 0.3302], [0.3302, 0.6698]]
>>> html = render_html(payload)
>>> html.startswith("<!DOCTYPE html>") and "http://" not in html and "https://" not in html
True
"""

from __future__ import annotations

import base64
import html as _html
import json
import math
import re
import zlib
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..functional import AttentionSteps, attention_steps

__all__ = [
    "CAVEAT",
    "decode_array",
    "encode_array",
    "example_report",
    "head_statistics",
    "model_report",
    "render_html",
    "steps_report",
    "write_report",
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

_DTYPES = {"f32": np.dtype("<f4"), "f64": np.dtype("<f8"), "u8": np.dtype("u1")}
_FORMAT_VERSION = 1


def encode_array(
    a: torch.Tensor | np.ndarray, dtype: str = "f32", deflate: bool | None = None
) -> dict[str, Any]:
    """An array as ``{"dtype", "shape", "deflate", "b64"}``: little-endian bytes, optionally zlib, base64.

    ``dtype`` is ``"f32"``, ``"f64"`` or ``"u8"``. ``deflate=None`` compresses only ``u8`` data (8-bit
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


def _steps_record(steps: AttentionSteps, dtype: str, with_qkv: bool) -> dict[str, Any]:
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


def _exact_bytes(t: int, d: int, dv: int, itemsize: int, with_qkv: bool) -> int:
    return itemsize * (3 * t * t + t * dv + (t * (2 * d + dv) if with_qkv else 0))


def _payload(
    *,
    title: str,
    subtitle: str,
    source: str,
    tokens: Sequence[str],
    weights: torch.Tensor,
    exact: dict[str, Any],
    head: tuple[int, int],
    token: int,
    head_dim: int,
    notes: list[str],
    facts: list[tuple[str, str]],
    exact_note: str,
    stats: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    n_layers, n_heads, t, _ = weights.shape
    if stats is None:
        stats = head_statistics(weights)
    return {
        "format": _FORMAT_VERSION,
        "title": title,
        "subtitle": subtitle,
        "source": source,
        "tokens": [str(s) for s in tokens],
        "n_tokens": t,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "head_dim": head_dim,
        "weights_u8": encode_array(quantise_weights(weights), "u8"),
        "exact": exact,
        "exact_note": exact_note,
        "stats": {k: _round_list(v) for k, v in stats.items()},
        "initial": {"layer": head[0], "head": head[1], "token": token},
        "facts": [list(f) for f in facts],
        "notes": notes,
        "caveat": CAVEAT,
        "caveat_zh": CAVEAT_ZH,
    }


def steps_report(
    steps: AttentionSteps,
    tokens: Sequence[str],
    *,
    title: str,
    subtitle: str = "",
    token: int | None = None,
    facts: Sequence[tuple[str, str]] = (),
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """The payload for one attention call of one head: ``steps`` with 2-D tensors (T, ·).

    float64 steps are stored as float64 (the page shows the library's numbers unrounded).

    Raises:
        ValueError: ``steps.weights`` is not (T, T) or ``tokens`` does not have T entries.
    """
    w = steps.weights
    if w.dim() != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"steps.weights must be (T, T) for one head, got shape {tuple(w.shape)}")
    t = w.shape[0]
    if len(tokens) != t:
        raise ValueError(f"tokens has {len(tokens)} entries but the weights are {t} × {t}")
    dtype = "f64" if w.dtype == torch.float64 else "f32"
    small = steps.query.shape[-1] <= 8 and steps.value.shape[-1] <= 8
    exact = {"0.0": _steps_record(steps, dtype, with_qkv=small)}
    token = min(1, t - 1) if token is None else token
    if not 0 <= token < t:
        raise ValueError(f"token must be in 0..{t - 1}, got {token}")
    return _payload(
        title=title,
        subtitle=subtitle,
        source="example",
        tokens=tokens,
        weights=w[None, None],
        exact=exact,
        head=(0, 0),
        token=token,
        head_dim=int(steps.query.shape[-1]),
        notes=list(notes),
        facts=[("tokens", str(t)), ("head_dim", str(steps.query.shape[-1])), *facts],
        exact_note="",
    )


def example_report(example: Any) -> dict[str, Any]:
    """The payload for a lecture's worked example (:func:`selfattention.worked.load_example`).

    One layer, one head; every step in float64, with Q, K, V shown in the trace tables.
    """
    steps = example.steps
    simple = getattr(example, "kind", "") == "simple"
    facts = [("scale", f"{steps.scale:.6g}" + (" (no 1/√d: lecture 000)" if simple else " = 1/√d_k"))]
    notes = []
    if simple:
        notes.append("Parameter-free self-attention (lecture 000): query = key = value = X, scale 1.")
    source = getattr(example, "source", "")
    return steps_report(
        steps,
        example.tokens,
        title=example.title,
        subtitle=f"worked example “{example.name}”" + (f" · {source}" if source else ""),
        token=getattr(example, "focus", None),
        facts=facts,
        notes=notes,
    )


def _default_head(s: dict[str, torch.Tensor], n_heads: int) -> tuple[int, int]:
    """A head worth opening on: the most focused (lowest mean entropy) among heads that put less than
    half their weight on the first and last token and are not one-token pointers (entropy ≥ 1 bit);
    without such a head, the one with the least weight on the first and last token."""
    sink = s["first"] + s["last"]
    ok = (sink < 0.5) & (s["entropy"] >= 1.0)
    if bool(ok.any()):
        idx = int(torch.argmin(torch.where(ok, s["entropy"], torch.full_like(sink, math.inf)).flatten()))
    else:
        idx = int(torch.argmin(sink.flatten()))
    return divmod(idx, n_heads)


def model_report(
    run: Any,
    *,
    head: tuple[int, int] | None = None,
    token: int | None = None,
    exact_budget_mb: float = 8.0,
    title: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The payload for a real-model run (:func:`selfattention.pretrained.run_text`).

    Args:
        run: a ``ModelRun`` (``tokens``, ``attentions`` (L, H, T, T), ``queries``/``keys``/``values``
            (L, H, T, D); optional ``max_abs_diff_weights``, ``truncated``, ``n_tokens_full``, ``text``).
        head: ``(layer, head)``, 0-based, selected when the page opens and always stored exactly.
            ``None``: the most focused head (lowest mean entropy, at least 1 bit) among those that put
            less than half their weight on ``[CLS]`` and ``[SEP]``.
        token: the query token selected when the page opens (default 1, the first word).
        exact_budget_mb: raw bytes allowed for exact traces. The trace of a head costs
            4·(3T² + T·D) bytes (3.3 MB at T = 512); heads are added nearest-first to the selected one
            (same layer, then neighbouring layers) until the budget is spent; the selected head always is.
        title: page title (default: the start of the text).
        progress: called with a short message before each slow step.

    Each stored trace is :func:`selfattention.functional.attention_steps` on that head's Q, K, V (no
    mask: one unpadded text). Its weights are checked against ``run.attentions``; the largest difference
    is written on the page.

    Raises:
        ValueError: shapes disagree, or ``head``/``token`` out of range.
    """
    say = progress or (lambda _msg: None)
    w = torch.as_tensor(run.attentions).detach().float()
    if w.dim() != 4 or w.shape[-1] != w.shape[-2]:
        raise ValueError(f"run.attentions must be (L, H, T, T), got shape {tuple(w.shape)}")
    n_layers, n_heads, t, _ = w.shape
    tokens = list(run.tokens)
    if len(tokens) != t:
        raise ValueError(f"run.tokens has {len(tokens)} entries but attentions are for T = {t}")
    q, k, v = (torch.as_tensor(x).detach() for x in (run.queries, run.keys, run.values))
    if q.shape[:3] != (n_layers, n_heads, t):
        raise ValueError(
            f"run.queries must be (L, H, T, D) = ({n_layers}, {n_heads}, {t}, D), got {tuple(q.shape)}"
        )
    say("per-head statistics")
    stats = head_statistics(w)
    if head is None:
        head = _default_head(stats, n_heads)
    layer0, head0 = head
    if not (0 <= layer0 < n_layers and 0 <= head0 < n_heads):
        raise ValueError(f"head must be (layer, head) in 0..{n_layers - 1}, 0..{n_heads - 1}, got {head}")
    if token is None:
        token = min(1, t - 1)
    if not 0 <= token < t:
        raise ValueError(f"token must be in 0..{t - 1}, got {token}")

    d, dv = q.shape[-1], v.shape[-1]
    per_head = _exact_bytes(t, d, dv, 4, with_qkv=False)
    order = sorted(
        ((la, h) for la in range(n_layers) for h in range(n_heads)),
        key=lambda lh: (lh != (layer0, head0), abs(lh[0] - layer0), lh[0], abs(lh[1] - head0), lh[1]),
    )
    n_exact = max(1, min(len(order), int(exact_budget_mb * 1e6 // per_head)))
    chosen = order[:n_exact]
    say(f"tracing {n_exact} of {n_layers * n_heads} heads exactly (attention_steps)")
    exact: dict[str, Any] = {}
    worst = 0.0
    for la, h in chosen:
        steps = attention_steps(q[la, h].float(), k[la, h].float(), v[la, h].float())
        worst = max(worst, float((steps.weights - w[la, h]).abs().max()))
        exact[f"{la}.{h}"] = _steps_record(steps, "f32", with_qkv=False)
    if n_exact == len(order):
        exact_note = ""
    else:
        exact_note = (
            f"Exact values and traces are stored for {n_exact} of {len(order)} heads "
            f"(a trace at T = {t} costs {per_head / 1e6:.1f} MB); other heads show 8-bit colour values. "
            "Choose the head with --head LAYER.HEAD, or raise --exact-mb."
        )

    facts = [
        ("model", "all-MiniLM-L6-v2"),
        ("tokens", str(t)),
        ("layers × heads", f"{n_layers} × {n_heads}"),
        ("head_dim", str(d)),
        ("scale", f"1/√{d} = {1 / math.sqrt(d):.6g}"),
    ]
    notes = []
    diff = getattr(run, "max_abs_diff_weights", None)
    if diff is not None:
        facts.append(("vs transformers eager", f"max |Δw| = {diff:.2g}"))
        notes.append(
            f"The model ran on this library's attention; transformers' own eager attention on the same text "
            f"gives weights within {diff:.2g}."
        )
    notes.append(
        f"Traces recomputed with attention_steps on each head's Q, K, V match the model run's weights within "
        f"{worst:.2g}."
    )
    if getattr(run, "truncated", False):
        full = getattr(run, "n_tokens_full", 0)
        notes.append(f"The text was cut to its first {t} tokens" + (f" (of {full})." if full else "."))
    text = str(getattr(run, "text", "") or " ".join(tokens))
    if title is None:
        title = text if len(text) <= 80 else text[:77].rstrip() + "…"
    say("encoding weights")
    return _payload(
        title=title,
        subtitle="all-MiniLM-L6-v2 on selfattention's attention",
        source="model",
        tokens=tokens,
        weights=w,
        exact=exact,
        head=(layer0, head0),
        token=token,
        head_dim=int(d),
        notes=notes,
        facts=facts,
        exact_note=exact_note,
        stats=stats,
    )


def _asset(name: str) -> str:
    return (resources.files(__package__) / name).read_text(encoding="utf-8")


def render_html(payload: dict[str, Any]) -> str:
    """The report as one HTML string: ``report.html`` with the CSS, the JS and the payload inlined.

    The payload goes into a ``<script type="application/json">`` block with every ``<`` written as
    ``\\u003c``, so no token text can break out of it.
    """
    # "<" only occurs inside JSON strings; as \u003c no token can open or close a tag in the page
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    values = {
        "/*__CSS__*/": _asset("report.css"),
        "/*__JS__*/": _asset("report.js").replace("</script", "<\\/script"),
        "__TITLE__": _html.escape(str(payload.get("title", "attention report"))),
        "__DATA__": data,
    }
    page = _asset("report.html")
    for marker in values:
        if page.count(marker) != 1:
            raise RuntimeError(f"report.html must hold the marker {marker} exactly once")
    # one pass, so text inserted for one marker is never searched for another
    page = re.sub("|".join(re.escape(m) for m in values), lambda m: values[m.group(0)], page)
    return page


def write_report(payload: dict[str, Any], path: str | Path) -> int:
    """Render ``payload`` and write it to ``path`` (UTF-8). Returns the file size in bytes."""
    data = render_html(payload).encode("utf-8")
    p = Path(path)
    p.write_bytes(data)
    return len(data)
