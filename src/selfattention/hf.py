"""This library's attention as a drop-in attention backend for any Hugging Face ``transformers`` model.

>>> import selfattention.hf                                                   # doctest: +SKIP
>>> name = selfattention.hf.register()                                        # doctest: +SKIP
>>> model = AutoModel.from_pretrained(path, attn_implementation=name)         # doctest: +SKIP
>>> model.set_attn_implementation("selfattention")                            # doctest: +SKIP

:func:`register` registers two functions under the name ``"selfattention"``: :func:`attention_forward`
with ``transformers.AttentionInterface`` and :func:`attention_mask` with ``AttentionMaskInterface``.
**Both are needed**: for a name that has no mask function transformers builds no mask at all, so padding
would be attended to. :func:`attention_forward` refuses to run in that case (``RuntimeError``).

The mask function returns a lazy :class:`~selfattention.hf_recipe.LazyMask` (a Visibility: causal at the
cache's offset, the sliding window, chunks and packed sequences as documents, padding as a key-only
(B, 1, 1, Tk) mask, anything else a per-block predicate), never a dense (B, 1, Tq, Tk) mask; the call
runs on the block engine (:func:`~selfattention.hf_masks.engine_attention`), soft-capping as a score
mod, sinks (per head or per query) as out · σ(lse − sink), a position bias as one fused call (or, when it
requires grad, as :mod:`selfattention.kernels.biased`'s large ops: its gradient is dS). The weights
(``output_attentions``, :func:`selfattention.capture`), soft-capping under dropout, a :data:`BACKEND`
other than ``"tiled"`` and compiled graphs take the materialising route (:mod:`selfattention.hf_dense`,
:func:`selfattention.functional.attention_steps`) with the dense mask, as transformers' sdpa would.

What transformers passes, and what happens to it (everything else raises ``TypeError`` naming it):

==================  =========================================================================================
argument            meaning here
==================  =========================================================================================
attention_mask      bool (True = attend, from :func:`attention_mask`) or additive float (e.g. a custom 4-D
                    mask), broadcastable to (B, H, Tq, Tk); ``None``: see "mask-less calls" below.
scaling             the factor on Q Kᵀ (``None``: 1/√head_dim).
dropout             attention-weight dropout, applied only when ``module.training``.
is_causal           overrides ``module.is_causal``; only used when no mask is given (as transformers' sdpa).
sliding_window      the mask transformers builds already hides keys outside the window; a mask-less causal
                    call applies it here (query i sees keys i − W + 1 … i).
softcap             scores → softcap · tanh(scores / softcap) before the mask (Gemma 2).
position_bias       added to the scaled scores (T5 and other relative-position models); gets its gradient.
s_aux, sinks        attention-sink logits, one per head (``s_aux``, shape (H,)) or per query (``sinks``,
                    (B, H, Tq, 1)): an extra key every query sees with that logit and a zero value, so
                    the weights of a row sum to less than 1 (gpt-oss).
indices             (B, Tq, K) integer: the K keys each query may see (DeepSeek sparse attention's
                    indexer), ANDed with the mask — the dense mask, as transformers' eager/sdpa form it
                    (no mask: with the mask-less rule below, causal top-left or every key).
block_indices       (B, H_idx, Tq, K) integer: the K key *blocks* each query may see, −1 for none
                    (MiniMax M3's block-sparse indexer; blocks of ``module.indexer.block_size`` keys,
                    one selection per group of H / H_idx query heads), ANDed with the mask the same way.
output_attentions   return the weights (also when transformers collects attentions otherwise).
GQA                 fewer key/value heads than query heads: grouped-query attention, no copies.
==================  =========================================================================================

Ignored because they describe nothing the mask does not already say (they serve flash-attention
kernels, packed batches, caches or outputs, or were consumed before the call): ``position_ids``,
``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``, ``seq_idx``,
``cache_position``, ``use_cache``, ``output_hidden_states``, ``output_router_logits``,
``num_items_in_batch``, ``layer_idx``, ``return_dict``, ``encoder_hidden_states`` and
``encoder_attention_mask`` (the keys, values and mask were already made from them), ``logits_to_keep``
(which of the last hidden states the LM head reads: GOT-OCR2 hands it down to every layer),
``token_type_ids``
(a tokenizer's segment ids that some models hand down to every layer; segments enter through the
embeddings, not the attention), ``deterministic``
(a flash-attention switch for a deterministic backward; this library has no non-deterministic kernel
of its own to switch). A ``None`` value of any argument counts as not given.

**Mask-less calls**, exactly as transformers' ``sdpa`` path treats them: transformers passes no mask when
``is_causal`` (or SDPA's top-left causal alignment) says everything. A causal call with Tq > 1 is causal
aligned **top-left** (query i sees keys 0 … i): with a static cache the keys are padded to the cache
length (Tq = 8, Tk = 27 at prefill) and only the first Tq are real, so they are cut to Tq, as
transformers' sdpa does. With Tq = 1 every key is visible. This is the one place where the integration
departs from this library's bottom-right rule, because the caller means top-left.

Weights (``output_attentions=True``) come back in the query's dtype (the model's), (B, H, Tq, Tk);
without them the fast path runs and ``None`` is returned, as transformers' sdpa does.

Sources: transformers 5.x ``integrations/sdpa_attention.py`` (the mask-less rules), ``masking_utils.py``
(the masks), Gemma 2 (soft-capping, Team Gemma 2024 §2), T5 (relative position bias, Raffel et al. 2020
§2.1), gpt-oss (attention sinks, OpenAI 2025; Xiao et al. 2023).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from . import _hooks, hf_dense
from ._validation import check_dropout
from .backends import scaled_dot_product_attention
from .functional import attention_steps, attention_weights
from .hf_masks import engine_attention
from .hf_maskview import MaskView
from .hf_maskview import plain as plain_tensor
from .hf_recipe import LazyMask, mask_function
from .visibility import Visibility

__all__ = [
    "BACKEND",
    "NAME",
    "AttentionCall",
    "attention_forward",
    "attention_mask",
    "recording",
    "register",
    "using",
    "wants_weights",
]

NAME = "selfattention"
"""The name under which :func:`register` makes our attention known to transformers."""

BACKEND = "tiled"
"""The backend of :func:`selfattention.scaled_dot_product_attention` that runs the fast path."""

IGNORED = frozenset(
    {
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
        "cache_position",
        "use_cache",
        "output_hidden_states",
        "output_router_logits",
        "num_items_in_batch",
        "layer_idx",
        "return_dict",
        "encoder_hidden_states",
        "encoder_attention_mask",
        "deterministic",
        "token_type_ids",
        "logits_to_keep",
    }
)
"""Arguments transformers may pass that do not change attention once the mask is built (see above)."""

_mask_names_ok: set[str] = set()  # attention implementations whose mask function we have seen registered
_calls: ContextVar[list[AttentionCall] | None] = ContextVar("selfattention_hf_calls", default=None)


@dataclass
class AttentionCall:
    """One attention call as :func:`attention_forward` handed it to the library (see :func:`recording`).

    ``query`` (B, H, Tq, D), ``key``/``value`` (B, Hkv, Tk', D) and ``attn_mask`` / ``is_causal`` /
    ``scale`` / ``enable_gqa`` are exactly the arguments of :func:`selfattention.scaled_dot_product_attention`
    (after the mask-less rules, soft-capping written into the mask, a sink appended as a last key); a
    lazy mask is recorded as its key-only padding mask and ``is_causal`` when that says everything
    (bottom-right causal, no window, documents or predicate), else as its dense bool mask.
    ``n_keys`` is the number of the model's own keys (Tk' − 1 with a sink).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    n_keys: int

    def weights(self, head: int | None = None) -> torch.Tensor:
        """The attention weights of this call, (B, H, Tq, n_keys), or of one query ``head``
        (B, Tq, n_keys), float32 at least. Materialises Tq × Tk per head, for that head only."""
        q, k, mask = self.query, self.key, self.attn_mask
        if head is not None:
            group = q.shape[-3] // k.shape[-3]
            q, k = q[:, head : head + 1], k[:, head // group : head // group + 1]
            if isinstance(mask, torch.Tensor) and mask.dim() >= 3 and mask.shape[-3] > 1:
                mask = mask[..., head : head + 1, :, :]
        w = attention_weights(
            q, k, mask, self.is_causal, self.scale, enable_gqa=head is None and self.enable_gqa
        )
        w = w[..., : self.n_keys]
        return w if head is None else w[:, 0]


@contextmanager
def recording() -> Iterator[list[AttentionCall]]:
    """Collect an :class:`AttentionCall` for every call of :func:`attention_forward` inside the block,
    without materialising anything (the fast path still runs). Used to compute statistics of long inputs
    head by head, or layer by layer, afterwards."""
    calls: list[AttentionCall] = []
    token = _calls.set(calls)
    try:
        yield calls
    finally:
        _calls.reset(token)


def _import_transformers() -> None:
    # Nothing here needs the network. The user's environment is theirs: no variable is set (a process-wide
    # HF_HUB_OFFLINE would break their own from_pretrained and reach child processes); where this library
    # loads something itself it passes local_files_only=True (selfattention.pretrained).
    import transformers  # noqa: F401


def attention_mask(*args: Any, **kwargs: Any) -> LazyMask:
    """The mask function registered with our attention (``AttentionMaskInterface``, ``sdpa_mask``'s
    signature): a :class:`~selfattention.hf_recipe.LazyMask` — causal at the cache's offset, sliding
    window, chunks or packed sequences as documents, padding as a key-only (B, 1, 1, Tk) mask, anything
    else as a per-block predicate — never a dense (B, 1, Tq, Tk) tensor (see :mod:`selfattention.hf_recipe`).
    """
    return mask_function(*args, **kwargs)


def register() -> str:
    """Register :func:`attention_forward` and :func:`attention_mask` with transformers as ``"selfattention"``.

    Idempotent. Returns the name, for ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)``. Imports transformers (the slow part, once).

    Raises:
        ImportError: transformers is not installed.
    """
    _import_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)
    _mask_names_ok.add(NAME)
    return NAME


def _check_mask_function(module: torch.nn.Module) -> None:
    """A mask-less call is only trustworthy if the model's attention name has a mask function."""
    config = getattr(module, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl is None or impl in _mask_names_ok:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    if impl in ALL_MASK_ATTENTION_FUNCTIONS:
        _mask_names_ok.add(impl)
        return
    raise RuntimeError(
        f"The attention implementation {impl!r} has no mask function registered, so transformers passed "
        "no mask and padding would be attended to. Register both functions with "
        "selfattention.hf.register() (name 'selfattention'), or also call "
        f"AttentionMaskInterface.register({impl!r}, selfattention.hf.attention_mask)."
    )


def wants_weights(kwargs: dict[str, Any]) -> bool:
    """Whether this call must return the attention weights: ``output_attentions=True`` was passed, or
    transformers is collecting attentions (``output_attentions`` set in the config), or a
    :func:`selfattention.capture` block is recording."""
    if kwargs.get("output_attentions") or _hooks.capturing():
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - older transformers: only the keyword tells
        return False
    collected = _active_collector.get()
    return bool(collected) and any(k.endswith("attentions") for k in collected)


def _refuse_unknown(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        if value is None or name in IGNORED or name == "output_attentions":
            continue
        raise TypeError(
            f"selfattention.hf.attention_forward does not implement the argument {name!r} (passed by "
            f"{type(module).__name__}) and refuses to drop it silently. Run this model with "
            "attn_implementation='eager', or open an issue."
        )


def _top_left(q_len: int, k_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Bool (Tq, Tk), True = attend: query i sees keys max(0, i − W + 1) … i (top-left aligned)."""
    return Visibility(q_len, k_len, is_causal=True, window=window, q_offset=0).structure(device)


def _recorded(lazy: LazyMask) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) of an AttentionCall for a lazy mask: O(Tk) when it can be, else dense."""
    vis = lazy.visibility
    bottom_right = not vis.is_causal or vis.offset == vis.k_len - vis.q_len
    if vis.window is None and vis.q_doc is None and vis.mod is None and bottom_right:
        return vis.attn_mask, vis.is_causal
    return lazy.to_dense(), False


def _check_number(name: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    block_indices: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function transformers calls (``AttentionInterface`` signature, as its ``sdpa``).

    Args:
        module: the calling attention layer: ``training`` gates dropout, ``is_causal`` is read for
            mask-less calls, ``config._attn_implementation`` is checked for a mask function.
        query: (B, H, Tq, D). key: (B, Hkv, Tk, D). value: (B, Hkv, Tk, Dv). H a multiple of Hkv.
        attention_mask: bool (True = attend) or additive float, broadcastable to (B, H, Tq, Tk), or
            ``None`` (mask-less call: see the module doc for the exact rules).
        dropout: probability of dropping a weight, only when ``module.training``.
        scaling: factor on Q Kᵀ; ``None`` = 1/√D.
        is_causal, sliding_window, position_bias, softcap, s_aux, sinks, indices, block_indices: see the
            module doc.
        **kwargs: ``output_attentions`` and the ignored names of the module doc; anything else raises.

    Returns:
        ``(context, weights)``: context vectors (B, Tq, H, Dv) in the query's dtype, the layout
        transformers reshapes to (B, Tq, H·Dv); weights (B, H, Tq, Tk) in the query's dtype when they
        were asked for (:func:`wants_weights`), else ``None``.

    Raises:
        TypeError: an argument this function does not implement (named), or a mask that is not a tensor.
        ValueError: bad shapes, dtypes or values (named; from the library's checks), a non-positive
            softcap or sliding_window, a non-causal mask-less call whose sliding window would hide keys.
        RuntimeError: a mask-less call for an attention name without a registered mask function.
    """
    _refuse_unknown(module, kwargs)
    attention_mask = plain_tensor(attention_mask) if isinstance(attention_mask, MaskView) else attention_mask
    want = wants_weights(kwargs)
    lazy = attention_mask if isinstance(attention_mask, LazyMask) else None
    if attention_mask is not None and lazy is None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__} (a "
            "flex-attention BlockMask comes from the 'flex_attention' mask function: register "
            "selfattention.hf.attention_mask with this attention instead)"
        )
    for name, sel in (("indices", indices), ("block_indices", block_indices)):
        # sparse attention: only the selected keys, within the mask (dense, as sdpa's)
        if sel is None:
            continue
        b, tq, tk = query.shape[0], query.shape[-2], key.shape[-2]
        if attention_mask is None:  # the mask-less call's own rule (below): causal top-left, or every key
            flag = is_causal if is_causal is not None else getattr(module, "is_causal", True)
            causal = bool(flag) and tq > 1
            rule = _top_left(tq, tk, None, query.device) if causal else torch.ones(tq, tk, dtype=torch.bool)
            attention_mask = rule.to(query.device)[None, None]
        if name == "indices":
            keep = hf_dense.selected_keys(sel, b, tq, tk, query.device)
        else:
            size = hf_dense.index_block_size(module)
            keep = hf_dense.selected_blocks(sel, size, query.shape[-3], b, tq, tk, query.device)
        mask = attention_mask.to_dense() if lazy is not None else attention_mask
        attention_mask = mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, -math.inf)
        lazy = None
    if softcap is not None:
        softcap = _check_number("softcap", softcap)
    if sliding_window is not None:
        sliding_window = int(_check_number("sliding_window", sliding_window))
    q_len, k_len = query.shape[-2], key.shape[-2]
    training = bool(getattr(module, "training", False))
    calls = None if torch.compiler.is_compiling() else _calls.get()  # (recording(): not in compiled graphs)
    # the weights, a recording, per-query sinks and softcap with dropout take the materialising route
    # (a recording of a lazy mask without softcap, sinks or bias keeps its Visibility: nothing materialised)
    sink = _sink_logits(s_aux, sinks, query)  # checked here: (1 or B, H, 1 or Tq, 1) or None
    plain = softcap is None and sink is None and position_bias is None
    dense = (
        want
        or (calls is not None and not (plain and lazy is not None))
        or min(query.shape) == 0
        or min(key.shape) == 0
    )
    dense = dense or (softcap is not None and training and dropout > 0) or torch.compiler.is_compiling()
    dense = dense or BACKEND != "tiled"  # another backend chosen: it gets the dense mask, as before
    fast = dict(dropout_p=check_dropout(dropout) if training else 0.0, softcap=softcap, sinks=sink)
    if lazy is not None and lazy.shape[-2:] != (q_len, k_len) and lazy.batch_size in (1, query.shape[0]):
        if all(n in (1, want_n) for n, want_n in zip(lazy.shape[-2:], (q_len, k_len), strict=True)):
            # a mask made for one key (or query) where the call has more: broadcast over them, as eager and
            # sdpa do (MiniMax sizes its full-attention mask against a linear layer's cache: Tk = 1 while
            # decoding)
            small = lazy.to_dense()
            attention_mask = small.expand(*small.shape[:-2], q_len, k_len)
            lazy = None
    if lazy is not None:
        if lazy.shape[-2:] != (q_len, k_len) or lazy.batch_size not in (1, query.shape[0]):
            raise ValueError(
                f"attention_mask is a LazyMask for (B, Tq, Tk) = ({lazy.batch_size}, {lazy.shape[-2]}, "
                f"{lazy.shape[-1]}) but query/key have ({query.shape[0]}, {q_len}, {k_len})"
            )
        if not dense:
            if calls is not None:
                gqa = key.shape[-3] != query.shape[-3]
                calls.append(AttentionCall(query, key, value, *_recorded(lazy), scaling, gqa, k_len))
            context = engine_attention(
                query,
                key,
                value,
                lazy.visibility,
                scaling,
                position_bias=position_bias,
                cache=lazy.cache,
                **fast,
            )
            return context.transpose(1, 2).contiguous(), None
        attention_mask = lazy.to_dense()
    full_k_len = k_len  # weights are returned over every key passed in, even the ones cut below
    mask = attention_mask
    causal = False
    if mask is None:
        _check_mask_function(module)
        flag = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(flag) and q_len > 1
        if causal and k_len > q_len:
            # static cache: keys padded to the cache length; top-left causal sees only the first Tq
            key, value = key[..., :q_len, :], value[..., :q_len, :]
            if position_bias is not None:
                position_bias = position_bias[..., :q_len]
            k_len = q_len
        if causal and (k_len < q_len or (sliding_window is not None and q_len > sliding_window)):
            mask, causal = _top_left(q_len, k_len, sliding_window, query.device), False
        elif not causal and sliding_window is not None and max(q_len, k_len) > sliding_window:
            # the window shows a query the W keys up to its own position: a key W or more positions
            # back is hidden, which happens as soon as there are more than W positions
            raise ValueError(
                f"a mask-less non-causal call with sliding_window={sliding_window} and {q_len} queries × "
                f"{k_len} keys: the window would hide keys, but without a mask its alignment is not "
                "defined; pass the mask (selfattention.hf.attention_mask builds it)"
            )

    canonical = mask is None or (mask.dim() == 4 and mask.shape[0] in (1, query.shape[0]))
    if not dense and canonical and (softcap is not None or position_bias is not None or sink is not None):
        vis = Visibility(q_len, k_len, is_causal=causal, attn_mask=mask)
        context = engine_attention(query, key, value, vis, scaling, position_bias=position_bias, **fast)
        return context.transpose(1, 2).contiguous(), None

    scale = scaling
    bias = None
    if softcap is not None:
        # Gemma 2: scores = softcap · tanh(Q Kᵀ · scale / softcap); they enter the softmax as an additive
        # bias with the library's own scale set to 0 (so its Q Kᵀ term vanishes)
        bias = hf_dense.softcapped_scores(query, key, scaling, softcap)
        scale = 0.0
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    if bias is not None or sink is not None:
        mask, causal = hf_dense.additive_mask(mask, bias, causal, q_len, k_len, query.device), False
    if sink is not None:
        mask, key, value = hf_dense.with_sink(mask, sink, key, value, q_len, k_len)

    enable_gqa = key.shape[-3] != query.shape[-3]
    if calls is not None:
        calls.append(AttentionCall(query, key, value, mask, causal, scale, enable_gqa, k_len))
    weights = None
    args = dict(attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scale, enable_gqa=enable_gqa)
    if want:
        with _hooks.muted():
            steps = attention_steps(query, key, value, **args, training=training)
        _hooks.record(hf_dense.honest_steps(steps, softcap, scaling, sink is not None, k_len))
        context = steps.context
        weights = steps.weights[..., :k_len].to(query.dtype)
        if full_k_len > k_len:  # keys of empty static-cache slots: weight 0
            weights = torch.nn.functional.pad(weights, (0, full_k_len - k_len))
    else:
        context = scaled_dot_product_attention(query, key, value, **args, training=training, backend=BACKEND)
    # (B, H, Tq, Dv) -> (B, Tq, H, Dv): the layout transformers reshapes to (B, Tq, H·Dv)
    return context.transpose(1, 2).contiguous(), weights


def _sink_logits(
    s_aux: torch.Tensor | None, sinks: torch.Tensor | None, query: torch.Tensor
) -> torch.Tensor | None:
    """The sink logits as (1 or B, H, 1 or Tq, 1), or None."""
    if s_aux is not None and sinks is not None:
        raise ValueError("give the attention sinks once: s_aux (per head) or sinks (per query), not both")
    if s_aux is not None:
        if not isinstance(s_aux, torch.Tensor) or s_aux.numel() != query.shape[-3]:
            got = tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else s_aux
            raise ValueError(f"s_aux must hold one sink logit per query head ({query.shape[-3]}), got {got}")
        return s_aux.reshape(1, -1, 1, 1)
    if sinks is not None:
        b, h, tq = query.shape[0], query.shape[-3], query.shape[-2]
        if (
            not isinstance(sinks, torch.Tensor)
            or sinks.dim() != 4
            or sinks.shape[-1] != 1
            or sinks.shape[0] not in (1, b)
            or sinks.shape[1] != h
            or sinks.shape[2] not in (1, tq)
        ):
            got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else sinks
            raise ValueError(
                f"sinks must be a tensor of shape (B, H, Tq, 1) = ({b}, {h}, {tq}, 1), got {got}"
            )
        return sinks
    return None


@contextmanager
def using(model: Any, name: str = NAME) -> Iterator[Any]:
    """Temporarily switch ``model`` to the attention implementation ``name`` (default: ours), e.g. to
    compare with ``"eager"`` on the very same weights; the previous implementation is restored after."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
