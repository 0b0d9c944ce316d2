"""The O(n)-memory path: exact attention planned block by block and computed by the vendor's fused kernel.

Lecture 003 §4 warns that the score table QKᵀ grows as n²; at T = 65 536 one float32 head needs 16 GiB.
This module computes the same softmax(QKᵀ·scale + mask)V without ever forming it: the visibility of the
problem (causal at an offset, a sliding window, document ids, a dense mask) becomes a block plan
(:mod:`selfattention.kernels.plan`) whose calls go to torch's fused flash kernel, which returns the
log-sum-exp, and calls that share query rows are merged by log-sum-exp (FlashAttention-2's online
softmax: Dao 2023; Milakov & Gimelshein 2018). Blocks that no query can see are never computed::

    causal (one call: the kernel's own causal mask)      window W (bands stacked into one call)
    keys →  0 1 2 3 4 5                                  keys →  0 1 2 3 4 5
    q 0-1   ◣ . . . . .                                  q 0-1   ◣ . . . . .      ◣ causal call
    q 2-3   ◣ ◣ . . . .                                  q 2-3   ▣ ▣ . . . .      ▣ band (shared mask)
    q 4-5   ◣ ◣ ◣ . . .                                  q 4-5   . ▣ ▣ . . .      . never computed

Where nothing can be skipped it is one kernel call: the cost of torch SDPA. What no fused kernel offers
(inputs holding NaN/inf with this library's semantics, dropout replayed block by block, the gradient of a
float mask, float64 where the fused kernel lacks it) goes to the exact torch-ops kernel
(:mod:`selfattention.kernels.exact`) with the same plan; :func:`describe` says which kernel and why.

Streaming statistics (:func:`tiled_attention_with_stats`): per-query log-sum-exp (from the kernel),
entropy of the weights, the top-k keys with their weights, and the attention each key receives (column
sums), from one more sweep over the same plan.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from . import ops
from ._validation import (
    broadcast_shapes,
    check_bool,
    check_count,
    check_positive_int,
    parse_attention,
    symbolic,
)
from .functional import empty_context
from .kernels import engine
from .kernels.plan import band_options, make_plan
from .kernels.stats import AttentionStats, sweep
from .visibility import Visibility

__all__ = [
    "AttentionStats",
    "PlanInfo",
    "tiled_attention",
    "tiled_attention_with_stats",
    "computed_fraction",
    "describe",
    "DEFAULT_BLOCK_Q",
    "DEFAULT_BLOCK_K",
]

DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 512


@dataclass
class _Canon:
    """The public arguments in the engine's canonical form, and how to shape the result back."""

    q: torch.Tensor  # (B, H, Tq, D)
    k: torch.Tensor  # (B, Hkv, Tk, D)
    v: torch.Tensor  # (B, Hkv, Tk, Dv)
    vis: Visibility
    mask: torch.Tensor | None  # the canonical 4-D float mask when its gradient is wanted
    scale: float
    batch: tuple[int, ...]  # the output's batch dims (heads included)
    unbatched: bool


def _split_docs(
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


def _lead_to_b(t: torch.Tensor, lead: tuple[int, ...], tail: int) -> torch.Tensor:
    """A tensor (*some_lead, *tail dims) broadcastable to (*lead, *tail) as (b, *tail), b ∈ {1, prod(lead)}."""
    t = t.reshape((1,) * (len(lead) + tail - t.dim()) + tuple(t.shape))
    if all(s == 1 for s in t.shape[: len(lead)]):
        return t.reshape(1, *t.shape[len(lead) :])
    return t.expand(*lead, *t.shape[len(lead) :]).reshape(math.prod(lead), *t.shape[len(lead) :])


def _canonical(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, training, window, document_ids
) -> tuple[_Canon, float]:
    args = parse_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa, training=training
    )
    batch, q_len, k_len, scale, dropout_p = args.batch, args.q_len, args.k_len, args.scale, args.dropout_p
    vis_in = attn_mask if isinstance(attn_mask, Visibility) else None
    attn_mask = args.vis.attn_mask
    if window is not None:
        window = check_positive_int("window", window)
    q_doc, k_doc = _split_docs(document_ids, q_len, k_len)

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
        mask4 = _lead_to_b(m, lead_b, 3)
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
        docs[i] = _lead_to_b(ids, lead_b, 1)
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
            q_doc=docs[0] if docs[0] is not None else _doc_b(vis_in.q_doc, lead_b),
            k_doc=docs[1] if docs[1] is not None else _doc_b(vis_in.k_doc, lead_b),
            attn_mask=mask4,
            mod=vis_in.mod,
            doc_offset=vis_in.doc_offset
            if vis_in.doc_offset is not None
            else _per_doc(document_ids, causal, w),
        )
    elif window is None and docs[0] is None and docs[1] is None and mask4 is None:
        vis = args.vis  # what parse_attention built: (Tq, Tk, is_causal), nothing else to add
    else:
        vis = Visibility(
            q_len, k_len, is_causal=is_causal, window=window, q_doc=docs[0], k_doc=docs[1], attn_mask=mask4,
            doc_offset=_per_doc(document_ids, is_causal, window),
        )  # fmt: skip
    grad_mask = (
        mask4 is not None and mask4.is_floating_point() and mask4.requires_grad and torch.is_grad_enabled()
    )
    canon = _Canon(q, k, v, vis, mask4 if grad_mask else None, scale, tuple(batch), unbatched)
    return canon, dropout_p


def _per_doc(document_ids, causal: bool, window: int | None) -> int | None:
    """A pair (query ids, key ids) with causal or a window: each document's queries sit bottom-right on
    its own keys (doc_offset 0). One tensor of ids (the same for queries and keys) needs no offset: every
    document then has as many queries as keys at the same place, and both alignments agree."""
    pair = isinstance(document_ids, tuple | list)
    return 0 if pair and (causal or window is not None) else None


def _doc_b(ids: torch.Tensor | None, lead: tuple[int, ...]) -> torch.Tensor | None:
    return None if ids is None else _lead_to_b(ids, lead, 1)


def _blocks(block_q: int | None, block_k: int | None) -> tuple[int, int]:
    bq = DEFAULT_BLOCK_Q if block_q is None else check_positive_int("block_q", block_q)
    bk = DEFAULT_BLOCK_K if block_k is None else check_positive_int("block_k", block_k)
    return bq, bk


def _shape_out(c: _Canon, t: torch.Tensor, tail: tuple[int, ...]) -> torch.Tensor:
    t = t.reshape(*c.batch, *tail) if not c.unbatched else t.reshape(*tail)
    return t


def tiled_attention(
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
    dropout_seed: int | None = None,
    kernel: str | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention in O(T) memory: softmax(Q Kᵀ·scale + mask) V, planned by blocks, with autograd.

    Same arguments, shapes, semantics and errors as :func:`selfattention.scaled_dot_product_attention`
    (bool mask True = attend, float mask added, bottom-right causal, zeros and zero gradient for a
    query with no visible key, hidden NaN/inf keys never leak into the output), plus structured masks
    that never need a dense (Tq, Tk) tensor and whose hidden blocks are skipped:

    Args:
        attn_mask: as in the spec, or a :class:`~selfattention.visibility.Visibility` (e.g. from a
            :class:`~selfattention.kv_cache.KVCache`: "causal at offset, window W" with no dense mask).
        window: sliding window W (implies causal): the query at position p sees keys p−W+1 … p. W = 2,
            Tq = Tk = 4::

                1 0 0 0
                1 1 0 0
                0 1 1 0
                0 0 1 1

        document_ids: integer ids (..., T) when Tq == Tk, or a pair ``(query_ids (..., Tq),
            key_ids (..., Tk))``: a query sees only keys with the same id (packed documents). Leading
            dims broadcast against the batch dims without the heads. With a pair, ``is_causal`` and
            ``window`` are aligned **per document**: a document's queries sit bottom-right on its own
            keys (chunked prefill in a packed batch: 1 query after 2 keys of doc 0, 2 after 1 of doc 1)::

                q ids [0, 1, 1], k ids [0, 0, 0, 1, 1, 1], causal
                1 1 1 0 0 0
                0 0 0 1 1 0
                0 0 0 1 1 1

            Ids [0, 0, 1]::

                1 1 0
                1 1 0
                0 0 1

            All of ``attn_mask``, ``is_causal``, ``window`` and ``document_ids`` combine with AND.
        block_q, block_k: query rows and key columns of the plan's blocks (defaults ``DEFAULT_BLOCK_Q``,
            ``DEFAULT_BLOCK_K``): the granularity of skipping; any positive ints, they need not divide T.
        dropout_seed: seed of the per-tile dropout masks (drawn from torch's global generator when
            None); the backward regenerates each tile's mask instead of storing it.
        kernel: ``None`` (the fused vendor kernel whenever it can serve the problem, else the exact
            kernel), ``"vendor"`` (raise ``ValueError`` with the reason if it cannot) or ``"exact"``.
        return_lse: also return the log-sum-exp of each query row (see Returns).

    Returns:
        (..., H, Tq, Dv) in the dtype of ``query``; statistics in float32 at least (bfloat16/float16 on
        CPU are computed in float32). With ``return_lse=True``, ``(out, lse)``: lse (..., H, Tq), the
        natural log of Σ_j exp(score_ij) over the keys the row sees (scaled scores plus a float mask,
        before dropout), float32 at least, ``-inf`` for a row that sees nothing; differentiable (the
        engine's backward takes its gradient); merge states with :func:`selfattention.merge_states`.

    Gradients flow to query, key, value and a float ``attn_mask`` that requires grad (a learned bias
    such as ALiBi/T5: its gradient is dS summed over its broadcast dims). The backward keeps only the
    per-row log-sum-exp (Dao 2023, "FlashAttention-2", Algorithm 2). Double backward
    (``create_graph=True``) is exact and goes through the spec (O(T²) memory; not with dropout).

    Raises:
        TypeError, ValueError: as :func:`selfattention.scaled_dot_product_attention`; bad ``window``,
            ``document_ids``, block sizes or ``kernel``.

    >>> q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> tiled_attention(q, q, 2 * q, block_q=1, block_k=1)   # lecture 003: (1.340, 0.660), (0.660, 1.340)
    tensor([[1.3395, 0.6605],
            [0.6605, 1.3395]])
    """
    check_bool("return_lse", return_lse)
    if symbolic():  # torch.compile / export / vmap / jit.trace: one registered op (selfattention.ops)
        if return_lse:
            raise NotImplementedError(
                "return_lse=True under torch.compile/export/vmap/trace is not supported yet: call it eagerly"
            )
        extra = {"window": window, "document_ids": document_ids, "block_q": block_q, "block_k": block_k,
                 "dropout_seed": dropout_seed, "kernel": kernel}  # fmt: skip
        given = [name for name, x in extra.items() if x is not None]
        if given:
            raise NotImplementedError(
                f"tiled_attention's {', '.join(given)} under torch.compile/export/vmap/trace: pass a "
                "Visibility (causal, window, offset) as attn_mask of selfattention.scaled_dot_product_attention"
            )
        return ops.attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa,
            training=training, backend="tiled",
        )  # fmt: skip
    c, dropout_p = _canonical(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, training, window, document_ids
    )
    bq, bk = _blocks(block_q, block_k)
    if dropout_seed is not None and (isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int)):
        raise TypeError(f"dropout_seed must be an int or None, got {type(dropout_seed).__name__}")
    tq, dv = c.vis.q_len, c.v.shape[-1]
    if tq == 0 or c.vis.k_len == 0 or c.q.shape[0] == 0 or c.q.shape[1] == 0:
        out = empty_context(query, key, value, (*c.batch, tq, dv))
        out = out.reshape(tq, dv) if c.unbatched else out
        if not return_lse:
            return out
        acc = torch.promote_types(query.dtype, torch.float32)
        lse = torch.full(out.shape[:-1], -math.inf, dtype=acc, device=query.device)
        return out, lse
    defer = _no_autograd(c)
    # Validation has run; a plain call (no mask, documents, dropout or autograd, kernel chosen by the
    # engine) reuses the plan made for the same validated shapes and options
    plain = defer and dropout_p == 0.0 and c.vis.attn_mask is None and c.vis.q_doc is None and kernel is None
    key_ = _plan_key(c, bq, bk) if plain else None
    prob = _PLANS.get(key_) if key_ is not None else None
    if prob is None:
        prob = engine.make_problem(
            c.q, c.k, c.v, c.vis, c.scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
            mask_grad=c.mask is not None, kernel=kernel, block_q=bq, block_k=bk, defer_kv=defer,
        )  # fmt: skip
        if key_ is not None and prob.dropout is None:
            with _PLANS_LOCK:  # lookups need no lock; two threads must not evict the same entry
                if len(_PLANS) >= _PLANS_MAX:
                    _PLANS.pop(next(iter(_PLANS)), None)  # the oldest
                _PLANS[key_] = prob
    out, lse = engine.attention(c.q, c.k, c.v, prob, c.mask)
    out = _shape_out(c, out, (tq, dv))
    if not return_lse:
        return out
    return out, _shape_out(c, lse, (tq,))


#: Problems of plain calls, by :func:`_plan_key` of their *validated* arguments (a model runs the same
#: shapes in every layer and forward: planning then costs nothing; validation runs on every call)
_PLANS: dict[tuple, engine.Problem] = {}
_PLANS_MAX = 64
_PLANS_LOCK = threading.Lock()


def _plan_key(c: _Canon, bq: int, bk: int) -> tuple:
    """What the plan of a validated plain call depends on (every value here came out of validation)."""
    v = c.vis
    return (
        tuple(c.q.shape), tuple(c.k.shape), tuple(c.v.shape), c.q.dtype, c.q.device,
        v.is_causal, v.window, v.q_offset, c.scale, bq, bk,
    )  # fmt: skip


def tiled_attention_with_stats(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | Visibility | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
    window: int | None = None,
    document_ids: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    top_k: int = 1,
    column_sums: bool = True,
    block_q: int | None = None,
    block_k: int | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, AttentionStats]:
    """Attention output plus :class:`AttentionStats` (log-sum-exp, entropy, top-k keys, column sums).

    Arguments as in :func:`tiled_attention` (no dropout: statistics describe the weights themselves);
    ``top_k``: how many of each query's best keys to report (0: none, the cheapest sweep — the top-k
    fields then have a last dim of 0); ``column_sums=False`` skips the column sums.
    The output and the log-sum-exp come from the kernel; entropy, top-k and column sums from one more
    sweep over the same block plan (skipped blocks stay skipped). Nothing of size Tq × Tk is formed.
    The output is differentiable (then it comes from the autograd path); the statistics are not.

    >>> q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> out, st = tiled_attention_with_stats(q, q, 2 * q, top_k=1)
    >>> st.topk_indices.squeeze(-1), st.topk_weights.squeeze(-1)   # each query looks most at itself
    (tensor([0, 1]), tensor([0.6698, 0.6698]))
    >>> st.column_sums                                         # the two keys share the attention
    tensor([1., 1.])
    """
    top_k = check_count("top_k", top_k)
    check_bool("column_sums", column_sums)
    c, _ = _canonical(
        query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, False, window, document_ids
    )
    bq, bk = _blocks(block_q, block_k)
    b, h, tq, _ = c.q.shape
    tk, dv = c.vis.k_len, c.v.shape[-1]
    acc = torch.promote_types(query.dtype, torch.float32)
    if tq == 0 or tk == 0 or b == 0 or h == 0:
        lse = torch.full((b, h, tq), -math.inf, dtype=acc, device=query.device)
        ent = torch.zeros((b, h, tq), dtype=acc, device=query.device)
        tw = torch.zeros((b, h, tq, top_k), dtype=acc, device=query.device)
        ti = torch.full((b, h, tq, top_k), -1, dtype=torch.int64, device=query.device)
        cs = torch.zeros((b, h, tk), dtype=acc, device=query.device) if column_sums else None
        out4 = empty_context(query, key, value, (*c.batch, tq, dv))
    else:
        prob = engine.make_problem(c.q, c.k, c.v, c.vis, c.scale, kernel=kernel, block_q=bq, block_k=bk)
        with torch.no_grad():
            q, k, v = (t.to(prob.compute).contiguous() for t in (c.q, c.k, c.v))
            out4, lse = engine.forward(q, k, v, prob)
            ent, tw, ti, cs = sweep(q.to(acc), k.to(acc), lse.to(acc), prob, top_k, column_sums)
            lse = lse.to(acc)
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (query, key, value, attn_mask)
    )
    if needs_grad:
        out = tiled_attention(
            query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa=enable_gqa, window=window,
            document_ids=document_ids, block_q=block_q, block_k=block_k, kernel=kernel,
        )  # fmt: skip
    else:
        out = _shape_out(c, out4.to(query.dtype), (tq, dv))
    stats = AttentionStats(
        lse=_shape_out(c, lse, (tq,)),
        entropy=_shape_out(c, ent, (tq,)),
        topk_indices=_shape_out(c, ti, (tq, top_k)),
        topk_weights=_shape_out(c, tw, (tq, top_k)),
        column_sums=None if cs is None else _shape_out(c, cs, (tk,)),
    )
    return out, stats


@dataclass(frozen=True)
class PlanInfo:
    """How :func:`tiled_attention` computes a problem: the kernel and why, the plan's strategy, its number
    of kernel calls, and the fraction of the score table handed to a kernel."""

    kernel: str
    reason: str
    strategy: str
    calls: int
    computed_fraction: float


def _no_autograd(c: _Canon) -> bool:
    """No gradient will be asked of this call (inference, decode steps)."""
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (c.q, c.k, c.v)))


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
    c, dropout_p = _canonical(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, training, window, document_ids
    )
    bq, bk = _blocks(block_q, block_k)
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
    q_doc, k_doc = _split_docs(document_ids, q_len, k_len)
    if q_doc is not None:
        q_doc, k_doc = q_doc.reshape(-1, q_len)[:1], k_doc.reshape(-1, k_len)[:1]
    bq, bk = _blocks(block_q, block_k)
    vis = Visibility(
        q_len, k_len, is_causal=is_causal, window=window, q_doc=q_doc, k_doc=k_doc,
        doc_offset=_per_doc(document_ids, is_causal, window) if q_doc is not None else None,
    )  # fmt: skip
    plan = make_plan(vis, bq, bk)
    return plan.entries() / max(1, q_len * k_len)
