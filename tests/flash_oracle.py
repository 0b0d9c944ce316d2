"""A float64 oracle for flash-attn's semantics, written without the library's code.

One sequence at a time (the tests loop over sequences, never the library): q (sq, H, D), k/v (sk, Hk, D).
The visibility follows flash-attn 2's documented rules and its C++ argument handling: window entries ≥ the
key length (max_seqlen_k for varlen) are infinite (−1); causal sets the right window to 0; a one-sided
window gets the key length on its other side; query i sits at key position i + sk − sq. ALiBi adds
−slope·|i + sk − sq − j| after the softcap cap·tanh(s/cap) of the scaled score s.
"""

from __future__ import annotations

import math

import torch


def fa_visible(
    sq: int, sk: int, causal: bool, window: tuple[int, int], max_sk: int | None = None
) -> torch.Tensor:
    """(sq, sk) bool, True = attend, by loops."""
    big = sk if max_sk is None else max_sk
    left, right = window
    if left >= big:
        left = -1
    if right >= big:
        right = -1
    if causal:
        right = 0
    m = torch.ones(sq, sk, dtype=torch.bool)
    if left < 0 and right < 0:
        return m
    lx = big if left < 0 else left
    rx = big if right < 0 else right
    for i in range(sq):
        p = i + sk - sq
        for j in range(sk):
            m[i, j] = p - lx <= j <= p + rx
    return m


def fa_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    slopes: torch.Tensor | None = None,
    scale: float | None = None,
    keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    max_sk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (sq, H, D), lse (H, sq)) in float64, differentiable (autograd through plain float64 ops).
    ``keep`` (H, sq, sk) bool: the dropout keep-mask to apply (weights kept / (1 − p))."""
    sq, h, d = q.shape
    sk, hk = k.shape[0], k.shape[1]
    g = h // hk
    sc = 1 / math.sqrt(d) if scale is None else scale
    vis = fa_visible(sq, sk, causal, window, max_sk)
    outs, lses = [], []
    for hh in range(h):
        qh, kh, vh = q[:, hh].double(), k[:, hh // g].double(), v[:, hh // g].double()
        s = (qh @ kh.T) * sc
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            rel = torch.zeros(sq, sk, dtype=torch.float64)
            for i in range(sq):
                for j in range(sk):
                    rel[i, j] = abs(i + sk - sq - j)
            s = s - float(slopes[hh]) * rel
        s = s.masked_fill(~vis, -math.inf)
        rows_o, rows_l = [], []
        for i in range(sq):
            if not bool(vis[i].any()):
                rows_o.append(torch.zeros(vh.shape[1], dtype=torch.float64) + 0 * qh[i].sum())
                rows_l.append(torch.tensor(-math.inf, dtype=torch.float64))
                continue
            w = torch.softmax(s[i], dim=-1)
            lse = torch.logsumexp(s[i][vis[i]], dim=-1)
            if keep is not None:
                w = w * keep[hh, i].double() / (1 - dropout_p)
            rows_o.append(w @ vh)
            rows_l.append(lse)
        outs.append(torch.stack(rows_o) if rows_o else torch.zeros(0, vh.shape[1], dtype=torch.float64))
        lses.append(torch.stack(rows_l) if rows_l else torch.zeros(0, dtype=torch.float64))
    return torch.stack(outs, dim=1), torch.stack(lses)


def fa_varlen(q, k, v, cu_q, cu_k, *, slopes=None, keep=None, **kw):
    """Packed sequences: the per-sequence oracle in a loop; out (total_q, H, D), lse (H, total_q).
    ``slopes`` (batch, H); ``keep`` (batch, H, max_q, max_k)."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        a, e = int(cu_q[b]), int(cu_q[b + 1])
        c, f = int(cu_k[b]), int(cu_k[b + 1])
        kb = None if keep is None else keep[b, :, : e - a, : f - c]
        sl = None if slopes is None else slopes[b]
        o, lse = fa_sequence(q[a:e], k[c:f], v[c:f], slopes=sl, keep=kb, **kw)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def fa_visible_fast(
    sq: int, sk: int, causal: bool, window: tuple[int, int], max_sk: int | None = None
) -> torch.Tensor:
    """:func:`fa_visible` without the loops (the same rules, for the larger shapes of flash-attn's cases)."""
    big = sk if max_sk is None else max_sk
    left, right = (int(w) for w in window)
    left, right = (-1 if w >= big else w for w in (left, right))
    if causal:
        right = 0
    rel = (torch.arange(sq)[:, None] + sk - sq) - torch.arange(sk)[None]  # query position − key position
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left < 0 and right < 0:
        return ok
    return (rel <= (big if left < 0 else left)) & (-rel <= (big if right < 0 else right))


def fa_attention(
    q, k, v, ok, bias=None, *, scale=None, softcap=0.0, keep=None, dropout_p=0.0, work=torch.float64
):
    """Batched attention in flash-attn's layout computed in ``work`` (float64 for the reference; the input
    dtype for flash-attn's "naive PyTorch" error baseline): keys scaled before q·kᵀ (its reordered
    reference), then the softcap, then ``bias``; rows that see nothing give zeros.

    q (B, Tq, H, D), k/v (B, Tk, Hk, D) (Hk divides H), ok (B or 1, Tq, Tk) bool, bias broadcastable to
    (B, H, Tq, Tk), keep (B, H, Tq, Tk) bool (dropout keep-mask, kept weights / (1 − p)).
    Returns out (B, Tq, H, Dv) and lse (B, H, Tq) in ``work`` (−inf where nothing is seen), differentiable."""
    g = q.shape[2] // k.shape[2]
    q, k, v = q.to(work), k.to(work).repeat_interleave(g, 2), v.to(work).repeat_interleave(g, 2)
    sc = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k * sc)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(work)
    s = s.masked_fill(~ok[:, None], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    w = torch.softmax(s, dim=-1)
    w = torch.where(ok[:, None], w, torch.zeros((), dtype=work))  # blind rows: 0, not NaN (nor NaN grads)
    if keep is not None:
        w = w * keep.to(work) / (1 - dropout_p)
    return torch.einsum("bhqk,bkhd->bqhd", w, v), lse
