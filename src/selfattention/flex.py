"""torch's flex_attention API on this library's block engine — forward **and backward** on CPU (and CUDA
through torch ops), with one import changed::

    from torch.nn.attention.flex_attention import flex_attention, create_block_mask   # before
    from selfattention import flex_attention, create_block_mask                        # after

Semantics are torch 2.13's (``torch.nn.attention.flex_attention``; Dong et al. 2024, "Flex Attention"):
scores = scale · q·k, then ``score_mod(score, b, h, q_idx, kv_idx)``, then the block mask (a key is visible
iff its block is full, or partial and ``mask_mod(b, h, q_idx, kv_idx)`` is True), softmax, values. The
log-sum-exp is in natural log; a query row that sees no key gets output 0, lse −inf (and zero gradient).

How it runs:

* the mask: a :class:`BlockMask` from :func:`create_block_mask` over one of the ready mods of
  :mod:`selfattention.mods` (causal at an offset, sliding windows, documents, packed sequences, and their
  :func:`~selfattention.mods.and_masks`) is recognised and planned as today's fast structural plans; any
  other mask_mod (and torch's own ``BlockMask``) is planned block by block from the BlockMask's tables:
  full blocks through the fused kernel without a bias, partial blocks with their tile of the predicate,
  empty blocks never computed;
* the score mod: an additive bias (a ready mod that says so, or a function whose code is ``score ± terms
  free of score``: :func:`selfattention.mods.additive.is_additive`) that captures no tensor requiring
  grad becomes a bias tile of the fused kernel;
  anything else runs in :mod:`selfattention.kernels.scored` (per query block, checkpointed), where
  autograd reaches every tensor the mod closes over.

Differences from torch's flex (documented, tested): the backward works on CPU; ``kernel_options`` keys are
Triton tuning knobs, accepted and ignored (they do not change results), unknown keys raise;
``max_scores`` is supported (torch raises on CPU) and sends the call to the score-mod kernel; the BlockMask
must have been made for exactly (Q_LEN, KV_LEN).

Under ``torch.compile`` / ``torch.export`` / ``torch.func`` transforms (:func:`selfattention._validation.symbolic`)
the call is torch's own ``flex_attention`` with the same arguments (our :func:`create_block_mask` returns
torch's ``BlockMask``): torch's compiled flex is the vendor kernel there, with torch's limits (see docs/flex.md).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask
from torch.nn.attention.flex_attention import flex_attention as _torch_flex

from ._validation import autocast_cast, autocast_dtype, resolve_scale, symbolic
from .flex_masks import create_block_mask, create_mask, positional_args, takes, visibility_of
from .kernels import engine, scored
from .kernels.plan import row_spans
from .mods import ScoreMod, and_masks, noop_mask, or_masks
from .mods.additive import is_additive
from .visibility import Predicate, evaluate_mod

__all__ = [
    "flex_attention",
    "create_block_mask",
    "create_mask",
    "and_masks",
    "or_masks",
    "noop_mask",
    "BlockMask",
    "AuxRequest",
    "AuxOutput",
    "KERNEL_OPTIONS",
    "FlexPlan",
    "describe",
]


_TUNING = (
    "num_warps", "num_stages", "BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2",
    "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS", "WRITE_DQ", "FORCE_USE_FLEX_ATTENTION",
    "USE_TMA", "kpack", "matrix_instr_nonkdim", "waves_per_eu",
)  # fmt: skip
KERNEL_OPTIONS = frozenset(
    _TUNING + tuple(f"{p}_{k}" for p in ("fwd", "bwd") for k in _TUNING) + ("BACKEND",)
)
"""torch's FlexKernelOptions keys (also with ``fwd_``/``bwd_``): Triton tuning and backend choices that
do not change results here, so they are no-ops. Other keys are ignored too, as torch's eager flex ignores
them, with a warning naming them (a typo is not silent)."""
_BACKENDS = ("AUTO", "TRITON", "TRITON_DECODE", "FLASH")


# ---------------------------------------------------------------------------------------------------------
# Score mods
# ---------------------------------------------------------------------------------------------------------


class _BiasOf:
    """An additive score_mod as the bias function (b, h, q_idx, kv_idx) of a Predicate."""

    def __init__(self, score_mod: Callable) -> None:
        self.score_mod = score_mod

    def __call__(self, b, h, q_idx, kv_idx):
        if isinstance(self.score_mod, ScoreMod):
            return self.score_mod.bias(b, h, q_idx, kv_idx)
        shape = (b.shape[0], h.shape[1], q_idx.shape[2], kv_idx.shape[3])
        return evaluate_mod(self.score_mod, b, h, q_idx, kv_idx, score=torch.zeros(shape, device=b.device))


def _as_bias(score_mod: Callable, b: int, h: int, tq: int, tk: int, device) -> Callable | None:
    """The bias function of an additive score_mod whose captured tensors need no grad, else None.
    A user's function must be additive by its code (:func:`selfattention.mods.additive.is_additive`: a
    probe on sample scores cannot tell ``score.clamp(-50, 50)`` from ``score``); the probe tile of random
    rows, keys and scores below then checks the bias function itself."""
    if isinstance(score_mod, ScoreMod) and type(score_mod).bias is ScoreMod.bias:
        return None  # a ready non-additive mod (softcap)
    if not isinstance(score_mod, ScoreMod) and not is_additive(score_mod):
        return None  # not provably score + bias: the score-mod kernel sees the real scores
    gen = torch.Generator().manual_seed(0)
    rows = torch.randperm(tq, generator=gen)[:16].sort().values
    cols = torch.randperm(tk, generator=gen)[:16].sort().values
    idx = (
        torch.arange(b, device=device).view(-1, 1, 1, 1),
        torch.arange(h, device=device).view(1, -1, 1, 1),
        rows.to(device).view(1, 1, -1, 1),
        cols.to(device).view(1, 1, 1, -1),
    )
    shape = (b, h, rows.numel(), cols.numel())
    s = (torch.randn(shape, generator=gen) * 8).to(device)
    with torch.enable_grad():
        bias = _BiasOf(score_mod)(*idx)
        if not isinstance(bias, torch.Tensor) or bias.requires_grad:
            return None  # it closes over a tensor that requires grad: autograd must see it
        out = evaluate_mod(score_mod, *idx, score=s)
    if out.requires_grad or not bias.is_floating_point():
        return None
    out, want = out.double(), (s + bias.to(s.dtype)).double()
    same = (out == want) | (torch.isnan(out) & torch.isnan(want))
    close = torch.isclose(out, want, rtol=1e-6, atol=1e-6)
    return _BiasOf(score_mod) if bool((same | close).all()) else None


# ---------------------------------------------------------------------------------------------------------
# flex_attention
# ---------------------------------------------------------------------------------------------------------


def _check_options(kernel_options) -> None:
    if kernel_options is None:
        return
    if not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    for key in ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX"):
        if key in kernel_options:
            raise ValueError(f"kernel_options: {key} is set internally; use return_aux=AuxRequest(...)")
    unknown = sorted(set(kernel_options) - KERNEL_OPTIONS)
    if unknown:  # torch passes any key on to its kernels (inductor's own: IS_DIVISIBLE, …): so do we
        warnings.warn(
            f"kernel_options: {unknown} are not torch's FlexKernelOptions keys; ignored here (torch hands "
            "them to its Triton kernels)",
            stacklevel=3,
        )
    if "BACKEND" in kernel_options and kernel_options["BACKEND"] not in _BACKENDS:
        raise ValueError(
            f"kernel_options: BACKEND must be one of {_BACKENDS}, got {kernel_options['BACKEND']!r}"
        )


def _check_qkv(query, key, value, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, T, D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key, value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"query, key, value must be on one device, got {query.device}, {key.device}, {value.device}"
        )
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same head_dim, got {query.shape[-1]} and {key.shape[-1]}"
        )
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree in (B, Hkv, S)")
    hq, hk = query.shape[1], key.shape[1]
    if not enable_gqa and hq != hk:
        raise ValueError(f"query has {hq} heads but key/value {hk}: set enable_gqa=True for grouped heads")
    if enable_gqa and hq % hk != 0:
        raise ValueError(f"enable_gqa: query heads ({hq}) must be a multiple of key/value heads ({hk})")
    if key.shape[0] not in (1, query.shape[0]):
        raise ValueError(f"key/value batch {key.shape[0]} must be 1 or the query's {query.shape[0]}")


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    *,
    return_aux: AuxRequest | None = None,
):
    """torch's ``flex_attention`` (same signature and semantics) with a backward on every device.

    Args:
        query: (B, H, L, E); key: (B or 1, Hkv, S, E); value: (B or 1, Hkv, S, Ev); one floating dtype.
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score`` applied to the scaled scores, or None.
        block_mask: from :func:`create_block_mask` (ours or torch's), or None (every key visible).
        scale: None = 1/√E.
        enable_gqa: H a multiple of Hkv (query head h uses key/value head h // (H / Hkv)).
        return_lse: also return the log-sum-exp (B, H, L) (torch deprecates it for ``return_aux``).
        kernel_options: torch's Triton knobs: accepted, no effect here (see :data:`KERNEL_OPTIONS`).
        return_aux: ``AuxRequest(lse=..., max_scores=...)`` → ``(out, AuxOutput(lse, max_scores))``.

    Returns:
        out (B, H, L, Ev) in query's dtype; with lse / aux as torch returns them (natural log, float32 at
        least; rows with no visible key: out 0, lse −inf, max −inf). Gradients reach query, key, value,
        the lse's users and any tensor the score_mod closes over.
        Under ``torch.autocast`` query, key and value are cast to its dtype first, as torch's flex.

    Raises:
        TypeError, ValueError: bad shapes, dtypes, devices, a block mask for other lengths, unknown
            kernel_options, both return_lse and return_aux.

    >>> from selfattention.mods import causal_mask
    >>> q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    >>> flex_attention(q, q, 2 * q, block_mask=create_block_mask(causal_mask, 1, 1, 2, 2, device="cpu"))
    tensor([[[[2.0000, 0.0000],
              [0.6605, 1.3395]]]])
    """
    cast = autocast_dtype(query)
    if cast is not None:  # as torch's flex_attention under autocast: inputs in its dtype, the math without it
        query, key, value = autocast_cast(cast, query, key, value)
        with torch.autocast(query.device.type, enabled=False):
            return flex_attention(
                query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options,
                return_aux=return_aux,
            )  # fmt: skip
    _check_qkv(query, key, value, enable_gqa)
    if symbolic():  # torch.compile / export / vmap: torch's own flex is the vendor kernel there
        if query.device.type == "cpu" and not torch.is_grad_enabled():
            # torch's compiled CPU flex refuses inputs that require grad even under no_grad (it has no
            # backward); under no_grad no graph is recorded, so the detached inputs are the same call
            query, key, value = query.detach(), key.detach(), value.detach()
        return _torch_flex(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                           kernel_options, return_aux=return_aux)  # fmt: skip
    _check_options(kernel_options)
    if return_lse and return_aux is not None:
        raise ValueError("give return_lse or return_aux=AuxRequest(lse=True), not both")
    if return_aux is not None and not isinstance(return_aux, AuxRequest):
        raise TypeError(f"return_aux must be an AuxRequest or None, got {type(return_aux).__name__}")
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be callable or None, got {type(score_mod).__name__}")
    if score_mod is not None and not takes(score_mod, 5):
        n = positional_args(score_mod)
        what = (
            "a mask_mod (b, h, q_idx, kv_idx): a mask goes to block_mask=create_block_mask(mask_mod, ...)"
            if n == 4
            else f"a function of {n} positional arguments"
        )
        raise TypeError(f"score_mod must take (score, b, h, q_idx, kv_idx), got {what}")
    b, h, tq, e = query.shape
    tk = key.shape[2]
    scale = resolve_scale(scale, e)  # the one rule of every entry point (numpy scalars, 0-d tensors too)
    if key.shape[0] != b:
        key, value = key.expand(b, *key.shape[1:]), value.expand(b, *value.shape[1:])
    vis, (bq, bk) = visibility_of(block_mask, b, h, tq, tk, query.device)
    want_max = return_aux is not None and return_aux.max_scores
    out, lse, mx = _run(query, key, value, vis, float(scale), score_mod, bq, bk, want_max)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=mx if want_max else None)
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class FlexPlan:
    """How :func:`flex_attention` computes a call: ``path`` ("engine": the block engine, the score_mod (if
    any) as a bias tile of its kernel; "scored": the score-mod kernel), the engine's kernel, the plan's
    strategy and its number of kernel calls (for "scored": row blocks)."""

    path: str
    kernel: str
    strategy: str
    calls: int


def describe(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False) -> FlexPlan:
    """What :func:`flex_attention` would do with these arguments, without computing."""
    _check_qkv(query, key, value, enable_gqa)
    b, h, tq, e = query.shape
    vis, (bq, bk) = visibility_of(block_mask, b, h, tq, key.shape[2], query.device)
    if score_mod is not None:
        bias = _as_bias(score_mod, b, h, tq, vis.k_len, query.device)
        if bias is None:
            return FlexPlan("scored", "exact", "row spans", len(row_spans(vis, bq, bk)))
        pred = vis.mod if vis.mod is not None else Predicate(batch=b, heads=h, device=query.device)
        vis = replace(vis, mod=replace(pred, score_bias=bias))
    s = 1.0 / math.sqrt(e) if scale is None else float(scale)
    prob = engine.make_problem(query, key.expand(b, *key.shape[1:]), value.expand(b, *value.shape[1:]), vis, s,
                               block_q=bq, block_k=bk)  # fmt: skip
    return FlexPlan("engine", prob.kernel, prob.plan.strategy, len(prob.plan.calls))


def _run(query, key, value, vis, scale, score_mod, bq, bk, want_max):
    b, h, tq, _ = query.shape
    if tq == 0 or vis.k_len == 0 or b == 0 or h == 0 or query.shape[-1] == 0 or value.shape[-1] == 0:
        return _empty(query, value, vis.k_len)
    if score_mod is not None:
        bias = _as_bias(score_mod, b, h, tq, vis.k_len, query.device)
        if bias is None or want_max:
            return scored.attention(query, key, value, vis, scale, score_mod, block_q=bq, block_k=bk)
        pred = vis.mod if vis.mod is not None else Predicate(batch=b, heads=h, device=query.device)
        vis = replace(vis, mod=replace(pred, score_bias=bias))
    elif want_max:
        return scored.attention(query, key, value, vis, scale, _identity, block_q=bq, block_k=bk)
    prob = engine.make_problem(query, key, value, vis, scale, block_q=bq, block_k=bk)
    out, lse = engine.attention(query, key, value, prob)
    return out, lse.to(torch.promote_types(query.dtype, torch.float32)), None


def _identity(score, b, h, q_idx, kv_idx):
    return score


def _empty(query, value, tk):
    b, h, tq, _ = query.shape
    acc = torch.promote_types(query.dtype, torch.float32)
    out = query.new_zeros((b, h, tq, value.shape[-1]))
    lse = torch.full((b, h, tq), -math.inf, dtype=acc, device=query.device)
    return out, lse, lse.clone()
