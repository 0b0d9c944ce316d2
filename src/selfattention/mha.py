"""Multi-head attention with grouped-query heads and an optional KV cache (lecture 003 §5 → lecture 10).

Lecture 003 computes one set of Q, K, V. Multi-head attention computes H of them side by side ("同时从好几个
不同的角度去检索"), each of size head_dim = embed_dim / H, and mixes the H context vectors with an output
projection W_o (Vaswani et al. 2017, §3.2.2)::

    head_h = Attention(X W_q^h, X W_k^h, X W_v^h)        MultiHead(X) = [head_1; …; head_H] W_o

Grouped-query attention (Ainslie et al. 2023, "GQA") gives the keys and values only Hkv < H heads; query
head h uses key/value head h // (H / Hkv). Hkv = 1 is multi-query attention (Shazeer 2019). The KV
cache (and its memory) shrinks by H / Hkv.

Shapes (batch first, like ``torch.nn.MultiheadAttention(batch_first=True)``)::

    query (B, Tq, E)   key (B, Tk, kdim)   value (B, Tk, vdim)   →   output (B, Tq, E)
    inside: Q (B, H, Tq, D)   K, V (B, Hkv, Tk, D)   weights (B, H, Tq, Tk),   D = E / H
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.attention.bias import CausalBias

from . import _hooks
from . import functional as F
from ._validation import check_bool, check_dropout, check_positive_int, from_causal_bias, symbolic
from .backends import get_backend, scaled_dot_product_attention
from .kv_cache import KVCache
from .visibility import Visibility

__all__ = ["MultiHeadAttention", "merge_masks"]


def _fmt(shape: torch.Size | tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def merge_masks(
    a: torch.Tensor | Visibility | None, b: torch.Tensor | Visibility | None
) -> torch.Tensor | Visibility | None:
    """Combine two masks of this library's convention (bool True = attend, or additive float, or a
    :class:`~selfattention.visibility.Visibility`).

    bool & bool → AND; float + bool → the float with hidden positions set to -inf; float + float → sum;
    a Visibility absorbs a tensor mask (``Visibility.with_mask``).

    >>> merge_masks(torch.tensor([True, False]), torch.tensor([0.5, 0.0]))
    tensor([0.5000,   -inf])
    """
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, Visibility) or isinstance(b, Visibility):
        vis, other = (a, b) if isinstance(a, Visibility) else (b, a)
        if isinstance(other, Visibility):
            raise ValueError("cannot merge two Visibility objects; combine their constraints in one")
        return vis.with_mask(other)
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    if a.dtype == torch.bool:
        a, b = b, a
    if b.dtype == torch.bool:  # a float, b bool
        return torch.where(b, a, torch.full((), -math.inf, dtype=a.dtype, device=a.device))
    return a + b


class MultiHeadAttention(nn.Module):
    """Multi-head (and grouped-/multi-query) scaled dot-product attention with an output projection.

    Args:
        embed_dim: E, features of the query input and of the output.
        num_heads: H query heads; ``embed_dim`` must be divisible by it (head_dim D = E / H).
        num_kv_heads: Hkv key/value heads (default H). Must divide H. Hkv < H is grouped-query
            attention, Hkv = 1 multi-query attention.
        bias: whether the four projections have a bias.
        dropout: probability of dropping an attention weight during training (not applied in eval).
        backend: attention path for the forward (see :mod:`selfattention.backends`); ``None`` = the
            reference (materialising) path. ``"torch"`` runs torch SDPA with our mask semantics.
        kdim, vdim: features of the key and value inputs for cross-attention (default E).

    Parameters: ``q_proj`` (E → E), ``k_proj`` (kdim → Hkv·D), ``v_proj`` (vdim → Hkv·D),
    ``out_proj`` (E → E), all ``nn.Linear``.

    forward(query, key=None, value=None, attn_mask=None, key_padding_mask=None, is_causal=False,
    kv_cache=None, need_weights=False) → ``(output, weights)``:

    * ``query`` (B, Tq, E), or (Tq, E) unbatched. ``key``/``value`` (B, Tk, kdim)/(B, Tk, vdim) for
      cross-attention; omitted (None) for self-attention (key = value = query). If only ``key`` is
      given, ``value = key``.
    * ``attn_mask``: bool, **True = attend** (the opposite of torch MHA), or additive float; shape
      (Tq, Tk) or broadcastable to (B, H, Tq, Tk) (4-D). A 3-D mask is refused as ambiguous. torch's
      ``causal_upper_left``/``causal_lower_right`` objects are accepted (not with ``is_causal=True``).
    * ``key_padding_mask``: (B, Tk), bool **True = real token**, False = padding (torch MHA: True =
      padding — convert with :func:`selfattention.masks.from_torch_mha`), or additive float. With a
      ``kv_cache`` it has shape (B, Tq): one flag per token passed in, remembered by the cache.
    * ``is_causal``: bottom-right aligned causal mask (query i at key position Tk - Tq + i).
    * ``kv_cache`` with ``key``/``value`` (cross-attention, encoder–decoder decoding): the first call (an
      empty cache) projects the encoder's ``key``/``value`` once and stores them with the padding flags
      of ``key_padding_mask``; later calls pass the same encoder output and reuse the cached keys/values
      without projecting again (a ``key`` of another length raises ``ValueError``). No causal placement;
      ``is_causal`` applies as given. The cache's capacity must hold Tk; it may not have a window.
    * ``kv_cache``: a :class:`~selfattention.kv_cache.KVCache` for self-attention decoding. The new
      keys/values are appended and the queries attend over [cache ∪ new], causally at their true
      positions (``kv_cache.offset`` before the call), inside the cache's window if it has one.
      ``is_causal`` is implied. The cache stores detached keys/values: with autograd on, the output is
      differentiable w.r.t. this call's own tokens, the cached past is constant, and no graph is kept
      across steps (see :meth:`KVCache.update <selfattention.kv_cache.KVCache.update>`).
    * ``need_weights``: also return the attention weights (B, H, Tq, Tk), float32 at least, per head
      (torch MHA averages over heads by default; average yourself with ``weights.mean(1)``). This call
      then runs the reference path. Otherwise ``weights`` is ``None``.

    Weights without ``need_weights``: inside :func:`selfattention.capture` the module takes the reference
    path and the trace records every named step (inputs, query, key, value, scores, …, weights, context);
    outside it nothing is recorded and the chosen backend runs.

    Returns ``output`` (B, Tq, E) (same dtype as ``query``) and ``weights`` or ``None``. A query that sees
    no key (all padding) gets a zero context vector, so its output is ``out_proj.bias``.

    Raises:
        TypeError/ValueError: sizes that do not divide, inputs of the wrong rank/size/dtype (naming the
        argument and its shape; a dtype other than the parameters' is a TypeError, e.g. float64 input
        on a float32 module: call ``module.double()``), ``is_causal``/``need_weights`` that are not a
        bool, a cache whose heads/head_dim differ from the module's, a cross-attention cache with a window
        or given a memory of another length.

    Differences from ``torch.nn.MultiheadAttention``: batch first only; bool masks mean True = attend and
    True = real token; separate q/k/v projections (copy torch's ``in_proj_weight`` in three slices);
    ``need_weights`` defaults to False and gives per-head weights; ``is_causal`` really masks (bottom-right);
    GQA and the KV cache are extras.

    >>> _ = torch.manual_seed(0)
    >>> mha = MultiHeadAttention(embed_dim=12, num_heads=4, num_kv_heads=2)
    >>> x = torch.randn(2, 5, 12)                                 # (B, T, E)
    >>> out, w = mha(x, is_causal=True, need_weights=True)
    >>> out.shape, w.shape
    (torch.Size([2, 5, 12]), torch.Size([2, 4, 5, 5]))
    >>> print(w[0, 0].ne(0).int())                                 # causal: query i sees keys 0..i
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1]], dtype=torch.int32)
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        backend: str | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = check_positive_int("embed_dim", embed_dim)
        self.num_heads = check_positive_int("num_heads", num_heads)
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.num_kv_heads = (
            num_heads if num_kv_heads is None else check_positive_int("num_kv_heads", num_kv_heads)
        )
        if num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) "
                "(grouped-query attention shares each key/value head among num_heads / num_kv_heads queries)"
            )
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else check_positive_int("kdim", kdim)
        self.vdim = embed_dim if vdim is None else check_positive_int("vdim", vdim)
        self.dropout = check_dropout(dropout)
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
        if backend is not None:
            get_backend(backend)  # an unknown name fails here, not at the first forward
        self.backend = backend
        kv_dim = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(self.kdim, kv_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, kv_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}"
        if self.backend is not None:
            s += f", backend={self.backend!r}"
        return s

    def new_cache(
        self, batch_size: int, capacity: int, *, window: int | None = None, dtype: torch.dtype | None = None
    ) -> KVCache:
        """A :class:`KVCache` shaped for this module: (batch_size, num_kv_heads, capacity, head_dim)."""
        w = self.k_proj.weight
        return KVCache(
            batch_size,
            self.num_kv_heads,
            self.head_dim,
            capacity,
            window=window,
            dtype=dtype or w.dtype,
            device=w.device,
        )

    # ------------------------------------------------------------------ checks
    def _check_input(self, name: str, t: object, features: int, feature_name: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor, got dtype {t.dtype}; token ids go through an "
                "nn.Embedding first, other integer data needs .float()"
            )
        if t.dim() != 3:
            raise ValueError(
                f"{name} must have shape (B, T, {features}) or (T, {features}), got {_fmt(t.shape)}"
            )
        if t.shape[-1] != features:
            raise ValueError(
                f"{name} has {t.shape[-1]} features (last dim of {_fmt(t.shape)}) but this module's "
                f"{feature_name} is {features}"
            )
        w = self.q_proj.weight
        if t.dtype != w.dtype and not torch.is_autocast_enabled(t.device.type):
            raise TypeError(
                f"{name} has dtype {t.dtype} but this module's parameters are {w.dtype}; convert one of "
                f"them: {name}.to({w.dtype}) or module.to({t.dtype}) (e.g. module.double() for float64)"
            )
        if t.device != w.device:
            raise ValueError(
                f"{name} is on {t.device} but this module's parameters are on {w.device}; move one of them"
            )
        return t

    def _padding(self, kpm: torch.Tensor | None, batch: int, k_len: int) -> torch.Tensor | None:
        if kpm is None:
            return None
        if not isinstance(kpm, torch.Tensor):
            raise TypeError(f"key_padding_mask must be a torch.Tensor or None, got {type(kpm).__name__}")
        if kpm.dtype != torch.bool and not kpm.is_floating_point():
            raise TypeError(
                f"key_padding_mask must be bool (True = real token) or additive float, got {kpm.dtype}"
            )
        if tuple(kpm.shape) != (batch, k_len):
            raise ValueError(
                f"key_padding_mask must have shape (B, Tk) = ({batch}, {k_len}), got {_fmt(kpm.shape)}"
            )
        return kpm[:, None, None, :]  # (B, 1, 1, Tk) broadcasts over heads and queries

    def _attn_mask(
        self, m: torch.Tensor | Visibility | None, is_causal: bool
    ) -> torch.Tensor | Visibility | None:
        if m is None or isinstance(m, Visibility):  # a Visibility (causal at an offset, a window, …) as given
            return m
        if isinstance(m, CausalBias):  # torch's causal_upper_left / causal_lower_right: its Visibility
            return from_causal_bias(m, None, None, is_causal)
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor, a Visibility or None, got {type(m).__name__}")
        if m.dim() == 3:
            raise ValueError(
                f"attn_mask of shape {_fmt(m.shape)} is ambiguous: pass (Tq, Tk) or a 4-D mask "
                "broadcastable to (B, H, Tq, Tk), e.g. mask[:, None] for a per-batch (B, Tq, Tk) mask"
            )
        return m

    def _cross_cached(self, cache, key, value, key_padding_mask, mask, project):
        """Cross-attention over a cache of the encoder's projected keys/values (encoder–decoder decoding):
        the first call (empty cache) projects ``key``/``value`` and stores them with their padding flags;
        later calls reuse them and do not project again, so ``key`` must be the same memory (its length
        is checked). Every query sees every real key (no causal placement: the keys are not a past)."""
        if cache.window is not None:
            raise ValueError(
                "a cross-attention kv_cache holds the encoder's keys: it cannot have a window "
                f"(this one has window={cache.window})"
            )
        tk = key.shape[1]
        if cache.offset == 0:
            k, v = project(key, value)
            k, v, _ = cache.update(k.to(cache.key.dtype), v.to(cache.key.dtype), key_padding_mask)
        else:
            if cache.offset != tk:
                raise ValueError(
                    f"this kv_cache holds the cross-attention keys of a memory of {cache.offset} positions, "
                    f"but key has {tk} (B, Tk, kdim = {_fmt(key.shape)}): pass the same encoder output on "
                    "every step, or a new cache (or cache.reset()) for a new one"
                )
            k, v = cache.keys(), cache.values()
        pad = key_padding_mask if key_padding_mask is not None else cache.real[:, :tk]
        if bool(pad.all()):
            pad = None
        return k, v, merge_masks(mask, self._padding(pad, key.shape[0], tk))

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        attn_mask: torch.Tensor | Visibility | None = None,
        key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        kv_cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        check_bool("is_causal", is_causal)
        check_bool("need_weights", need_weights)
        unbatched = isinstance(query, torch.Tensor) and query.dim() == 2
        if unbatched:
            query = query.unsqueeze(0)
            key = None if key is None else key.unsqueeze(0)
            value = None if value is None else value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        self._check_input("query", query, self.embed_dim, "embed_dim")
        self_attention = key is None and value is None
        if self_attention:
            if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
                raise ValueError(
                    f"self-attention needs kdim == vdim == embed_dim; this module has kdim={self.kdim}, "
                    f"vdim={self.vdim}: pass key and value"
                )
            key = value = query
        elif key is None:
            raise ValueError("value given without key")
        elif value is None:
            value = key
        self._check_input("key", key, self.kdim, "kdim")
        self._check_input("value", value, self.vdim, "vdim")
        batch, q_len = query.shape[0], query.shape[1]
        if key.shape[0] != batch or value.shape[0] != batch or key.shape[1] != value.shape[1]:
            raise ValueError(
                f"query {_fmt(query.shape)}, key {_fmt(key.shape)} and value {_fmt(value.shape)} must share "
                "the batch size B, and key/value the length Tk"
            )
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim

        q = self.q_proj(query).view(batch, q_len, H, D).transpose(1, 2)  # (B, Tq, E) -> (B, H, Tq, D)

        def project(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k = self.k_proj(key).view(batch, key.shape[1], Hkv, D).transpose(1, 2)  # (B, Hkv, Tk, D)
            v = self.v_proj(value).view(batch, key.shape[1], Hkv, D).transpose(1, 2)  # (B, Hkv, Tk, D)
            return k, v

        mask = self._attn_mask(attn_mask, is_causal)
        if kv_cache is not None:
            if not isinstance(kv_cache, KVCache):
                raise TypeError(f"kv_cache must be a KVCache, got {type(kv_cache).__name__}")
            if (kv_cache.num_kv_heads, kv_cache.head_dim, kv_cache.value_dim) != (Hkv, D, D):
                raise ValueError(
                    f"kv_cache holds {kv_cache.num_kv_heads} heads of head_dim {kv_cache.head_dim}, this "
                    f"module has num_kv_heads={Hkv}, head_dim={D}"
                )
            if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
                raise TypeError("with a kv_cache, key_padding_mask must be bool (True = real token)")
        if kv_cache is not None and not self_attention:
            k, v, mask = self._cross_cached(kv_cache, key, value, key_padding_mask, mask, project)
            k, v = k.to(q.dtype), v.to(q.dtype)
            causal = is_causal
        elif kv_cache is not None:
            k, v = project(key, value)
            k, v, cache_mask = kv_cache.update(
                k.to(kv_cache.key.dtype), v.to(kv_cache.key.dtype), key_padding_mask
            )
            k, v = k.to(q.dtype), v.to(q.dtype)
            mask = merge_masks(mask, cache_mask)
            causal = False  # the cache's mask already places the queries at their positions
        else:
            k, v = project(key, value)
            mask = merge_masks(mask, self._padding(key_padding_mask, batch, k.shape[2]))
            causal = is_causal

        dropout_p = self.dropout if self.training else 0.0
        weights = None
        # under torch.compile/export/vmap/trace the reference path, too, is one registered op (the backends'
        # entry point takes it there); weights and traces need the named steps themselves
        reference = self.backend in (None, "reference") and not symbolic()
        if need_weights or _hooks.capturing() or reference:
            with _hooks.inputs(query):
                steps = F.attention_steps(
                    q, k, v, mask, dropout_p, causal, enable_gqa=True, training=self.training
                )
            context = steps.context
            if need_weights:
                weights = steps.weights
        else:
            context = scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=causal,
                enable_gqa=True,
                training=self.training,
                backend=self.backend or "reference",
            )
        out = self.out_proj(context.transpose(1, 2).reshape(batch, q_len, self.embed_dim))  # (B, Tq, E)
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights
