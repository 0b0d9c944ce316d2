"""flash-attn's arguments checked and turned into one canonical problem (:class:`Problem`).

Facts taken from flash-attn 2's public interface and its C++ argument handling (read, not copied):
``window_size`` entries ≥ the key length mean "infinite" (−1); ``causal`` sets the right window to 0; a
one-sided window gets the key length on its other side; causal and windows are aligned bottom-right per
sequence (query i at key position i + seqlen_k − seqlen_q); ALiBi adds −slope·|i + seqlen_k − seqlen_q − j|
after the softcap ``cap · tanh(score · scale / cap)``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .._validation import check_bool, check_dropout
from ..kvcache_args import as_int as _int
from ..kvcache_args import window_pair as _window

__all__ = ["Problem", "dense_problem", "unpage", "varlen_problem"]


@dataclass
class Problem:
    """One flash-attn call in the engine's layout: q (B, H, Tq, D), k/v (B, Hkv, Tk, D) (views, B = 1 for
    varlen), and where each query and key sits."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    left: int  # window after flash-attn's normalisation: −1/−1 = none, else both ≥ 0
    right: int
    softcap: float
    alibi: torch.Tensor | None  # (B or batch, H) slopes
    dropout_p: float
    # varlen: per token, the sequence (int64) and the position (query: aligned on its keys)
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0

    @property
    def varlen(self) -> bool:
        return self.cu_q is not None

    @property
    def windowed(self) -> bool:
        return self.left >= 0 or self.right >= 0


def _tensor(name: str, t: object, dim: int, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(
            f"{name} must be a floating tensor (float16, bfloat16, float32, float64), got {t.dtype}"
        )
    if t.dim() != dim:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(t.shape)} ({t.dim()} dims)")
    return t


def _same(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qn: str, kn: str, vn: str) -> None:
    for n, t in ((kn, k), (vn, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{n} has dtype {t.dtype} but {qn} has {q.dtype}: they must match")
        if t.device != q.device:
            raise ValueError(f"{n} is on {t.device} but {qn} is on {q.device}: they must match")


def _heads(qn: str, kn: str, h: int, hk: int, d: int, dk: int, dv: int, vn: str) -> None:
    if dk != d or dv != d:
        raise ValueError(f"headdim mismatch: {qn} has {d}, {kn} has {dk}, {vn} has {dv} (they must be equal)")
    if hk == 0 or h % hk != 0:
        raise ValueError(
            f"nheads_k={hk} must divide nheads={h} ({kn}/{vn} heads shared by groups of query heads)"
        )


def _normalise(left: int, right: int, causal: bool, sk: int) -> tuple[int, int]:
    """flash-attn's rules: ≥ seqlen_k is infinite; causal = right window 0; a one-sided window gets
    seqlen_k on its other side."""
    if left >= sk:
        left = -1
    if right >= sk:
        right = -1
    if causal:
        right = 0
    if left < 0 and right >= 0:
        left = sk
    elif left >= 0 and right < 0:
        right = sk
    return left, right


def _common(
    dropout_p, softmax_scale, causal, softcap, deterministic, return_attn_probs, d
) -> tuple[float, float]:
    p = check_dropout(dropout_p)
    check_bool("causal", causal)
    check_bool("deterministic", deterministic)
    check_bool("return_attn_probs", return_attn_probs)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap):
        raise TypeError(f"softcap must be a finite float (0.0 = off), got {softcap!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0.0 = off), got {softcap}")
    if softmax_scale is None:
        scale = d**-0.5 if d > 0 else 1.0
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
        scale = float(softmax_scale)
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return p, scale


def _alibi(alibi_slopes: object, batch: int, h: int, device: torch.device) -> torch.Tensor | None:
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor) or not alibi_slopes.is_floating_point():
        raise TypeError(
            f"alibi_slopes must be a float tensor (nheads,) or (batch, nheads), got {alibi_slopes!r}"
        )
    if tuple(alibi_slopes.shape) not in ((h,), (batch, h)):
        raise ValueError(
            f"alibi_slopes must have shape ({h},) or ({batch}, {h}) (nheads,) / (batch, nheads), "
            f"got {tuple(alibi_slopes.shape)}"
        )
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    return alibi_slopes.reshape(-1, h)


def dense_problem(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    return_attn_probs,
) -> Problem:
    """q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim)."""
    lay_q, lay_k = "(batch, seqlen_q, nheads, headdim)", "(batch, seqlen_k, nheads_k, headdim)"
    q, k, v = _tensor("q", q, 4, lay_q), _tensor("k", k, 4, lay_k), _tensor("v", v, 4, lay_k)
    _same(q, k, v, "q", "k", "v")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape {lay_k}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"batch size mismatch: q has {q.shape[0]}, k/v have {k.shape[0]}")
    _heads("q", "k", q.shape[2], k.shape[2], q.shape[3], k.shape[3], v.shape[3], "v")
    p, scale = _common(
        dropout_p, softmax_scale, causal, softcap, deterministic, return_attn_probs, q.shape[3]
    )
    left, right = _window(window_size)
    tq, tk = q.shape[1], k.shape[1]
    if tq == 1 and alibi_slopes is None:
        causal = False  # flash-attn: causal is the same as non-causal for one query (bottom-right)
    left, right = _normalise(left, right, causal, tk)
    return Problem(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, left, right, float(softcap),
        _alibi(alibi_slopes, q.shape[0], q.shape[2], q.device), p,
    )  # fmt: skip


def _cu(name: str, cu: object, total: int, device: torch.device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"{name} must be 1-D of shape (batch_size + 1,) with batch_size >= 1, got {tuple(cu.shape)}"
        )
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")
    c = cu.to(torch.int64)
    first, last = int(c[0]), int(c[-1])
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {first}")
    steps = c[1:] - c[:-1]
    if bool((steps < 0).any()):
        i = int(torch.nonzero(steps < 0)[0])
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{i}] = {int(c[i])} > {name}[{i + 1}] = {int(c[i + 1])}"
        )
    if last != total:
        raise ValueError(f"{name} must end at the number of tokens ({total}), got {name}[-1] = {last}")
    return c


def _max_seqlen(name: str, m: object, cu: torch.Tensor, cu_name: str) -> int:
    m = _int(name, m)
    lens = cu[1:] - cu[:-1]
    longest = int(lens.max())
    if m < longest:
        i = int(torch.argmax(lens))
        raise ValueError(f"{name}={m} is smaller than sequence {i}'s length {longest} (from {cu_name})")
    return m


def varlen_problem(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
    window_size, softcap, alibi_slopes, deterministic, return_attn_probs, names=("q", "k", "v"),
) -> Problem:  # fmt: skip
    """q (total_q, nheads, headdim), k/v (total_k, nheads_k, headdim), cu_seqlens (batch + 1,) int32."""
    qn, kn, vn = names
    lay_q, lay_k = "(total_q, nheads, headdim)", "(total_k, nheads_k, headdim)"
    q, k, v = _tensor(qn, q, 3, lay_q), _tensor(kn, k, 3, lay_k), _tensor(vn, v, 3, lay_k)
    _same(q, k, v, qn, kn, vn)
    if k.shape != v.shape:
        raise ValueError(f"{kn} {tuple(k.shape)} and {vn} {tuple(v.shape)} must have the same shape {lay_k}")
    _heads(qn, kn, q.shape[1], k.shape[1], q.shape[2], k.shape[2], v.shape[2], vn)
    cq = _cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
    ck = _cu("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
    if cq.numel() != ck.numel():
        raise ValueError(
            f"cu_seqlens_q has {cq.numel() - 1} sequences but cu_seqlens_k has {ck.numel() - 1}: they must match"
        )
    mq = _max_seqlen("max_seqlen_q", max_seqlen_q, cq, "cu_seqlens_q")
    mk = _max_seqlen("max_seqlen_k", max_seqlen_k, ck, "cu_seqlens_k")
    p, scale = _common(
        dropout_p, softmax_scale, causal, softcap, deterministic, return_attn_probs, q.shape[2]
    )
    left, right = _window(window_size)
    if mq == 1 and alibi_slopes is None:
        causal = False
    left, right = _normalise(left, right, causal, mk)
    return Problem(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale, left, right,
        float(softcap), _alibi(alibi_slopes, cq.numel() - 1, q.shape[1], q.device), p, cq, ck, mq, mk,
    )  # fmt: skip


def unpage(k, v, block_table, cu_seqlens_k) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged keys/values (flash-attn's paged KV cache) gathered into the packed (total_k, nheads_k, headdim)
    layout: sequence b's key t is k[block_table[b, t // page], t % page]. k/v (num_blocks, page_block_size,
    nheads_k, headdim); block_table (batch, max_num_blocks_per_seq) int32. Differentiable (a gather)."""
    lay = "(num_blocks, page_block_size, nheads_k, headdim) with block_table"
    k, v = _tensor("k", k, 4, lay), _tensor("v", v, 4, lay)
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape {lay}")
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
        raise TypeError(
            f"block_table must be an int32 tensor (batch, max_num_blocks_per_seq), got {block_table!r}"
        )
    if block_table.dim() != 2:
        raise ValueError(
            f"block_table must be 2-D (batch, max_num_blocks_per_seq), got {tuple(block_table.shape)}"
        )
    if block_table.device != k.device:
        raise ValueError(f"block_table is on {block_table.device} but k is on {k.device}")
    if not isinstance(cu_seqlens_k, torch.Tensor):
        raise TypeError(
            f"cu_seqlens_k must be a torch.Tensor of dtype int32, got {type(cu_seqlens_k).__name__}"
        )
    total = int(cu_seqlens_k[-1]) if cu_seqlens_k.numel() else 0
    ck = _cu("cu_seqlens_k", cu_seqlens_k, total, k.device)
    n, page = ck.numel() - 1, k.shape[1]
    if block_table.shape[0] != n:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but cu_seqlens_k has {n} sequences")
    lens = ck[1:] - ck[:-1]
    room = block_table.shape[1] * page
    if bool((lens > room).any()):
        i = int(torch.argmax(lens))
        raise ValueError(
            f"sequence {i} has {int(lens[i])} keys but block_table holds {room} (its row's pages)"
        )
    seq = torch.repeat_interleave(torch.arange(n, device=k.device), lens)
    j = torch.arange(total, device=k.device) - ck[seq]
    blocks = block_table.long()[seq, j // page]
    if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= k.shape[0]):
        raise ValueError(f"block_table refers to blocks outside 0 … {k.shape[0] - 1}")
    idx = blocks * page + j % page
    return k.flatten(0, 1)[idx], v.flatten(0, 1)[idx]
