"""Generation for :class:`~selfattention.decoder.model.Decoder`: greedy or sampled, with or without the cache.

With the cache, the prompt is prefilled once and each new token costs one single-token step (O(T));
without, the whole sequence is recomputed for every token (O(T²)). Both see the same logits (to float
rounding), and sampling draws its random numbers from a seeded generator in the same order either way,
so both give the same tokens: the tests and ``selfattention generate --check`` verify it.

Sampling, per step and batch row (Holtzman et al. 2020 for top-p):

1. ``logits / temperature`` (``temperature = 0``: greedy, the arg-max; nothing random is drawn);
2. keep the ``top_k`` largest (``None``: all), then the smallest set of the most likely tokens whose
   probabilities sum to at least ``top_p`` (``1.0``: all);
3. draw ``u ~ U[0, 1)`` from the generator and take the first token whose cumulative probability
   exceeds ``u`` (inverse-CDF sampling: one uniform number per row and step).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .model import Decoder

__all__ = ["Sampling", "GREEDY", "next_tokens", "generate"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
        temperature: ``0.0`` = greedy (arg-max); ``> 0`` divides the logits before the softmax (below 1
            sharpens, above 1 flattens).
        top_k: keep only the ``top_k`` most likely tokens (``None`` = all); an int ≥ 1.
        top_p: keep the most likely tokens until their probabilities reach ``top_p`` (nucleus sampling),
            in (0, 1]; ``1.0`` = all.
        seed: seed of the ``torch.Generator`` the uniform draws come from.

    Raises ``ValueError`` naming the argument for a negative or non-finite temperature, ``top_k < 1``,
    ``top_p`` outside (0, 1], a seed that is not an int, and for ``top_k``/``top_p`` given with greedy
    decoding (they would be silently ignored).

    >>> Sampling(temperature=0.8, top_k=40).greedy
    False
    >>> Sampling(top_k=5)
    Traceback (most recent call last):
    ...
    ValueError: top_k=5 has no effect with greedy decoding (temperature=0); give a temperature > 0 to sample
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k must be an int >= 1 or None (all tokens), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = all tokens), got {p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if t == 0:
            for name, value, default in (("top_k", k, None), ("top_p", p, 1.0)):
                if value != default:
                    raise ValueError(
                        f"{name}={value!r} has no effect with greedy decoding (temperature=0); "
                        "give a temperature > 0 to sample"
                    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        """One line for people: ``greedy`` or ``sampled: temperature 0.8, top-k 40, top-p 0.95, seed 0``."""
        from ..i18n import _

        if self.greedy:
            return _("greedy (arg-max)")
        parts = [_("temperature {value:g}").format(value=self.temperature)]
        if self.top_k is not None:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1:
            parts.append(f"top-p {self.top_p:g}")
        return _("sampled: {parts}, seed {seed}").format(parts=_(", ").join(parts), seed=self.seed)


GREEDY = Sampling()


def next_tokens(
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | Sequence[torch.Generator] | None,
) -> torch.Tensor:
    """Choose one token per row of ``logits`` (float (B, vocab)) as :class:`Sampling` says → int64 (B,).

    ``generator`` supplies the uniform draws (one per row); it is not used when greedy. A sequence of B
    generators draws row b's number from generator b (batched sequences that each follow their own seed).

    >>> logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])
    >>> next_tokens(logits, GREEDY, None).tolist()
    [1, 0]
    >>> g = torch.Generator().manual_seed(0)
    >>> next_tokens(logits, Sampling(temperature=1.0, top_k=1), g).tolist()  # top-1 = the arg-max
    [1, 0]
    """
    if sampling.greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1)  # (B, vocab), float64
    order = probs.argsort(dim=-1, descending=True, stable=True)
    sorted_p = probs.gather(-1, order)  # (B, vocab), most likely first
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if sampling.top_k is not None:
        keep[:, sampling.top_k :] = False
    if sampling.top_p < 1:
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        keep &= before < sampling.top_p  # the most likely token is always kept
    sorted_p = sorted_p * keep
    cdf = sorted_p.cumsum(-1)
    cdf = cdf / cdf[:, -1:]  # renormalise over the kept tokens
    if isinstance(generator, torch.Generator) or generator is None:
        u = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64)  # (B, 1)
    else:
        if len(generator) != logits.shape[0]:
            raise ValueError(f"{len(generator)} generators for {logits.shape[0]} rows of logits")
        u = torch.cat([torch.rand(1, 1, generator=g, dtype=torch.float64) for g in generator])
    pick = (cdf <= u).sum(-1).clamp(max=logits.shape[-1] - 1)  # first index with cdf > u
    # a kept token always has cdf > u before the dropped tail, whose cdf stays at 1.0
    return order.gather(-1, pick[:, None])[:, 0]


@torch.inference_mode()
def generate(
    model: Decoder,
    prompt: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    sampling: Sampling = GREEDY,
    on_token: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Append ``max_new_tokens`` tokens chosen by ``sampling`` (greedy by default).

    Args:
        model: a :class:`~selfattention.decoder.model.Decoder` (put in eval mode here).
        prompt: int ids, (T,) or (B, T) with T ≥ 1.
        max_new_tokens: how many tokens to generate; prompt + new must fit ``config.context``.
        use_cache: prefill a :class:`~selfattention.KVCache` per layer and decode one token per step
            (O(T) per step); False recomputes the whole sequence each step (O(T²) per step). The same
            tokens either way, for greedy and for sampled decoding with the same seed.
        sampling: :class:`Sampling` (temperature, top-k, top-p, seed); :data:`GREEDY` by default.
        on_token: called with each new token id of batch row 0 (for streaming output).

    Returns:
        The new ids, int64 (B, max_new_tokens) (or (max_new_tokens,) for a 1-D prompt).

    Raises ``ValueError`` if the prompt is empty, ``max_new_tokens`` is not an int ≥ 0, or prompt + new
    tokens exceed the context.
    """
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling must be a selfattention.decoder.Sampling, got {type(sampling).__name__}")
    model.eval()
    ids = torch.as_tensor(prompt, dtype=torch.int64)
    squeeze = ids.dim() == 1
    if squeeze:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(
            f"prompt must be a non-empty (T,) or (B, T) sequence of ids, got shape {tuple(ids.shape)}"
        )
    n = max_new_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {n!r}")
    ctx = model.config.context
    if ids.shape[1] + n > ctx:
        raise ValueError(
            f"prompt ({ids.shape[1]} tokens) + {n} new tokens = {ids.shape[1] + n} exceed the model's context "
            f"of {ctx} positions"
        )
    ids = ids.to(model.head.weight.device)
    gen = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
    out = torch.empty(ids.shape[0], n, dtype=torch.int64, device=ids.device)
    if use_cache:
        caches = model.new_caches(ids.shape[0], ids.shape[1] + n)
        logits = model(ids, caches)[:, -1]  # prefill: (B, vocab) at the last prompt position
    seq = ids
    for i in range(n):
        if not use_cache:
            logits = model(seq)[:, -1]  # recompute everything
        nxt = next_tokens(logits.cpu(), sampling, gen).to(ids.device)  # (B,)
        out[:, i] = nxt
        if on_token is not None:
            on_token(int(nxt[0]))
        if i + 1 < n:
            if use_cache:
                logits = model(nxt[:, None], caches)[:, -1]
            else:
                seq = torch.cat([seq, nxt[:, None]], dim=1)
    return out[0] if squeeze else out
