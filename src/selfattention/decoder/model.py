"""The model of :mod:`selfattention.decoder`: a character tokenizer, the sizes, and the decoder itself.

Architecture (pre-LayerNorm, as GPT-2; Radford et al. 2019)::

    ids (B, T) ─► token embedding + learned position embedding ─► x (B, T, d_model)
    N × [ x = x + MHA(LN(x), causal)      x = x + MLP(LN(x)),  MLP = Linear(d, 4d) · GELU · Linear(4d, d) ]
    LN ─► Linear(d_model, vocab) ─► logits (B, T, vocab)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .. import masks
from .._validation import check_positive_int
from ..kv_cache import KVCache
from ..mha import MultiHeadAttention

__all__ = ["CharTokenizer", "DecoderConfig", "Decoder"]


# --------------------------------------------------------------------------------------------- tokenizer
class CharTokenizer:
    """One token per character of a fixed alphabet.

    >>> tok = CharTokenizer("abc ")
    >>> tok.encode("cab a")
    [3, 1, 2, 0, 1]
    >>> tok.decode([3, 1, 2])
    'cab'

    ``encode`` raises ``ValueError`` naming characters outside the alphabet.
    """

    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("the alphabet must not repeat characters")
        self.chars = "".join(sorted(chars))
        self._index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self._index})
        if unknown:
            raise ValueError(
                f"text contains characters the model's alphabet does not have: {''.join(unknown)!r} "
                f"(the alphabet has {self.vocab_size} characters, those of the training text)"
            )
        return [self._index[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


# ----------------------------------------------------------------------------------------------- model
@dataclass
class DecoderConfig:
    """Sizes of a :class:`Decoder`. ``context`` = number of learned positions (longest sequence);
    ``window`` = optional sliding attention window; ``backend`` = attention path (see backends)."""

    vocab_size: int
    context: int = 256
    d_model: int = 128
    num_heads: int = 4
    num_kv_heads: int | None = None
    num_layers: int = 4
    mlp_ratio: int = 4
    window: int | None = None
    backend: str | None = "tiled"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "d_model", "num_heads", "num_layers", "mlp_ratio"):
            check_positive_int(name, getattr(self, name))
        if self.window is not None:
            check_positive_int("window", self.window)


class Block(nn.Module):
    """Pre-LN transformer block: x + MHA(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = MultiHeadAttention(
            cfg.d_model, cfg.num_heads, num_kv_heads=cfg.num_kv_heads, backend=cfg.backend
        )
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        key_padding_mask: torch.Tensor | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        a, _ = self.attn(
            self.ln1(x),
            attn_mask=attn_mask,
            is_causal=is_causal,
            key_padding_mask=key_padding_mask,
            kv_cache=kv_cache,
        )
        x = x + a
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """A GPT-like causal language model on :class:`MultiHeadAttention` (see the module docstring).

    forward(ids, caches=None, key_padding_mask=None) → logits:

    * ``ids``: int64 (B, T) token ids.
    * ``caches``: None (the whole sequence, causal) or one :class:`KVCache` per layer from
      :meth:`new_caches`; the ids are then the next T tokens, at positions ``caches[0].offset …``.
    * ``key_padding_mask``: bool (B, T), True = real token (right padding without a cache, and with
      ragged caches: row b's real tokens first, stored at its own positions ``lengths[b] …``).
    * Returns float logits (B, T, vocab_size).

    Raises ``ValueError`` when positions would exceed ``config.context`` or ids are out of range.

    >>> _ = torch.manual_seed(0)
    >>> model = Decoder(DecoderConfig(vocab_size=10, context=16, d_model=8, num_heads=2, num_layers=1))
    >>> model(torch.tensor([[1, 2, 3]])).shape
    torch.Size([1, 3, 10])
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def new_caches(
        self,
        batch_size: int,
        capacity: int | None = None,
        *,
        ragged: bool = False,
        page_size: int | None = None,
    ) -> list[KVCache]:
        """One :class:`KVCache` per layer (capacity defaults to ``config.context``; the config's window).

        ``ragged`` / ``page_size``: per-sequence lengths (and paged storage) for batched generation of
        prompts of different lengths (see :class:`KVCache`); the capacity is rounded up to whole pages."""
        cfg = self.config
        capacity = cfg.context if capacity is None else capacity
        if cfg.window is not None:
            capacity = max(capacity if capacity is not None else 0, cfg.window)
        if not (ragged or page_size is not None):
            return [b.attn.new_cache(batch_size, capacity, window=cfg.window) for b in self.blocks]
        if page_size is not None:
            capacity = -(-capacity // page_size) * page_size
        w = self.head.weight
        return [
            KVCache(
                batch_size,
                b.attn.num_kv_heads,
                b.attn.head_dim,
                capacity,
                window=cfg.window,
                dtype=w.dtype,
                device=w.device,
                ragged=True,
                page_size=page_size,
            )  # fmt: skip
            for b in self.blocks
        ]

    def forward(
        self,
        ids: torch.Tensor,
        caches: Sequence[KVCache] | None = None,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be an int64 tensor of shape (B, T), got {getattr(ids, 'shape', ids)}")
        B, T = ids.shape
        cfg = self.config
        if T and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
            raise ValueError(
                f"token ids must be in [0, {cfg.vocab_size}), got min {int(ids.min())}, max {int(ids.max())}"
            )
        if caches is not None and len(caches) != len(self.blocks):
            raise ValueError(f"need one KVCache per layer ({len(self.blocks)}), got {len(caches)}")
        if caches is not None and caches[0].ragged:
            # per-sequence positions: row b's tokens sit at lengths[b] + 0 … (its real ones, see KVCache)
            pos = caches[0].positions_per_sequence(T).to(ids.device)  # (B, T)
            real = T if key_padding_mask is None else key_padding_mask.sum(1)
            last = int((caches[0].lengths.to(ids.device) + real).max()) if B else 0
            if last > cfg.context:
                raise ValueError(
                    f"positions up to {last - 1} exceed the model's context of {cfg.context} positions"
                )
            pos = pos.clamp(max=cfg.context - 1)  # padding rows past the end: any valid position
        else:
            offset = 0 if caches is None else caches[0].offset
            if offset + T > cfg.context:
                raise ValueError(
                    f"positions {offset}..{offset + T - 1} exceed the model's context of {cfg.context} positions"
                )
            pos = torch.arange(offset, offset + T, device=ids.device)
        x = self.tok_emb(ids) + self.pos_emb(pos)  # (B, T, d_model)
        attn_mask, is_causal = None, True
        if caches is None and cfg.window is not None:
            attn_mask, is_causal = masks.sliding_window_mask(T, T, cfg.window, device=ids.device), False
        for i, block in enumerate(self.blocks):
            x = block(x, attn_mask, is_causal, key_padding_mask, None if caches is None else caches[i])
        return self.head(self.ln_f(x))  # (B, T, vocab)
