"""flash-attn 2's Python API on CPU (and any device torch runs on), forward and backward.

The functions of ``flash_attn`` (Dao 2023, "FlashAttention-2"; the public ``flash_attn_interface.py``) with
their signatures, argument order, defaults, layouts and return values, computed by this library's block
engine (torch's fused kernels, O(T) memory, one kernel call per packed sequence; softcap/ALiBi on its
score-mod kernel); only dropout runs on dense torch ops (see :mod:`selfattention.flash._core`). Switch
existing code with one line::

    import selfattention.flash as flash_attn            # flash_attn.flash_attn_func(q, k, v, causal=True)

or, for code that says ``from flash_attn import flash_attn_func``, call :func:`install_as_flash_attn` once
before it is imported. Layouts (flash-attn's, not SDPA's)::

    q (batch, seqlen_q, nheads, headdim)  k, v (batch, seqlen_k, nheads_k, headdim)  → out like q
    varlen: q (total_q, nheads, headdim), k, v (total_k, nheads_k, headdim), cu_seqlens (batch + 1,) int32

Causal is aligned bottom-right per sequence (flash-attn ≥ 2.1): query i sits at key position
i + seqlen_k − seqlen_q. seqlen_q = 2, seqlen_k = 5 and seqlen_q = 5, seqlen_k = 2 (1 = attend)::

    1 1 1 1 0        0 0
    1 1 1 1 1        0 0
                     0 0        a row with nothing visible gives zeros (and lse = -inf)
                     1 0
                     1 1

``window_size=(left, right)``: query i sees keys i + seqlen_k − seqlen_q − left … + right (−1 = infinite);
e.g. (1, 1) with seqlen_q = seqlen_k = 4 (not causal)::

    1 1 0 0
    1 1 1 0
    0 1 1 1
    0 0 1 1

Every difference from flash-attn is listed in docs/flash.md: all float dtypes (not only fp16/bf16) and
any headdim; lse is −inf (not +inf) for a row that sees nothing, and follows the documented ALiBi bias
also under causal; dropout draws its keep-mask from torch's CPU generator, and ``S_dmask`` holds the
normalised weights (negative where dropped), shape (batch, nheads, seqlen_q, seqlen_k) unrounded;
softcap with dropout works; ``deterministic`` is accepted (every backward here is deterministic).
"""

from __future__ import annotations

import sys
import types

import torch

from ..flash_kvcache import flash_attn_with_kvcache
from ._args import dense_problem, unpage, varlen_problem
from ._core import attend

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "install_as_flash_attn",
]

Window = tuple[int, int]


def _empty_probs(q: torch.Tensor) -> torch.Tensor:
    return torch.empty((0,), dtype=q.dtype, device=q.device)  # flash-attn's S_dmask without dropout


def _finish(out4, lse, probs, q, return_attn_probs, varlen):
    if varlen:
        out, lse = out4[0].transpose(0, 1).contiguous(), lse[0]
    else:
        out = out4.transpose(1, 2).contiguous()
    if not return_attn_probs:
        return out
    return out, lse, probs if probs is not None else _empty_probs(q)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """softmax(q kᵀ · softmax_scale) v per batch entry and head, in flash-attn's layout; forward and backward.

    Args:
        q: (batch, seqlen_q, nheads, headdim), any float dtype.
        k, v: (batch, seqlen_k, nheads_k, headdim), same dtype and device; nheads_k divides nheads
            (GQA/MQA: query heads 0 … G−1 use key/value head 0, G = nheads / nheads_k).
        dropout_p: probability of dropping a weight (kept ones scaled by 1/(1 − p)); applied whenever
            > 0 (flash-attn has no training flag: pass 0.0 in evaluation).
        softmax_scale: multiplies q kᵀ; None = 1/√headdim.
        causal: bottom-right causal mask (see the module docstring).
        window_size: (left, right) sliding window, −1 = infinite on that side; non-causal windows allowed.
        softcap: > 0 replaces each scaled score s by softcap · tanh(s / softcap) (0.0 = off).
        alibi_slopes: (nheads,) or (batch, nheads): adds −slope · |i + seqlen_k − seqlen_q − j|.
        deterministic: accepted (the backward is always deterministic here).
        return_attn_probs: return (out, softmax_lse, S_dmask) instead of out.

    Returns:
        out (batch, seqlen_q, nheads, headdim) in q's dtype; with ``return_attn_probs``: also softmax_lse
        (batch, nheads, seqlen_q), float32 at least, log Σ_j exp(score_ij) (−inf for a row that sees
        nothing), and S_dmask: with dropout the weights (batch, nheads, seqlen_q, seqlen_k), negative
        where dropped; without dropout an empty tensor (as flash-attn).

    Raises:
        TypeError, ValueError: naming the argument (shapes, dtypes, devices, head counts, window sizes
        below −1, softcap < 0, alibi shape).

    >>> q = k = v = torch.eye(2).reshape(1, 2, 1, 2)               # (batch, seqlen, nheads, headdim)
    >>> flash_attn_func(q, k, 2 * v, softmax_scale=2**-0.5)[0, :, 0]   # lecture 003's example
    tensor([[1.3395, 0.6605],
            [0.6605, 1.3395]])
    """
    p = dense_problem(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip
    out, lse, probs = attend(p, return_probs=return_attn_probs)
    return _finish(out, lse, probs, q, return_attn_probs, False)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """:func:`flash_attn_func` with qkv (batch, seqlen, 3, nheads, headdim) stacked (gradient: like qkv)."""
    _packed("qkv", qkv, 5, 2, 3, "(batch, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """:func:`flash_attn_func` with kv (batch, seqlen_k, 2, nheads_k, headdim) stacked."""
    _packed("kv", kv, 5, 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(2)
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
):
    """Packed sequences of different lengths, no padding: sequence b is q[cu_seqlens_q[b] : cu_seqlens_q[b+1]]
    over k/v[cu_seqlens_k[b] : cu_seqlens_k[b+1]], each with its own bottom-right causal alignment,
    window and ALiBi offset (seqlen_q/seqlen_k of the sequence). Lengths may be 0 (a sequence without
    keys gives zeros).

    Args:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim).
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32, starting at 0, non-decreasing, ending at
            total_q / total_k. Two sequences [0, 3, 5] (lengths 3 and 2), causal (1 = attend)::

                1 0 0 . .
                1 1 0 . .
                1 1 1 . .
                . . . 1 0
                . . . 1 1

        max_seqlen_q, max_seqlen_k: ints ≥ the longest sequence (flash-attn's window-size clamps use
            max_seqlen_k).
        block_table: paged keys/values (flash-attn's paged KV cache): k, v (num_blocks, page_block_size,
            nheads_k, headdim) and block_table (batch, max_num_blocks_per_seq) int32; sequence b's key t
            is k[block_table[b, t // page_block_size], t % page_block_size] (any page size; gathered into
            the packed layout, a copy of the keys the sequences use).
        Others as :func:`flash_attn_func`; alibi_slopes (nheads,) or (batch, nheads).

    Returns:
        out (total_q, nheads, headdim); with ``return_attn_probs``: softmax_lse (nheads, total_q) and
        S_dmask (batch, nheads, max_seqlen_q, max_seqlen_k) with dropout, else empty.

    >>> q = torch.randn(5, 2, 8); cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    >>> out, lse, _ = flash_attn_varlen_func(q, q, q, cu, cu, 3, 3, causal=True, return_attn_probs=True)
    >>> out.shape, lse.shape
    (torch.Size([5, 2, 8]), torch.Size([2, 5]))
    >>> torch.allclose(out[3:], flash_attn_func(q[None, 3:], q[None, 3:], q[None, 3:], causal=True)[0], atol=1e-6)
    True
    """
    if block_table is not None:  # paged keys/values: gathered into the packed layout
        k, v = unpage(k, v, block_table, cu_seqlens_k)
    p = varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip
    out, lse, probs = attend(p, return_probs=return_attn_probs)
    return _finish(out, lse, probs, q, return_attn_probs, True)


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """:func:`flash_attn_varlen_func` with qkv (total, 3, nheads, headdim) and one cu_seqlens/max_seqlen."""
    _packed("qkv", qkv, 4, 1, 3, "(total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """:func:`flash_attn_varlen_func` with kv (total_k, 2, nheads_k, headdim) stacked."""
    _packed("kv", kv, 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def _packed(name: str, t: object, dim: int, axis: int, n: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != dim or t.shape[axis] != n:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)}")


def install_as_flash_attn() -> types.ModuleType:
    """Make ``import flash_attn`` / ``from flash_attn import flash_attn_func`` (and
    ``flash_attn.flash_attn_interface``) resolve to this module, for code written against flash-attn.
    Only when called; raises ``RuntimeError`` if a real ``flash_attn`` is already imported. Returns the
    module registered as ``flash_attn``.

    >>> import sys; saved = {n: sys.modules.pop(n) for n in ("flash_attn", "flash_attn.flash_attn_interface") if n in sys.modules}
    >>> _ = install_as_flash_attn()
    >>> from flash_attn import flash_attn_func as f
    >>> f is flash_attn_func
    True
    >>> for n in ("flash_attn", "flash_attn.flash_attn_interface"): _ = sys.modules.pop(n)
    >>> sys.modules.update(saved)
    """
    me = sys.modules[__name__]
    current = sys.modules.get("flash_attn")
    if current is not None and current is not me:
        raise RuntimeError(
            f"a flash_attn module is already imported ({getattr(current, '__file__', current)!r})"
        )
    sys.modules["flash_attn"] = me
    sys.modules["flash_attn.flash_attn_interface"] = me
    return me
