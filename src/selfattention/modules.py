"""``torch.nn`` modules that wrap the math of :mod:`selfattention.functional`.

* :class:`SimpleSelfAttention` — lecture 000's parameter-free Z = softmax(X Xᵀ) X.
* :class:`SelfAttention` — lecture 003's single head with learnable W_query, W_key, W_value.
* :class:`selfattention.mha.MultiHeadAttention` (in ``mha.py``) — H heads, grouped-query K/V heads, an
  output projection, padding masks and a :class:`selfattention.kv_cache.KVCache`.
"""

from __future__ import annotations

import torch
from torch import nn

from . import _hooks
from . import functional as F
from ._validation import check_positive_int
from .backends import scaled_dot_product_attention

__all__ = ["SimpleSelfAttention", "SelfAttention"]


def _check_x(x: object, d_in: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must have shape (..., T, d_in), got shape {tuple(x.shape)}")
    if d_in is not None and x.shape[-1] != d_in:
        raise ValueError(f"x has {x.shape[-1]} features in its last dim, this module expects d_in={d_in}")
    return x


class SimpleSelfAttention(nn.Module):
    """Parameter-free self-attention (lecture 000): query = key = value = x, no scaling.

    forward(x): x (..., T, d) → Z (..., T, d) = softmax(X Xᵀ) X. Has no parameters.

    >>> SimpleSelfAttention()(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    tensor([[0.7311, 0.2689],
            [0.2689, 0.7311]])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_x(x)
        with _hooks.inputs(x):
            return F.simple_attention(x)


class SelfAttention(nn.Module):
    """Scaled dot-product self-attention with learnable projections (lecture 003 §3).

    Q = X·W_query, K = X·W_key, V = X·W_value (each an ``nn.Linear(d_in, d_out)``), then
    softmax(Q Kᵀ/√d_out) V.

    Args:
        d_in: features per input token.
        d_out: features of query, key, value and of the output (the head_dim).
        qkv_bias: whether the three projections have a bias.
        backend: attention backend name (see :mod:`selfattention.backends`); ``None`` = reference.
            Inside :func:`selfattention.capture` the reference path runs, so the trace has every step.

    forward(x, attn_mask=None, is_causal=False): x (..., T, d_in) → context vectors (..., T, d_out).
    ``attn_mask`` is bool (True = attend) or additive float, broadcastable to (..., T, T).

    >>> torch.manual_seed(0) and None
    >>> layer = SelfAttention(d_in=4, d_out=2)
    >>> layer(torch.randn(3, 4)).shape
    torch.Size([3, 2])
    """

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False, backend: str | None = None) -> None:
        super().__init__()
        self.d_in = check_positive_int("d_in", d_in)
        self.d_out = check_positive_int("d_out", d_out)
        self.backend = backend
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        _check_x(x, self.d_in)
        query = self.W_query(x)  # (..., T, d_out)
        key = self.W_key(x)  # (..., T, d_out)
        value = self.W_value(x)  # (..., T, d_out)
        # inside capture() the reference path runs, so the trace has the steps of this very call
        backend = None if _hooks.capturing() else self.backend
        with _hooks.inputs(x):
            return scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, is_causal=is_causal, backend=backend
            )

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"
