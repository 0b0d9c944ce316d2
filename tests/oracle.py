"""An independent float64 oracle for attention, written without the library's code.

Plain loops over rows with Python's math, kept deliberately naive: a second implementation of the
definition in lecture 003 (softmax(QKᵀ·scale + mask)V), with this library's conventions (bool mask
True = attend, bottom-right causal, zeros for a query with no visible key).
"""

from __future__ import annotations

import math

import torch


def visible_mask(q_len: int, k_len: int, is_causal: bool = False, window: int | None = None) -> torch.Tensor:
    """(Tq, Tk) bool, query i at position k_len - q_len + i."""
    m = torch.ones(q_len, k_len, dtype=torch.bool)
    for i in range(q_len):
        p = k_len - q_len + i
        for j in range(k_len):
            if is_causal and j > p:
                m[i, j] = False
            if window is not None and (j > p or j <= p - window):
                m[i, j] = False
    return m


def attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (context, weights) in float64 for inputs (..., Tq, D), (..., Tk, D), (..., Tk, Dv).

    Batch dims of key/value must already match query's (repeat GQA heads before calling).
    """
    q = query.detach().double()
    k = key.detach().double()
    v = value.detach().double()
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    q = q.expand(*batch, *q.shape[-2:]).reshape(-1, *q.shape[-2:])
    k = k.expand(*batch, *k.shape[-2:]).reshape(-1, *k.shape[-2:])
    v = v.expand(*batch, *v.shape[-2:]).reshape(-1, *v.shape[-2:])
    tq, tk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if attn_mask is not None:
        mask = attn_mask.expand(*batch, tq, tk).reshape(-1, tq, tk)
    causal = visible_mask(tq, tk, is_causal)
    out = torch.zeros(q.shape[0], tq, dv, dtype=torch.float64)
    weights = torch.zeros(q.shape[0], tq, tk, dtype=torch.float64)
    for b in range(q.shape[0]):
        for i in range(tq):
            logits = []
            for j in range(tk):
                ok = bool(causal[i, j])
                bias = 0.0
                if attn_mask is not None:
                    mv = mask[b, i, j]
                    if mask.dtype == torch.bool:
                        ok = ok and bool(mv)
                    else:
                        bias = float(mv)
                        ok = ok and bias != -math.inf
                logits.append(float(q[b, i] @ k[b, j]) * s + bias if ok else None)
            seen = [x for x in logits if x is not None]
            if not seen:
                continue
            m = max(seen)
            e = [math.exp(x - m) if x is not None else 0.0 for x in logits]
            z = sum(e)
            for j in range(tk):
                weights[b, i, j] = e[j] / z
                if e[j] != 0.0:
                    out[b, i] += weights[b, i, j] * v[b, j]
    return out.reshape(*batch, tq, dv), weights.reshape(*batch, tq, tk)
