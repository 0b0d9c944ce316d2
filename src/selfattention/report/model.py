"""The report of a real model run (:func:`selfattention.pretrained.run_text`): any encoder or decoder.

Two ways to fill the page, chosen by what the run kept:

* **Matrices** (``run.attentions`` is a tensor: short inputs). Every head's weights go to the page as
  8-bit colours; statistics are exact (:func:`~selfattention.report.payload.head_statistics`); the exact
  traces are the run's own steps (``run.traces``: what the model really computed, masks included), for
  as many heads as ``exact_budget_mb`` allows — nothing is recomputed.
* **Statistics** (``run.attentions`` is None: inputs too long for L × H × T² numbers). Per-head
  statistics come from the tiled path (:func:`selfattention.tiled.tiled_attention_with_stats`, O(T)
  memory): entropy, the weight on the first and last token (from the column sums), on self (from the
  log-sum-exp), and each query's ``top_k`` heaviest keys. Only the heads given an exact trace (the
  opening head and its neighbours, within the budget) get a matrix, computed head by head from what
  the attention received (``run.calls``).

The page opens on the head and query token chosen by :func:`selfattention.focus.strongest_link` (the
strongest long-range link between two words), unless ``head``/``token`` are given.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import torch

from ..focus import fallback_token, strongest_link, strongest_link_topk
from ..functional import AttentionSteps, attention_steps
from ..i18n import _
from ..pretrained import MATCH_TOLERANCE
from .payload import build_payload, exact_bytes, head_statistics, quantise_weights, steps_record

__all__ = ["model_report"]

_SPECIAL = re.compile(r"^(\[(CLS|SEP|PAD|UNK|MASK)\]|<[^<>\s]*>|<\|[^|]*\|>)$")
_FIELDS = tuple(f.name for f in fields(AttentionSteps) if f.name != "scale")  # the per-head tensors


def _fallback_head(s: dict[str, torch.Tensor], n_heads: int) -> tuple[int, int]:
    """Without a link between two words: the most focused head (lowest mean entropy, at least 1 bit)
    among those with less than half their weight on the first and last token; else the one with the
    least weight there."""
    sink = s["first"] + s["last"]
    ok = (sink < 0.5) & (s["entropy"] >= 1.0)
    if bool(ok.any()):
        idx = int(torch.argmin(torch.where(ok, s["entropy"], torch.full_like(sink, math.inf)).flatten()))
    else:
        idx = int(torch.argmin(sink.flatten()))
    return divmod(idx, n_heads)


def _link_in_head(
    w: torch.Tensor | None,
    topk: tuple[torch.Tensor, torch.Tensor] | None,
    layer: int,
    head: int,
    tokens: Sequence[str],
    special: Sequence[bool],
) -> Any:
    """The strongest link between two words inside one head (its query is the token to open on)."""
    if w is not None:
        return strongest_link(w[layer, head][None, None], tokens, special)
    assert topk is not None
    return strongest_link_topk(
        topk[0][layer, head][None, None], topk[1][layer, head][None, None], tokens, special
    )


def _head_steps(run: Any, layer: int, head: int) -> AttentionSteps:
    """The steps of one head, (T, ·): the run's own trace when it has one, else computed from the call."""
    traces = getattr(run, "traces", None) or []
    if traces:
        steps = traces[layer].steps
        return AttentionSteps(**{f: getattr(steps, f)[0, head] for f in _FIELDS}, scale=steps.scale)
    calls = getattr(run, "calls", None) or []
    if calls:
        call = calls[layer]
        group = call.query.shape[-3] // call.key.shape[-3]
        kv = slice(head // group, head // group + 1)
        mask = call.attn_mask
        if mask is not None and mask.dim() >= 3 and mask.shape[-3] > 1:
            mask = mask[..., head : head + 1, :, :]
        steps = attention_steps(
            call.query[:, head : head + 1],
            call.key[:, kv],
            call.value[:, kv],
            attn_mask=mask,
            is_causal=call.is_causal,
            scale=call.scale,
            training=False,
        )
        n = call.n_keys
        cut = {f: getattr(steps, f)[0, 0] for f in _FIELDS}
        for f in ("key", "value"):
            cut[f] = cut[f][:n]
        for f in ("scores", "scaled_scores", "masked_scores", "visible", "weights"):
            cut[f] = cut[f][..., :n]
        return AttentionSteps(**cut, scale=steps.scale)
    # a run without traces or calls (tests, old runs): the plain spec on its Q, K, V, no mask
    q, k, v = (torch.as_tensor(x)[layer, head].float() for x in (run.queries, run.keys, run.values))
    return attention_steps(q, k, v)


def _tiled_statistics(
    calls: Sequence[Any], t: int, top_k: int
) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Per-head statistics of every call without its T × T matrix; returns (stats, (top indices, top
    weights)) with stats as in :func:`head_statistics` ((L, H) float64) and the top-k as (L, H, T, k)."""
    from ..tiled import tiled_attention_with_stats

    out: dict[str, list[torch.Tensor]] = {"entropy": [], "self": [], "first": [], "last": []}
    idx_all, w_all = [], []
    for call in calls:
        n = call.n_keys
        _out, st = tiled_attention_with_stats(
            call.query,
            call.key,
            call.value,
            call.attn_mask,
            call.is_causal,
            call.scale,
            enable_gqa=call.enable_gqa,
            top_k=top_k + (1 if call.key.shape[-2] > n else 0),  # room for a sink among the top
        )
        out["entropy"].append(st.entropy[0].double().mean(-1) / math.log(2.0))
        out["first"].append(st.column_sums[0, :, 0].double() / t)
        out["last"].append(st.column_sums[0, :, n - 1].double() / t)
        out["self"].append(_self_weight(call, st.lse)[0].double().mean(-1))
        idx, w = st.topk_indices[0], st.topk_weights[0]
        real = idx < n  # drop a sink key from the top list
        order = torch.sort(real.int(), dim=-1, descending=True, stable=True).indices[..., :top_k]
        idx_all.append(torch.where(real, idx, -1).gather(-1, order))
        w_all.append(torch.where(real, w, 0.0).gather(-1, order))
    stats = {k: torch.stack(v) for k, v in out.items()}
    return stats, (torch.stack(idx_all), torch.stack(w_all))


def _self_weight(call: Any, lse: torch.Tensor) -> torch.Tensor:
    """(B, H, T): the weight of each query on its own position, exp(s_ii − lse_i), from the diagonal of
    the scores (Tq = number of keys: self-attention)."""
    q = call.query
    k = call.key[..., : q.shape[-2], :]
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if call.scale is None else call.scale
    s = (q.double() * k.double()).sum(-1) * scale  # (B, H, T)
    mask = call.attn_mask
    if mask is not None:
        t = q.shape[-2]
        diag = mask[..., :t, :t].expand(*q.shape[:-2], t, t).diagonal(dim1=-2, dim2=-1)
        s = torch.where(diag, s, -math.inf) if diag.dtype == torch.bool else s + diag.double()
    lse = lse.double()
    seen = torch.isfinite(lse)  # a query that sees no key has weight 0 everywhere
    return torch.where(seen, torch.exp(s - torch.where(seen, lse, 0.0)), 0.0)


def model_report(
    run: Any,
    *,
    head: tuple[int, int] | None = None,
    token: int | None = None,
    exact_budget_mb: float = 8.0,
    title: str | None = None,
    progress: Callable[[str], None] | None = None,
    top_k: int = 4,
) -> dict[str, Any]:
    """The payload for a real-model run (:func:`selfattention.pretrained.run_text`).

    Args:
        run: a ``ModelRun`` (``tokens``, ``queries``/``keys``/``values`` (L, H, T, D), ``attentions``
            (L, H, T, T) or None; optional ``traces``, ``calls``, ``special``, ``model_name``,
            ``max_abs_diff_weights``, ``truncated``, ``n_tokens_full``, ``trained_length``, ``text``).
        head: ``(layer, head)``, 0-based, selected when the page opens and always stored exactly.
            ``None``: the head of the strongest long-range link between two words
            (:func:`selfattention.focus.strongest_link`); without one, the most focused head that does
            not park its weight on the first and last token.
        token: the query token selected when the page opens. ``None``: the query of that link (the
            strongest link inside ``head`` when a head is given), else the first word.
        exact_budget_mb: raw bytes allowed for exact traces. The trace of a head costs
            4·(3T² + T·D) bytes (3.3 MB at T = 512); heads are added nearest-first to the selected one
            (same layer, then neighbouring layers) until the budget is spent; the selected head always is.
        title: page title (default: the start of the text).
        progress: called with a short message before each slow step.
        top_k: for runs without matrices, how many heaviest keys per query the page keeps.

    Raises:
        ValueError: shapes disagree, or ``head``/``token`` out of range.
    """
    say = progress or (lambda _msg: None)
    tokens = list(run.tokens)
    q = torch.as_tensor(run.queries).detach()
    if q.dim() != 4:
        raise ValueError(f"run.queries must be (L, H, T, D), got shape {tuple(q.shape)}")
    n_layers, n_heads, t, d = q.shape
    if len(tokens) != t:
        raise ValueError(f"run.tokens has {len(tokens)} entries but the queries are for T = {t}")
    w = run.attentions
    if w is not None:
        w = torch.as_tensor(w).detach().float()
        if tuple(w.shape) != (n_layers, n_heads, t, t):
            raise ValueError(
                f"run.attentions must be (L, H, T, T) = ({n_layers}, {n_heads}, {t}, {t}), got {tuple(w.shape)}"
            )
    special = list(getattr(run, "special", None) or [bool(_SPECIAL.match(tok)) for tok in tokens])

    say(_("per-head statistics"))
    topk = None
    if w is not None:
        stats = head_statistics(w)
        link = strongest_link(w, tokens, special)
    else:
        stats, topk = _tiled_statistics(run.calls, t, top_k)
        link = strongest_link_topk(*topk, tokens, special)
    if head is None:
        head = (link.layer, link.head) if link is not None else _fallback_head(stats, n_heads)
    layer0, head0 = head
    if not (0 <= layer0 < n_layers and 0 <= head0 < n_heads):
        raise ValueError(f"head must be (layer, head) in 0..{n_layers - 1}, 0..{n_heads - 1}, got {head}")
    if token is None:
        if link is None or (link.layer, link.head) != (layer0, head0):
            link = _link_in_head(w, topk, layer0, head0, tokens, special)
        token = link.query if link is not None else fallback_token(tokens, special)
    if not 0 <= token < t:
        raise ValueError(f"token must be in 0..{t - 1}, got {token}")

    dv = torch.as_tensor(run.values).shape[-1]
    per_head = exact_bytes(t, d, dv, 4, with_qkv=False)
    order = sorted(
        ((la, h) for la in range(n_layers) for h in range(n_heads)),
        key=lambda lh: (lh != (layer0, head0), abs(lh[0] - layer0), lh[0], abs(lh[1] - head0), lh[1]),
    )
    n_exact = max(1, min(len(order), int(exact_budget_mb * 1e6 // per_head)))
    chosen = order[:n_exact]
    say(_("storing the exact traces of {n} of {total} heads").format(n=n_exact, total=n_layers * n_heads))
    exact: dict[str, Any] = {}
    stored: list[np.ndarray] = []
    for la, h in chosen:
        steps = _head_steps(run, la, h)
        exact[f"{la}.{h}"] = steps_record(steps, "f32", with_qkv=False)
        if w is None:
            stored.append(quantise_weights(steps.weights))
    if n_exact == len(order):
        exact_note = ""
    else:
        exact_note = _(
            "Exact values and traces are stored for {n} of {total} heads (a trace at T = {t} costs {mb:.1f} "
            "MB); {others} Choose the head with --head LAYER.HEAD, or raise --exact-mb."
        ).format(
            n=n_exact,
            total=len(order),
            t=t,
            mb=per_head / 1e6,
            others=_("other heads show 8-bit colour values.")
            if w is not None
            else _(
                "other heads have statistics and each query's heaviest keys only (the input is too long "
                "for every matrix)."
            ),
        )

    name = str(getattr(run, "model_name", "") or "all-MiniLM-L6-v2")
    scale = _scale(run, d)
    facts = [
        (_("model"), name),
        (_("tokens"), str(t)),
        (_("layers × heads"), f"{n_layers} × {n_heads}"),
        ("head_dim", str(d)),
        (_("scale"), f"{scale:.6g}" + (f" = 1/√{d}" if math.isclose(scale, 1 / math.sqrt(d)) else "")),
    ]
    notes = _notes(run, t, w is None)
    diff = getattr(run, "max_abs_diff_weights", None)
    if diff is not None:
        facts.append((_("vs transformers eager"), f"max |Δw| = {diff:.1e}"))
    text = str(getattr(run, "text", "") or " ".join(tokens))
    if title is None:
        title = text if len(text) <= 80 else text[:77].rstrip() + "…"
    say(_("encoding weights"))
    if w is not None:
        u8, u8_heads = quantise_weights(w), None
    else:
        u8, u8_heads = np.stack(stored), list(exact)
    return build_payload(
        title=title,
        subtitle=_("{name} on selfattention's attention").format(name=name),
        source="model",
        tokens=tokens,
        shape=(n_layers, n_heads, t),
        u8=u8,
        stats=stats,
        exact=exact,
        head=(layer0, head0),
        token=token,
        head_dim=int(d),
        notes=notes,
        facts=facts,
        exact_note=exact_note,
        u8_heads=u8_heads,
        topk=topk,
        special=special,
    )


def _scale(run: Any, d: int) -> float:
    calls = getattr(run, "calls", None) or []
    if calls and calls[0].scale is not None and calls[0].scale != 0.0:
        return float(calls[0].scale)
    traces = getattr(run, "traces", None) or []
    if traces:
        return float(traces[0].steps.scale)
    return 1 / math.sqrt(d)


def _notes(run: Any, t: int, statistics_only: bool) -> list[str]:
    notes = []
    diff = getattr(run, "max_abs_diff_weights", None)
    hidden = getattr(run, "max_abs_diff_hidden", None)
    if diff is not None:
        if diff == 0.0:
            notes.append(
                _(
                    "The model ran on this library's attention; transformers' own eager attention on the same "
                    "text gives exactly the same weights (largest difference 0)."
                )
            )
        elif diff <= MATCH_TOLERANCE:
            notes.append(
                _(
                    "The model ran on this library's attention; transformers' own eager attention on the same "
                    "text gives weights that differ from ours by at most {diff:.1e} (float32 rounding)."
                ).format(diff=diff)
            )
        else:
            notes.append(
                _(
                    "MISMATCH: transformers' own eager attention on the same text gives weights that differ "
                    "from ours by {diff:.1e}, more than float32 rounding explains (tolerance {tolerance:g})."
                ).format(diff=diff, tolerance=MATCH_TOLERANCE)
            )
    elif hidden is not None:
        notes.append(
            _(
                "The model ran on this library's attention; with transformers' own eager attention the last "
                "hidden state differs by at most {diff:.1e}."
            ).format(diff=hidden)
        )
    if statistics_only:
        notes.append(
            _(
                "The input is too long to keep every weight matrix: the per-head statistics and each query's "
                "heaviest keys were computed block by block (tiled attention), and only the stored heads have "
                "a matrix."
            )
        )
    if getattr(run, "truncated", False):
        full = getattr(run, "n_tokens_full", 0)
        notes.append(
            _("The text was cut to its first {t} tokens{rest}.").format(
                t=t, rest=_(" (of {full})").format(full=full) if full else ""
            )
        )
    trained = getattr(run, "trained_length", None)
    if trained is not None and t > trained:
        notes.append(
            _(
                "The model was trained on inputs of at most {trained} tokens (its own files say so); this one "
                "has {t}, so its attention past position {trained} is less reliable."
            ).format(trained=trained, t=t)
        )
    return notes
