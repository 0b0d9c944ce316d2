"""The tiled path's arguments and plans: the public arguments in the engine's canonical form.

:func:`canonical` validates the arguments of :func:`selfattention.tiled.tiled_attention` once (through
:func:`selfattention._validation.parse_attention`), flattens the batch dims to B, keeps grouped-query heads
as H vs Hkv (never repeated), and folds ``attn_mask``, ``is_causal``, ``window`` and ``document_ids`` into one
:class:`~selfattention.visibility.Visibility`. :func:`describe` and :func:`computed_fraction` say what the
block plan of a call would be, without computing it.

Layout after :func:`canonical`::

    q (B, H, Tq, D)   k (B, Hkv, Tk, D)   v (B, Hkv, Tk, Dv)   mask (b, h, Tq, Tk), b ∈ {1, B}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn.attention.bias import CausalBias

from ._validation import broadcast_shapes, check_bool, check_positive_int, parse_attention
from .functional import mask_outruns_lse
from .kernels import engine
from .kernels.plan import band_options, make_plan
from .visibility import Visibility

__all__ = [
    "Canon",
    "PlanInfo",
    "canonical",
    "no_autograd",
    "spec_reason",
    "split_docs",
    "blocks",
    "shape_out",
    "describe",
    "computed_fraction",
    "DEFAULT_BLOCK_Q",
    "DEFAULT_BLOCK_K",
]

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 512


@dataclass
class Canon:
    """The public arguments in the engine's canonical form, and how to shape the result back."""

    q: torch.Tensor  # (B, H, Tq, D)
    k: torch.Tensor  # (B, Hkv, Tk, D)
    v: torch.Tensor  # (B, Hkv, Tk, Dv)
    vis: Visibility
    mask: torch.Tensor | None  # the canonical 4-D float mask when its gradient is wanted
    scale: float
    batch: tuple[int, ...]  # the output's batch dims (heads included)
    unbatched: bool


def split_docs(
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None, q_len: int, k_len: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if document_ids is None:
        return None, None
    if isinstance(document_ids, tuple | list):
        if len(document_ids) != 2:
            raise ValueError("document_ids must be a tensor (..., T) or a pair (query ids, key ids)")
        q_doc, k_doc = document_ids
    else:
        q_doc = k_doc = document_ids
    for name, ids, n in (("query document ids", q_doc, q_len), ("key document ids", k_doc, k_len)):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"document_ids must hold torch tensors, got {type(ids).__name__}")
        if ids.is_floating_point() or ids.dtype == torch.bool or ids.is_complex():
            raise TypeError(f"{name} must be an integer tensor, got dtype {ids.dtype}")
        if ids.dim() < 1 or ids.shape[-1] != n:
            raise ValueError(
                f"{name} must have shape (..., {n}) (one id per position), got {tuple(ids.shape)}"
                + ("; pass a pair (query ids, key ids) when Tq != Tk" if q_len != k_len else "")
            )
    return q_doc, k_doc


def lead_to_b(t: torch.Tensor, lead: tuple[int, ...], tail: int) -> torch.Tensor:
    """A tensor (*some_lead, *tail dims) broadcastable to (*lead, *tail) as (b, *tail), b ∈ {1, prod(lead)}."""
    t = t.reshape((1,) * (len(lead) + tail - t.dim()) + tuple(t.shape))
    if all(s == 1 for s in t.shape[: len(lead)]):
        return t.reshape(1, *t.shape[len(lead) :])
    return t.expand(*lead, *t.shape[len(lead) :]).reshape(math.prod(lead), *t.shape[len(lead) :])


def canonical(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, training, window, document_ids
) -> tuple[Canon, float]:
    args = parse_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa, training=training
    )
    batch, q_len, k_len, scale, dropout_p = args.batch, args.q_len, args.k_len, args.scale, args.dropout_p
    # a Visibility, or torch's CausalBias (which parse_attention turned into one)
    vis_in = attn_mask if isinstance(attn_mask, Visibility) else None
    if vis_in is None and isinstance(attn_mask, CausalBias):
        vis_in = args.vis
    attn_mask = args.vis.attn_mask
    if window is not None:
        window = check_positive_int("window", window)
    q_doc, k_doc = split_docs(document_ids, q_len, k_len)

    unbatched = query.dim() == 2
    q, k, v = query, key, value
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    if q.dim() == 3:
        q, k, v = q[None], k[None], v[None]
    hk = k.shape[-3]
    heads = batch[-1] if not unbatched else 1
    lead = broadcast_shapes(q.shape[:-3], k.shape[:-3])
    if hk != heads and (hk == 1 or heads % hk == 0):
        hkv = hk  # grouped-query heads (H a multiple of Hkv, or one shared key/value head): never repeated
    else:
        hkv = heads
    nb = math.prod(lead)
    if not (q.dim() == 4 and q.shape[:2] == (nb, heads) and k.shape[:2] == v.shape[:2] == (nb, hkv)):
        # (already canonical, the common case: nothing to broadcast)
        q = q.expand(*lead, heads, *q.shape[-2:]).reshape(nb, heads, *q.shape[-2:])
        k = k.expand(*lead, hkv, *k.shape[-2:]).reshape(nb, hkv, *k.shape[-2:])
        v = v.expand(*lead, hkv, *v.shape[-2:]).reshape(nb, hkv, *v.shape[-2:])
    lead_b = lead if lead else (1,)

    mask4 = None
    if attn_mask is not None:
        m = attn_mask.reshape((1,) * max(0, 2 - attn_mask.dim()) + tuple(attn_mask.shape))
        m = m.reshape((1,) * max(0, 3 - m.dim()) + tuple(m.shape))  # (..., h, tq, tk)
        mask4 = lead_to_b(m, lead_b, 3)
    docs = [None, None]
    for i, ids in enumerate((q_doc, k_doc)):
        if ids is None:
            continue
        if ids.device != query.device:
            raise ValueError(f"document_ids are on {ids.device} but query is on {query.device}")
        try:
            ok = broadcast_shapes(ids.shape[:-1], lead) == lead
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"document_ids of shape {tuple(ids.shape)} do not broadcast to the batch dims "
                f"{lead} (heads excluded) + (T,)"
            )
        docs[i] = lead_to_b(ids, lead_b, 1)
    if vis_in is not None:
        if vis_in.q_doc is not None and q_doc is not None:
            raise ValueError("document ids given twice: in the Visibility and as document_ids")
        causal = args.vis.is_causal  # is_causal merged into the Visibility by parse_attention
        if window is not None and vis_in.window is not None and window != vis_in.window:
            raise ValueError(f"window={window} but the Visibility has window={vis_in.window}")
        w = window if window is not None else vis_in.window
        vis = Visibility(
            q_len,
            k_len,
            is_causal=causal,
            window=w,
            q_offset=vis_in.q_offset,
            q_doc=docs[0] if docs[0] is not None else doc_b(vis_in.q_doc, lead_b),
            k_doc=docs[1] if docs[1] is not None else doc_b(vis_in.k_doc, lead_b),
            attn_mask=mask4,
            mod=vis_in.mod,
            doc_offset=vis_in.doc_offset
            if vis_in.doc_offset is not None
            else per_doc(document_ids, causal, w),
        )
    elif window is None and docs[0] is None and docs[1] is None and mask4 is None:
        vis = args.vis  # what parse_attention built: (Tq, Tk, is_causal), nothing else to add
    else:
        vis = Visibility(
            q_len, k_len, is_causal=is_causal, window=window, q_doc=docs[0], k_doc=docs[1], attn_mask=mask4,
            doc_offset=per_doc(document_ids, is_causal, window),
        )  # fmt: skip
    grad_mask = (
        mask4 is not None and mask4.is_floating_point() and mask4.requires_grad and torch.is_grad_enabled()
    )
    canon = Canon(q, k, v, vis, mask4 if grad_mask else None, scale, tuple(batch), unbatched)
    return canon, dropout_p


def per_doc(document_ids, causal: bool, window: int | None) -> int | None:
    """A pair (query ids, key ids) with causal or a window: each document's queries sit bottom-right on
    its own keys (doc_offset 0). One tensor of ids (the same for queries and keys) needs no offset: every
    document then has as many queries as keys at the same place, and both alignments agree."""
    pair = isinstance(document_ids, tuple | list)
    return 0 if pair and (causal or window is not None) else None


def doc_b(ids: torch.Tensor | None, lead: tuple[int, ...]) -> torch.Tensor | None:
    return None if ids is None else lead_to_b(ids, lead, 1)


def blocks(block_q: int | None, block_k: int | None) -> tuple[int, int]:
    bq = DEFAULT_BLOCK_Q if block_q is None else check_positive_int("block_q", block_q)
    bk = DEFAULT_BLOCK_K if block_k is None else check_positive_int("block_k", block_k)
    return bq, bk


def shape_out(c: Canon, t: torch.Tensor, tail: tuple[int, ...]) -> torch.Tensor:
    t = t.reshape(*c.batch, *tail) if not c.unbatched else t.reshape(*tail)
    return t


@dataclass(frozen=True)
class PlanInfo:
    """How :func:`tiled_attention` computes a problem: the kernel (``vendor``, ``exact``, or ``spec`` for
    the rare call that takes the spec's math: :func:`spec_reason`) and why, the plan's strategy, its number
    of kernel calls, and the fraction of the score table handed to a kernel."""

    kernel: str
    reason: str
    strategy: str
    calls: int
    computed_fraction: float


def no_autograd(c: Canon) -> bool:
    """No gradient will be asked of this call (inference, decode steps)."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (c.q, c.k, c.v)))


def spec_reason(c: Canon, kernel: str | None) -> str | None:
    """Why this call takes the spec's math instead of a block kernel, or None (the usual answer).

    The one case: gradients are wanted and a row of the float mask lies beyond what the log-sum-exp can
    resolve (:func:`selfattention.functional.mask_outruns_lse`, e.g. transformers' ``finfo.min`` rows): both
    kernels recompute the weights from the lse in their backward and would get them wrong. Raises
    ``ValueError`` when ``kernel="vendor"`` was asked for such a call.
    """
    if no_autograd(c) and c.mask is None:
        return None
    if not mask_outruns_lse(c.vis, torch.promote_types(c.q.dtype, torch.float32)):
        return None
    reason = "gradients with a float-mask row beyond the log-sum-exp's resolution"
    if kernel == "vendor":
        raise ValueError(f"kernel='vendor' cannot serve this call: {reason} (mask rows near finfo.min)")
    return reason


def describe(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | Visibility | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
    training: bool = True,
    window: int | None = None,
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    kernel: str | None = None,
) -> PlanInfo:
    """What :func:`tiled_attention` would do with these arguments (same signature), without computing.

    >>> q = torch.randn(1, 2, 4096, 64)
    >>> describe(q, q, q, is_causal=True)
    PlanInfo(kernel='vendor', reason='fused kernel', strategy='causal', calls=1, computed_fraction=0.5001220703125)
    """
    c, dropout_p = canonical(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, training, window, document_ids
    )
    bq, bk = blocks(block_q, block_k)
    reason = spec_reason(c, kernel)
    if reason is not None:  # the spec's dense math, one call
        return PlanInfo("spec", reason, "dense", 1, 1.0)
    # keys/values are scanned here even where the call defers that scan to its output (same verdict)
    name, reason = engine.choose_kernel(
        c.q, c.k, c.v, c.vis, dropout_p=dropout_p, mask_grad=c.mask is not None, kernel=kernel
    )
    plan = make_plan(c.vis, bq, bk, every_tile=c.mask is not None, **band_options(c.q.device.type, name, bq))
    total = max(1, c.vis.q_len * c.vis.k_len)
    return PlanInfo(name, reason, plan.strategy, len(plan.calls), plan.entries() / total)


def computed_fraction(
    q_len: int,
    k_len: int,
    *,
    is_causal: bool = False,
    window: int | None = None,
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> float:
    """Fraction of the Tq × Tk score entries the tiled path hands to a kernel (the rest is skipped).

    Pure integer arithmetic on the block plan (no timing, no randomness); a causal square counts its lower
    triangle (the kernel skips the rest).

    >>> computed_fraction(4096, 4096)
    1.0
    >>> computed_fraction(4096, 4096, is_causal=True)      # the triangle and its diagonal
    0.5001220703125
    >>> f = computed_fraction(16384, 16384, window=512, block_q=128)
    >>> round(f, 4), round(f * 16384 / 512, 2)   # W = 512: the band of W − 1 + block_q keys per row
    (0.0383, 1.22)
    """
    for name, n in (("q_len", q_len), ("k_len", k_len)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    if window is not None:
        window = check_positive_int("window", window)
    check_bool("is_causal", is_causal)
    q_doc, k_doc = split_docs(document_ids, q_len, k_len)
    if q_doc is not None:
        q_doc, k_doc = q_doc.reshape(-1, q_len)[:1], k_doc.reshape(-1, k_len)[:1]
    bq, bk = blocks(block_q, block_k)
    vis = Visibility(
        q_len, k_len, is_causal=is_causal, window=window, q_doc=q_doc, k_doc=k_doc,
        doc_offset=per_doc(document_ids, is_causal, window) if q_doc is not None else None,
    )  # fmt: skip
    plan = make_plan(vis, bq, bk)
    return plan.entries() / max(1, q_len * k_len)
