"""The log-sum-exp merge: two normalised partial outputs over disjoint key sets make one, exactly.

A block kernel returns, for its keys K_b, the normalised output O_b = softmax(S_b) V_b and the log-sum-exp
ℓ_b = log Σ exp(S_b) of each query row. Two partials merge as (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"; Dao 2023, "FlashAttention-2", Algorithm 1)::

    ℓ = log(exp ℓ₁ + exp ℓ₂)          O = exp(ℓ₁ − ℓ) O₁ + exp(ℓ₂ − ℓ) O₂

A row that sees no key of a partial has ℓ = −inf and O = 0, and merging with it changes nothing; a row that
sees no key at all ends with ℓ = −inf and O = 0 (never exp(−inf − (−inf)) = NaN). A NaN ℓ (a NaN score the
row could see) stays NaN: NaN in, NaN out. Used by the engine (query rows split over several calls) and by
ring attention (key blocks arriving from other ranks).

Shapes: out (..., T, Dv), lse (..., T), float32 at least.
"""

from __future__ import annotations

import math

import torch

__all__ = ["merge_partials", "merge_into"]


def _weights(lse: torch.Tensor, *parts: torch.Tensor) -> list[torch.Tensor]:
    ref = torch.where(lse == -math.inf, torch.zeros((), dtype=lse.dtype, device=lse.device), lse)
    return [torch.exp(p - ref).unsqueeze(-1) for p in parts]


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials over disjoint key sets; returns new (out, lse).

    >>> q = torch.tensor([[0.3, -1.0]]); k = torch.randn(5, 2); v = torch.randn(5, 3)
    >>> def part(ks):
    ...     s = q @ k[ks].T
    ...     return torch.softmax(s, -1) @ v[ks], torch.logsumexp(s, -1)
    >>> o, l = merge_partials(*part(slice(0, 2)), *part(slice(2, 5)))
    >>> torch.allclose(o, torch.softmax(q @ k.T, -1) @ v, atol=1e-6)
    True
    """
    lse = torch.logaddexp(lse_a, lse_b)
    wa, wb = _weights(lse, lse_a, lse_b)
    return wa * out_a + wb * out_b, lse


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: (out_acc, lse_acc) ← merge of themselves with (out, lse). ``out`` may be of a lower
    precision than the accumulator (it is promoted)."""
    new = torch.logaddexp(lse_acc, lse)
    wa, wb = _weights(new, lse_acc, lse)
    out_acc.mul_(wa).add_(out.to(out_acc.dtype) * wb)
    lse_acc.copy_(new)
