"""Block primitives of the online softmax, shared by the tiled and the distributed (ring) paths.

Attention over a key sequence split into blocks K = [K₁; K₂; …] can be computed one block at a time:
each block gives a normalised partial output Oᵦ and the log-sum-exp ℓᵦ of its scores per query, and two
partials merge exactly (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax";
Dao 2023, "FlashAttention-2", Algorithm 1)::

    ℓ = log(exp ℓ₁ + exp ℓ₂)          O = exp(ℓ₁ - ℓ) O₁ + exp(ℓ₂ - ℓ) O₂

A query that sees no key of a block has ℓᵦ = -inf and Oᵦ = 0, and merging with it changes nothing; a
query that sees no key at all ends with ℓ = -inf and O = 0 (never exp(-inf - (-inf)) = NaN).

The backward of a block needs only the final O and ℓ (FlashAttention-2, Algorithm 2): with
P = exp(S - ℓ), δ = rowsum(dO ∘ O): dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - δ), dQ = dS K · scale, dK = dSᵀ Q · scale.

Shapes: q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv); ``visible`` bool broadcastable to (..., Tq, Tk)
(True = attend) or None; ``bias`` float broadcastable to the same (added to the scaled scores) or None;
lse (..., Tq). Computation is in float32 at least.
"""

from __future__ import annotations

import math

import torch

__all__ = ["block_scores", "block_forward", "merge_partials", "block_backward"]


def block_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled, masked scores of one block, (..., Tq, Tk); hidden keys are -inf."""
    s = (q @ k.transpose(-2, -1)) * scale
    if bias is not None:
        s = s + bias
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    return s


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one key block: (normalised output (..., Tq, Dv), lse (..., Tq)).

    >>> q = torch.tensor([[1.0, 0.0]]); k = torch.eye(2); v = 2 * torch.eye(2)
    >>> out, lse = block_forward(q, k, v, scale=2 ** -0.5)
    >>> out, lse
    (tensor([[1.3395, 0.6605]]), tensor([1.1079]))
    """
    s = block_scores(q, k, scale, visible, bias)
    if s.shape[-1] == 0:
        return v.new_zeros((*s.shape[:-1], v.shape[-1])), s.new_full(s.shape[:-1], -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = (p @ v) / torch.where(denom == 0, torch.ones_like(denom), denom)
    lse = (m + torch.log(denom)).squeeze(-1)  # log 0 = -inf for a row with nothing visible
    return out, lse


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two normalised partial outputs over disjoint key sets into one (exact).

    >>> q = torch.tensor([[0.3, -1.0]]); k = torch.randn(5, 2); v = torch.randn(5, 3)
    >>> o1, l1 = block_forward(q, k[:2], v[:2], 1.0); o2, l2 = block_forward(q, k[2:], v[2:], 1.0)
    >>> o, l = merge_partials(o1, l1, o2, l2)
    >>> torch.allclose(o, torch.softmax(q @ k.T, -1) @ v, atol=1e-6)
    True
    """
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(lse == -math.inf, torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - ref).unsqueeze(-1)
    wb = torch.exp(lse_b - ref).unsqueeze(-1)
    return wa * out_a + wb * out_b, lse


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    visible: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) contributed by one key block, given the *final* ``out`` and ``lse``.

    ``delta`` = rowsum(grad_out · out), (..., Tq), may be passed in to avoid recomputing it per block.
    Sum dq over key blocks; dk, dv of a block are complete once every query block has been visited.
    """
    s = block_scores(q, k, scale, visible, bias)
    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1)
    p = torch.exp(s - ref)  # (..., Tq, Tk); 0 at hidden keys and for rows with nothing visible
    if delta is None:
        delta = (grad_out * out).sum(dim=-1)
    dv = p.transpose(-2, -1) @ grad_out
    ds = p * (grad_out @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    dq = (ds @ k) * scale
    dk = (ds.transpose(-2, -1) @ q) * scale
    return dq, dk, dv
