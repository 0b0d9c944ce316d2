"""The log-sum-exp merge: two normalised partial outputs over disjoint key sets make one, exactly.

A block kernel returns, for its keys K_b, the normalised output O_b = softmax(S_b) V_b and the log-sum-exp
ℓ_b = log Σ exp(S_b) of each query row. Two partials merge as (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"; Dao 2023, "FlashAttention-2", Algorithm 1)::

    ℓ = log(exp ℓ₁ + exp ℓ₂)          O = exp(ℓ₁ − ℓ) O₁ + exp(ℓ₂ − ℓ) O₂

A row that sees no key of a partial has ℓ = −inf, and that partial contributes nothing (not even 0 · NaN of
whatever its output holds); a row that sees no key at all ends with ℓ = −inf and O = 0 (never
exp(−inf − (−inf)) = NaN, neither in the values nor in the gradients). A NaN ℓ (a NaN score the row could
see) stays NaN: NaN in, NaN out. The merge is associative and commutative (up to rounding).

:func:`merge_states` is the public, differentiable form; :func:`merge_into` the engine's in-place one (query
rows split over several calls; ring attention's key blocks from other ranks) — both use :func:`_weights`.

Shapes: out (..., T, Dv), lse (..., T) (lse has the shape of out without its last dim).
"""

from __future__ import annotations

import math

import torch

__all__ = ["merge_states", "merge_into"]


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ℓ, w_a, w_b) of the merge: ℓ = log(e^ℓa + e^ℓb), w = e^(ℓ_x − ℓ), 0 for a part with ℓ = −inf, and
    ℓ = −inf with w_a = w_b = 0 when both are −inf. Differentiable, without NaN from −inf − (−inf)."""
    m = torch.maximum(lse_a, lse_b).detach()  # cancels out of ℓ and w: no gradient needed through it
    m = torch.where(m == -math.inf, torch.zeros((), dtype=m.dtype, device=m.device), m)
    ea, eb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = ea + eb
    empty = total == 0
    safe = torch.where(empty, torch.ones((), dtype=total.dtype, device=total.device), total)
    lse = torch.where(empty, torch.full((), -math.inf, dtype=m.dtype, device=m.device), m + torch.log(safe))
    return lse, ea / safe, eb / safe


def _check(name: str, out: torch.Tensor, lse: torch.Tensor) -> None:
    if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
        raise TypeError(
            f"{name}: out and lse must be torch tensors, got {type(out).__name__}, {type(lse).__name__}"
        )
    if not out.is_floating_point() or not lse.is_floating_point():
        raise TypeError(f"{name}: out and lse must be floating tensors, got {out.dtype} and {lse.dtype}")
    if out.dim() < 1 or tuple(lse.shape) != tuple(out.shape[:-1]):
        raise ValueError(
            f"{name}: lse must have the shape of out without its last dim, got out {tuple(out.shape)} and "
            f"lse {tuple(lse.shape)}"
        )


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets into the state over their union.

    A state is what ``scaled_dot_product_attention(..., return_lse=True)`` (or flash-attn's
    ``return_attn_probs=True``) returns for some keys: the normalised output and the per-row log-sum-exp of
    the scores. Merging is exact: attention over keys A ∪ B equals the merge of attention over A and over B.

    Args:
        out_a, out_b: (..., T, Dv) outputs (same shape and device).
        lse_a, lse_b: (..., T) natural-log log-sum-exp of each row; ``-inf`` for a row that saw no key
            (it then contributes nothing, whatever its output holds).

    Returns:
        (out, lse): out in the promoted dtype of the outs, lse in float32 at least. Differentiable with
        respect to all four inputs; associative; a row with −inf on both sides gets 0 and −inf, never NaN.

    Raises:
        TypeError: non-tensor or non-floating inputs. ValueError: shapes that do not match.

    Flash-attn's layout (out (B, T, H, D), lse (B, H, T)): pass ``lse.transpose(1, 2)``.

    >>> q = torch.tensor([[0.3, -1.0]]); k = torch.randn(5, 2); v = torch.randn(5, 3)
    >>> def part(ks):
    ...     s = q @ k[ks].T
    ...     return torch.softmax(s, -1) @ v[ks], torch.logsumexp(s, -1)
    >>> o, l = merge_states(*part(slice(0, 2)), *part(slice(2, 5)))
    >>> torch.allclose(o, torch.softmax(q @ k.T, -1) @ v, atol=1e-6)
    True
    >>> merge_states(torch.zeros(1, 1), torch.tensor([-math.inf]), torch.ones(1, 1), torch.tensor([-math.inf]))
    (tensor([[0.]]), tensor([-inf]))
    """
    _check("merge_states (a)", out_a, lse_a)
    _check("merge_states (b)", out_b, lse_b)
    if out_a.shape != out_b.shape:
        raise ValueError(f"merge_states: out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)} differ")
    if out_a.device != out_b.device or lse_a.device != out_a.device or lse_b.device != out_a.device:
        raise ValueError("merge_states: all four tensors must be on the same device")
    acc = torch.promote_types(torch.promote_types(lse_a.dtype, lse_b.dtype), torch.float32)
    lse, wa, wb = _weights(lse_a.to(acc), lse_b.to(acc))
    od = torch.promote_types(out_a.dtype, out_b.dtype)
    work = torch.promote_types(od, acc)
    zero = torch.zeros((), dtype=work, device=out_a.device)
    # a part that saw nothing (lse −inf) contributes nothing, even if its output holds NaN (nor NaN
    # gradients); a part that saw keys whose weight underflows to 0 still passes on a NaN (0 · NaN, as the
    # spec's IEEE arithmetic gives for a visible NaN value under a weight of exactly 0)
    pa = wa.unsqueeze(-1).to(work) * torch.where((lse_a == -math.inf).unsqueeze(-1), zero, out_a.to(work))
    pb = wb.unsqueeze(-1).to(work) * torch.where((lse_b == -math.inf).unsqueeze(-1), zero, out_b.to(work))
    return (pa + pb).to(od), lse


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: (out_acc, lse_acc) ← merge of themselves with (out, lse); the formula of
    :func:`merge_states` (no autograd). ``out`` may be of a lower precision than the accumulator."""
    new, wa, wb = _weights(lse_acc, lse)
    zero = torch.zeros((), dtype=out_acc.dtype, device=out_acc.device)
    out_acc.mul_(wa.unsqueeze(-1).to(out_acc.dtype))
    add = torch.where(
        (lse == -math.inf).unsqueeze(-1), zero, out.to(out_acc.dtype) * wb.unsqueeze(-1).to(out_acc.dtype)
    )
    out_acc.add_(add)
    lse_acc.copy_(new)
