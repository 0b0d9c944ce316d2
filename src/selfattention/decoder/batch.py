"""Batched generation: several prompts of different lengths decoded together, each finishing on its own.

Each prompt is prefilled on its own (no padding to the longest prompt) and joins the per-layer ragged
caches (:class:`~selfattention.KVCache` with ``ragged=True`` or ``page_size=``, :meth:`KVCache.assign`), so
row b holds only its own tokens, at its own positions, and every decode step is one batched forward of B
single tokens (a finished row is padding). A sequence that reaches its ``max_new_tokens`` or emits
``stop_token`` is finished: its row is padding from then on (its cache takes nothing more). Each sequence
draws its random numbers from its own generator, seeded ``sampling.seed + b``: sequence b's tokens are
exactly those of ``generate(model, prompts[b], …, sampling=Sampling(…, seed=seed + b))`` run alone, cached
or not (``selfattention generate --check`` verifies it for every prompt).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from .model import Decoder
from .sampling import GREEDY, Sampling, next_tokens

__all__ = ["generate_batch", "sequence_sampling"]


def sequence_sampling(sampling: Sampling, b: int) -> Sampling:
    """The :class:`Sampling` sequence ``b`` of a batch follows (its own seed, ``seed + b``)."""
    return sampling if sampling.greedy else replace(sampling, seed=sampling.seed + b)


@torch.inference_mode()
def generate_batch(
    model: Decoder,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    max_new_tokens: int | Sequence[int],
    *,
    sampling: Sampling = GREEDY,
    stop_token: int | None = None,
    page_size: int | None = None,
    use_cache: bool = True,
    on_token: Callable[[int, int], None] | None = None,
) -> list[list[int]]:
    """Generate for several prompts at once → each sequence's new token ids (a list per prompt).

    Args:
        model: a :class:`~selfattention.decoder.model.Decoder` (put in eval mode here).
        prompts: B sequences of token ids, each of length ≥ 1; lengths may differ.
        max_new_tokens: an int for every sequence, or one per sequence.
        sampling: :class:`Sampling`; sequence b uses seed ``sampling.seed + b`` (:func:`sequence_sampling`).
        stop_token: a sequence that emits this id finishes (the id is included in its output).
        page_size: store the caches in pages of this size (default contiguous); same tokens either way.
        use_cache: False recomputes the right-padded batch for every step (no cache; the oracle).
        on_token: called with (sequence index, token id) for every new token.

    Raises ``ValueError`` naming the prompt for an empty prompt or one that does not fit the context with
    its new tokens, and for a ``max_new_tokens`` list of the wrong length or with negative entries.

    >>> from selfattention.decoder import generate, load_checkpoint, shipped_checkpoint
    >>> model, tok, _ = load_checkpoint(shipped_checkpoint())
    >>> outs = generate_batch(model, [tok.encode("The "), tok.encode("In the ")], [12, 5])
    >>> [len(o) for o in outs]
    [12, 5]
    >>> outs[1] == generate(model, tok.encode("In the "), 5).tolist()
    True
    """
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling must be a selfattention.decoder.Sampling, got {type(sampling).__name__}")
    model.eval()
    dev = model.head.weight.device
    ids = [torch.as_tensor(p, dtype=torch.int64).flatten().tolist() for p in prompts]
    if not ids:
        raise ValueError("prompts must hold at least one prompt")
    b_n = len(ids)
    if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool):
        counts = [max_new_tokens] * b_n
    else:
        counts = list(max_new_tokens)
        if len(counts) != b_n:
            raise ValueError(f"max_new_tokens has {len(counts)} entries for {b_n} prompts")
    ctx = model.config.context
    for b, (p, n) in enumerate(zip(ids, counts, strict=True)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"max_new_tokens[{b}] must be an int >= 0, got {n!r}")
        if not p:
            raise ValueError(f"prompt {b} is empty")
        if len(p) + n > ctx:
            raise ValueError(
                f"prompt {b} ({len(p)} tokens) + {n} new tokens = {len(p) + n} exceed the model's context of {ctx}"
            )
    gens = (
        None
        if sampling.greedy
        else [torch.Generator().manual_seed(sequence_sampling(sampling, b).seed) for b in range(b_n)]
    )
    lens = [len(p) for p in ids]
    t_max = max(lens)
    batch = torch.zeros(b_n, t_max, dtype=torch.int64)
    for b, p in enumerate(ids):
        batch[b, : len(p)] = torch.tensor(p)
    real = torch.arange(t_max)[None] < torch.tensor(lens)[:, None]  # (B, T_max), right padding
    batch, real = batch.to(dev), real.to(dev)
    rows = torch.arange(b_n, device=dev)
    outs: list[list[int]] = [[] for _ in ids]
    active = [n > 0 for n in counts]
    caches = None
    if use_cache:
        cap = max(len(p) + n for p, n in zip(ids, counts, strict=True))
        caches = model.new_caches(b_n, cap, ragged=True, page_size=page_size)
        # prefill each prompt on its own (no padding to the longest), then it joins the batch's caches
        last = []
        for b, p in enumerate(ids):
            own = model.new_caches(1, len(p), ragged=True)  # (ragged: a window masks, evicts nothing)
            last.append(model(torch.tensor([p], device=dev), own)[0, -1])
            for c, o in zip(caches, own, strict=True):
                c.assign(b, o.keys()[0], o.values()[0])
        logits = torch.stack(last)  # (B, vocab)
    else:
        logits = model(batch, key_padding_mask=real)[rows, torch.tensor(lens, device=dev) - 1]
    while any(active):
        live = [b for b in range(b_n) if active[b]]
        pick = next_tokens(
            logits[live].float().cpu(), sampling, None if gens is None else [gens[b] for b in live]
        )
        step = torch.zeros(b_n, dtype=torch.int64)
        for b, t in zip(live, pick.tolist(), strict=True):
            outs[b].append(t)
            step[b] = t
            if on_token is not None:
                on_token(b, t)
            if len(outs[b]) == counts[b] or t == stop_token:
                active[b] = False
                for c in caches or ():
                    c.finish(b)
        if not any(active):
            break
        feed = torch.tensor(active, device=dev)[:, None]  # (B, 1): the rows still generating
        if use_cache:
            logits = model(step[:, None].to(dev), caches, feed)[:, -1]
        else:
            seqs = [ids[b] + outs[b] for b in range(b_n)]
            lens = [len(s) for s in seqs]
            t_max = max(lens)
            full = torch.zeros(b_n, t_max, dtype=torch.int64)
            for b, s in enumerate(seqs):
                full[b, : len(s)] = torch.tensor(s)
            mask = torch.arange(t_max)[None] < torch.tensor(lens)[:, None]
            logits = model(full.to(dev), key_padding_mask=mask.to(dev))[
                rows, torch.tensor(lens, device=dev) - 1
            ]
    return outs
