"""Ready score mods (see :mod:`selfattention.mods`) and the attention-sink rescaling."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "softcap",
    "relative_position_bias",
    "t5_bucket",
    "attention_sink",
]


def _opt_int(name: str, x, lo: int = 0) -> None:
    if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < lo):
        raise ValueError(f"{name} must be an int >= {lo} or None, got {x!r}")


class ScoreMod:
    """Base of the ready score mods. ``bias(b, h, q_idx, kv_idx)``: the additive bias when the mod is
    ``score + bias`` (then the engine hands it to the fused kernel as a bias tile), else None."""

    def bias(self, b, h, q_idx, kv_idx):
        return None

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.bias(b, h, q_idx, kv_idx)


@dataclass(frozen=True, eq=False)
class Alibi(ScoreMod):
    """ALiBi (Press et al. 2022, "Train Short, Test Long"): score + m_h · (kv − q) for head h's slope m_h
    (a linear penalty on distance; ``symmetric``: − m_h · |kv − q| for bidirectional encoders)."""

    slopes: torch.Tensor = field(repr=False)
    symmetric: bool = False

    def bias(self, b, h, q_idx, kv_idx):
        d = (kv_idx - q_idx).to(self.slopes.dtype)
        return self.slopes[h] * (-d.abs() if self.symmetric else d)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The paper's head slopes: 2^(−8/n), 2^(−16/n), … for n a power of two; otherwise those of the
    largest power of two below n, then every other slope of the next power of two (Press et al. 2022)."""
    _opt_int("alibi_slopes: n_heads", n_heads, 1)

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    p = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = powers(p)
    if p < n_heads:
        slopes += powers(2 * p)[0::2][: n_heads - p]
    return torch.tensor(slopes)


def alibi(slopes: torch.Tensor, symmetric: bool = False) -> Alibi:
    """ALiBi score mod with per-head ``slopes`` (H,) (may be a learnable parameter: it gets its gradient)."""
    if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1 or not slopes.is_floating_point():
        raise TypeError("alibi: slopes must be a 1-D float tensor (H,)")
    return Alibi(slopes, bool(symmetric))


@dataclass(frozen=True)
class Softcap(ScoreMod):
    """Tanh soft-capping: cap · tanh(score / cap) (Gemma 2, Gemma Team 2024; Grok-1)."""

    cap: float

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.cap * torch.tanh(score / self.cap)


def softcap(cap: float) -> Softcap:
    """Soft-capping of the scores at ±``cap`` (> 0); Gemma 2 uses 50 for attention."""
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 0 or not math.isfinite(cap):
        raise ValueError(f"softcap: cap must be a positive finite number, got {cap!r}")
    return Softcap(float(cap))


def t5_bucket(
    relative_position: torch.Tensor,
    num_buckets: int = 32,
    max_distance: int = 128,
    bidirectional: bool = True,
) -> torch.Tensor:
    """T5's bucket of ``relative_position = kv − q`` (Raffel et al. 2020): exact buckets for small
    distances, logarithmic ones up to ``max_distance``, the sign in a separate half when bidirectional."""
    n = relative_position
    ret = torch.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        ret = ret + (n > 0).long() * num_buckets
        n = n.abs()
    else:
        n = (-n).clamp(min=0)
    exact = num_buckets // 2
    small = n < exact
    far = n.clamp(min=1).to(torch.float32)
    large = exact + (torch.log(far / exact) / math.log(max_distance / exact) * (num_buckets - exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return ret + torch.where(small, n, large)


@dataclass(frozen=True, eq=False)
class RelativePositionBias(ScoreMod):
    """T5's learned relative position bias: score + table[bucket(kv − q), h] (Raffel et al. 2020;
    Shaw et al. 2018). ``table`` (num_buckets, H), as ``relative_attention_bias.weight`` in T5."""

    table: torch.Tensor = field(repr=False)
    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True

    def bias(self, b, h, q_idx, kv_idx):
        bucket = t5_bucket(kv_idx - q_idx, self.num_buckets, self.max_distance, self.bidirectional)
        return self.table[bucket, h]


def relative_position_bias(
    table: torch.Tensor, num_buckets: int | None = None, max_distance: int = 128, bidirectional: bool = True
) -> RelativePositionBias:
    """T5 relative position bias from a (num_buckets, H) table (learnable: it gets its gradient)."""
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.is_floating_point():
        raise TypeError("relative_position_bias: table must be a float tensor (num_buckets, H)")
    nb = table.shape[0] if num_buckets is None else num_buckets
    if nb != table.shape[0]:
        raise ValueError(f"relative_position_bias: num_buckets={nb} but the table has {table.shape[0]} rows")
    return RelativePositionBias(table, nb, max_distance, bidirectional)


def attention_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Learnable attention sinks (gpt-oss, OpenAI 2025; "StreamingLLM", Xiao et al. 2023): one extra logit
    in every softmax denominator, attached to no value — one per head s_h (gpt-oss' ``s_aux``) or one per
    query s_bhi (``sinks``). With the attention's output O and log-sum-exp ℓ (``return_lse``), the
    sink-attended output is exactly O · e^ℓ / (e^ℓ + e^s) = O · σ(ℓ − s): no mask column, no (Tq, Tk + 1)
    tensor, gradients to O, ℓ and the sinks. A row that sees no key (ℓ = −inf) stays 0, whatever its sink.

    Args:
        out: (B, H, T, Dv); lse: (B, H, T) natural log (−inf: a row that sees no key);
        sinks: (H,) logits per head, or per query (B or 1, H, T or 1, 1) (also without the last 1).

    Raises:
        ValueError: ``sinks`` of any other shape (named with the expected one).
    """
    b, h, t = out.shape[-4] if out.dim() >= 4 else 1, out.shape[-3], out.shape[-2]
    if sinks.dim() == 1 and sinks.shape[0] == h:
        s = sinks[:, None]  # (H, 1)
    elif (
        sinks.dim() in (3, 4)
        and (sinks.dim() == 3 or sinks.shape[-1] == 1)
        and sinks.shape[0] in (1, b)
        and sinks.shape[1] == h
        and sinks.shape[2] in (1, t)
    ):
        s = sinks if sinks.dim() == 3 else sinks[..., 0]  # (B or 1, H, T or 1)
    else:
        raise ValueError(
            f"attention_sink: sinks must have shape ({h},) or (B, {h}, {t}, 1) with B in (1, {b}), "
            f"got {tuple(sinks.shape)}"
        )
    z = lse.to(s.dtype)
    # a blind row: σ(−inf) = 0 with gradient 0 (even with a −inf sink: no NaN through z − s)
    w = torch.sigmoid(torch.where(z == -math.inf, z, z - s))  # (B, H, T)
    return out * w[..., None].to(out.dtype)
