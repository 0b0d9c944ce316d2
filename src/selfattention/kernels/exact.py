"""The exact kernel: one call of the block plan computed with plain torch ops, tile by tile.

Same interface as :mod:`selfattention.kernels.vendor` (q (B, H, R, D) over k (B, Hkv, C, D),
v (B, Hkv, C, Dv), a float bias broadcastable to (B, H, R, C) or a causal square), plus what no fused
kernel offers:

* **non-finite inputs** exactly as the spec (:func:`selfattention.functional.attention_steps`): a NaN or
  inf in a key/value that a row can see reaches that row (NaN in, NaN out); in a hidden one it reaches
  nothing, neither outputs nor gradients; a query that sees no key gets zeros and zero gradient even if it
  holds NaN/inf;
* **dropout** whose mask is drawn per tile from a generator seeded by (seed, absolute row, absolute
  column), so that the backward regenerates it instead of storing it;
* the **gradient of a float mask** (dS, summed to the bias' shape);
* any dtype torch computes in (float64 included) on any device.

Memory: one score tile of ``block_q`` rows (times the query heads sharing a key/value head) × ``block_k``
keys at a time. Forward: FlashAttention-2 Algorithm 1 (running maximum and sum per row); backward:
Algorithm 2 given the final output and log-sum-exp (Dao 2023). Sources as in :mod:`selfattention.kernels`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._validation import all_finite as _finite
from ..functional import guarded_pv

__all__ = ["Dropout", "forward", "backward", "scores_tile", "tiles"]

_NEG_INF = -math.inf


@dataclass(frozen=True)
class Dropout:
    """Dropout of the attention weights: probability ``p``, ``seed``, and the call's absolute corner
    (first row, first column) so that each tile's mask depends only on where the tile is."""

    p: float
    seed: int
    row0: int = 0
    col0: int = 0

    def at(self, row0: int, col0: int) -> Dropout:
        return Dropout(self.p, self.seed, row0, col0)

    def scale(self, i0: int, j0: int, shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
        """Keep-mask / (1 − p) of the tile whose first row/column are i0/j0 inside the call."""
        gen = torch.Generator(device=like.device)
        gen.manual_seed((self.seed * 1_000_003 + (self.row0 + i0) * 65_537 + self.col0 + j0) % (2**63 - 1))
        keep = torch.rand(shape, generator=gen, device=like.device, dtype=torch.float32) >= self.p
        return keep.to(like.dtype) / (1.0 - self.p)


def tiles(rows: int, cols: int, causal: bool, block_q: int, block_k: int):
    """(i0, i1, [(j0, j1)]) of the tiles of a call; a causal square skips the tiles above its diagonal."""
    for i0 in range(0, rows, block_q):
        i1 = min(rows, i0 + block_q)
        hi = min(cols, i1) if causal else cols
        yield i0, i1, [(j0, min(hi, j0 + block_k)) for j0 in range(0, hi, block_k)]


def bias_5d(bias: torch.Tensor | None, hkv: int, g: int) -> torch.Tensor | None:
    """A bias broadcastable to (B, H, R, C) as one broadcastable to (B, Hkv, G, R, C)."""
    if bias is None:
        return None
    if bias.shape[1] == 1:
        return bias.unsqueeze(2)
    return bias.unflatten(1, (hkv, g))


def scores_tile(
    q5: torch.Tensor,
    k: torch.Tensor,
    bias5: torch.Tensor | None,
    causal: bool,
    scale: float,
    i0: int,
    i1: int,
    j0: int,
    j1: int,
) -> torch.Tensor:
    """Scaled, biased scores of one tile, (B, Hkv, G, r, w); hidden keys −inf. q5 (B, Hkv, G, R, D),
    k (B, Hkv, C, D)."""
    s = torch.matmul(q5[..., i0:i1, :], k[:, :, None, j0:j1].transpose(-1, -2)) * scale
    if bias5 is not None:
        rows = slice(i0, i1) if bias5.shape[-2] != 1 else slice(None)
        cols = slice(j0, j1) if bias5.shape[-1] != 1 else slice(None)
        blk = bias5[..., rows, cols]
        # −inf hides the key even where the score itself is NaN/inf (a hidden NaN must not leak)
        s = torch.where(blk == _NEG_INF, torch.full((), _NEG_INF, dtype=s.dtype, device=s.device), s + blk)
    if causal and j1 > i0:  # the tile crosses the diagonal: key j visible to row i iff j ≤ i
        r = torch.arange(i0, i1, device=s.device)[:, None]
        c = torch.arange(j0, j1, device=s.device)[None, :]
        s = s.masked_fill(c > r, _NEG_INF)
    return s


def _visible_tile(s, bias5, causal: bool, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
    """Bool, broadcastable to the tile ``s``: the entries the bias and the causal rule leave visible."""
    vis = torch.ones((), dtype=torch.bool, device=s.device).expand(s.shape)
    if bias5 is not None:
        rows = slice(i0, i1) if bias5.shape[-2] != 1 else slice(None)
        cols = slice(j0, j1) if bias5.shape[-1] != 1 else slice(None)
        vis = vis & (bias5[..., rows, cols] != _NEG_INF)
    if causal and j1 > i0:
        r = torch.arange(i0, i1, device=s.device)[:, None]
        c = torch.arange(j0, j1, device=s.device)[None, :]
        vis = vis & (c <= r)
    return vis


def _guarded_pv(p: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
    """p @ v where a non-finite value reaches only the rows that can see its key (``seen``: bool of the
    tile's visible entries by the visibility, not by the scores; None when the values are finite): the
    spec's :func:`selfattention.functional.guarded_pv`, tile by tile."""
    return p @ v if seen is None else guarded_pv(p, v, seen)  # guarded_pv checks v's finiteness itself


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    scale: float,
    *,
    dropout: Dropout | None = None,
    block_q: int = 256,
    block_k: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, R, Dv), lse (B, H, R)) in q's dtype; a row that sees no key: out 0, lse −inf."""
    b, h, rows, _ = q.shape
    hkv, cols, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // hkv
    q5 = q.unflatten(1, (hkv, g))  # (B, Hkv, G, R, D)
    v5 = v[:, :, None]  # (B, Hkv, 1, C, Dv)
    bias5 = bias_5d(bias, hkv, g)
    v_bad = not _finite(v)
    out = q.new_zeros((b, hkv, g, rows, dv))
    lse = q.new_full((b, hkv, g, rows), _NEG_INF)
    for i0, i1, chunks in tiles(rows, cols, causal, block_q, block_k):
        m = q.new_full((b, hkv, g, i1 - i0, 1), _NEG_INF)
        total = q.new_zeros((b, hkv, g, i1 - i0, 1))
        acc = q.new_zeros((b, hkv, g, i1 - i0, dv))
        for j0, j1 in chunks:
            s = scores_tile(q5, k, bias5, causal, scale, i0, i1, j0, j1)
            # the keys a row may see by the visibility (a score −inf from the data is still seen: a NaN
            # value there makes the row NaN, as in the spec); built only when the values are not finite
            seen = _visible_tile(s, bias5, causal, i0, i1, j0, j1) if v_bad else None
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_ref = torch.where(m_new == _NEG_INF, torch.zeros_like(m_new), m_new)
            alpha = torch.exp(m - m_ref)  # 0 for the first chunk a row sees
            p = torch.exp(s - m_ref)
            total = total * alpha + p.sum(dim=-1, keepdim=True)
            if dropout is not None:
                p = p * dropout.scale(i0, j0, p.shape, p)
            acc = acc * alpha + _guarded_pv(p, v5[..., j0:j1, :], seen)
            m = m_new
        out[..., i0:i1, :] = acc / torch.where(total == 0, torch.ones_like(total), total)
        m_ref = torch.where(m == _NEG_INF, torch.zeros_like(m), m)
        lse[..., i0:i1] = (m_ref + torch.log(total)).squeeze(-1)
    return out.flatten(1, 2), lse.flatten(1, 2)


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    scale: float,
    *,
    dropout: Dropout | None = None,
    dbias: torch.Tensor | None = None,
    block_q: int = 256,
    block_k: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of one call given the final ``out`` and ``lse`` of its rows; with ``dbias`` (a
    zero tensor of the bias' shape) dS is added into it. P = exp(S − ℓ), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − δ),
    δ = rowsum(dO ∘ O), dQ = dS K · scale, dK = dSᵀ Q · scale (FlashAttention-2, Algorithm 2).

    Non-finite inputs: a row with ℓ = −inf (it sees no key) takes no part (its NaN/inf query is zeroed, its
    dO ignored); NaN/inf in K or V enters the scores but the products dS·K and dO·Vᵀ use them zeroed, and dS is
    exactly 0 where a key is hidden, so keys and values that a NaN row cannot see get finite gradients.
    """
    b, h, rows, d = q.shape
    hkv, cols = k.shape[1], k.shape[2]
    g = h // hkv
    blind = lse == _NEG_INF  # (B, H, R)
    blind5 = None
    if bool(blind.any()):
        blind5 = blind.unflatten(1, (hkv, g))[..., None]  # (B, Hkv, G, R, 1)
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        q = torch.where(blind[..., None] & ~torch.isfinite(q), zero, q)
        dout = torch.where(blind[..., None], zero, dout)
    k_raw = k
    bad_kv = not (_finite(k) and _finite(v))
    if bad_kv:
        k = torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0)
        v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    delta = (dout * out).sum(dim=-1)  # δ = rowsum(dO ∘ O), (B, H, R)
    guard = bad_kv or not _finite(delta) or bool(torch.isnan(lse).any())
    if guard:  # an output entry that gets no gradient (dO = 0) adds 0 to δ even if it is NaN
        zero = torch.zeros((), dtype=out.dtype, device=out.device)
        delta = torch.where(dout == 0, zero, dout * out).sum(dim=-1)
    q5, do5 = q.unflatten(1, (hkv, g)), dout.unflatten(1, (hkv, g))
    lse5 = torch.where(blind, torch.full((), math.inf, dtype=lse.dtype, device=lse.device), lse)
    lse5 = lse5.unflatten(1, (hkv, g))[..., None]  # (B, Hkv, G, R, 1); +inf: P = 0 for blind rows
    delta5 = delta.unflatten(1, (hkv, g))[..., None]
    bias5 = bias_5d(bias, hkv, g)
    dbias5 = bias_5d(dbias, hkv, g)
    dq = torch.zeros_like(q5)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for i0, i1, chunks in tiles(rows, cols, causal, block_q, block_k):
        qb, dob, lb, db = q5[..., i0:i1, :], do5[..., i0:i1, :], lse5[..., i0:i1, :], delta5[..., i0:i1, :]
        for j0, j1 in chunks:
            s = scores_tile(q5, k_raw, bias5, causal, scale, i0, i1, j0, j1)
            hidden = s == _NEG_INF
            p = torch.exp(s - lb)  # (B, Hkv, G, r, w); 0 where hidden and for blind rows
            if guard:  # a NaN row (ℓ = NaN) still gives exactly 0 where it cannot see
                p = p.masked_fill(hidden, 0.0)
            if blind5 is not None:  # a row that sees nothing takes no part, whatever its scores are
                p = p.masked_fill(blind5[..., i0:i1, :], 0.0)
            vt = v[:, :, None, j0:j1].transpose(-1, -2)  # (B, Hkv, 1, Dv, w)
            dp = dob @ vt
            if dropout is not None:
                z = dropout.scale(i0, j0, p.shape, p)
                dv[:, :, j0:j1] += ((p * z).transpose(-1, -2) @ dob).sum(2)
                dp = dp * z
            else:
                dv[:, :, j0:j1] += (p.transpose(-1, -2) @ dob).sum(2)
            ds = p * (dp - db)  # dS = P ∘ (dO Vᵀ − δ)
            if guard:
                ds = ds.masked_fill(hidden, 0.0)
            if dbias5 is not None:
                rs = slice(i0, i1) if dbias5.shape[-2] != 1 else slice(None)
                cs = slice(j0, j1) if dbias5.shape[-1] != 1 else slice(None)
                target = dbias5[..., rs, cs]
                target += ds.sum_to_size(target.shape)
            dq[..., i0:i1, :] += ds @ k[:, :, None, j0:j1]
            dk[:, :, j0:j1] += (ds.transpose(-1, -2) @ qb).sum(2)
    return (dq * scale).flatten(1, 2), dk * scale, dv
