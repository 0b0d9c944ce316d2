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

import html as _html
import json
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..functional import AttentionSteps
from ..i18n import _, language
from ..lectures import lecture_title, name_lectures
from .model import model_report
from .payload import (
    CAVEAT,
    CAVEAT_ZH,
    build_payload,
    decode_array,
    encode_array,
    head_statistics,
    quantise_weights,
    steps_record,
)

__all__ = [
    "CAVEAT",
    "CAVEAT_ZH",
    "decode_array",
    "encode_array",
    "example_report",
    "head_statistics",
    "model_report",
    "quantise_weights",
    "render_html",
    "steps_report",
    "write_report",
]


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
    exact = {"0.0": steps_record(steps, dtype, with_qkv=small)}
    token = min(1, t - 1) if token is None else token
    if not 0 <= token < t:
        raise ValueError(f"token must be in 0..{t - 1}, got {token}")
    return build_payload(
        title=title,
        subtitle=subtitle,
        source="example",
        tokens=tokens,
        shape=(1, 1, t),
        u8=quantise_weights(w[None, None]),
        stats=head_statistics(w[None, None]),
        exact=exact,
        head=(0, 0),
        token=token,
        head_dim=int(steps.query.shape[-1]),
        notes=list(notes),
        facts=[(_("tokens"), str(t)), ("head_dim", str(steps.query.shape[-1])), *facts],
        exact_note="",
    )


def example_report(example: Any) -> dict[str, Any]:
    """The payload for a lecture's worked example (:func:`selfattention.worked.load_example`).

    One layer, one head; every step in float64, with Q, K, V shown in the trace tables.
    """
    steps = example.steps
    simple = getattr(example, "kind", "") == "simple"
    facts = [(_("scale"), f"{steps.scale:.6g}" + (_(" (no 1/√d: lecture 000)") if simple else " = 1/√d_k"))]
    notes = []
    if simple:
        notes.append(
            _(
                "Parameter-free self-attention (lecture 000, {title}): query = key = value = X, scale 1."
            ).format(title=lecture_title("000"))
        )
    display_source = getattr(example, "display_source", None)
    source = name_lectures(display_source() if display_source else getattr(example, "source", ""))
    return steps_report(
        steps,
        example.tokens,
        title=example.display_title(),
        subtitle=_("worked example “{name}”").format(name=example.name) + (f" · {source}" if source else ""),
        token=getattr(example, "focus", None),
        facts=facts,
        notes=notes,
    )


def _asset(name: str) -> str:
    return (resources.files(__package__) / name).read_text(encoding="utf-8")


def render_html(payload: dict[str, Any]) -> str:
    """The report as one HTML string: ``report.html`` with the CSS, the JS and the payload inlined.

    The payload goes into a ``<script type="application/json">`` block with every ``<`` written as
    ``\\u003c``, so no token text can break out of it. Chinese (CJK) characters of the page are drawn
    with an embedded subset of a CJK font (:func:`selfattention.fonts.font_face_css`) when one is
    installed.
    """
    from .labels import labels

    # the page's words in the interface language (a new dict: the caller's payload is not changed)
    payload = {**payload, "lang": language(), "labels": labels()}
    if language() == "zh" and payload.get("caveat_zh"):  # the lecture's own words instead of the English
        payload["caveat"], payload["caveat_zh"] = payload["caveat_zh"], ""
    # "<" only occurs inside JSON strings; as \u003c no token can open or close a tag in the page
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    from ..fonts import font_face_css

    values = {
        # the glyphs of a CJK font that the page's text needs, embedded (no network); "" without CJK text
        "/*__FONT__*/": font_face_css(data + str(payload.get("title", ""))),
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
