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

The arguments' canonical form, :func:`describe` and :func:`computed_fraction` live in
:mod:`selfattention.tiled_plan` (re-exported here).
"""

from __future__ import annotations

import math
import threading

import torch

from . import ops
from ._validation import check_bool, check_count, symbolic
from .functional import attention_steps, empty_context, row_logsumexp
from .kernels import engine, stats_fused
from .kernels.stats import AttentionStats, sweep
from .tiled_plan import (
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    Canon,
    PlanInfo,
    blocks,
    canonical,
    computed_fraction,
    describe,
    no_autograd,
    shape_out,
    spec_reason,
)
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
    c, dropout_p = canonical(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, training, window, document_ids
    )
    bq, bk = blocks(block_q, block_k)
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
    if spec_reason(c, kernel) is not None:  # (rare) the spec's math: see tiled_plan.spec_reason
        steps = attention_steps(
            c.q, c.k, c.v, c.vis, dropout_p, False, c.scale, enable_gqa=c.k.shape[1] != c.q.shape[1]
        )
        out = shape_out(c, steps.context, (tq, dv))
        return (out, shape_out(c, row_logsumexp(steps.masked_scores), (tq,))) if return_lse else out
    defer = no_autograd(c)
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
    out = shape_out(c, out, (tq, dv))
    if not return_lse:
        return out
    return out, shape_out(c, lse, (tq,))


#: Problems of plain calls, by :func:`_plan_key` of their *validated* arguments (a model runs the same
#: shapes in every layer and forward: planning then costs nothing; validation runs on every call)
_PLANS: dict[tuple, engine.Problem] = {}
_PLANS_MAX = 64
_PLANS_LOCK = threading.Lock()


def _plan_key(c: Canon, bq: int, bk: int) -> tuple:
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
    c, _ = canonical(
        query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, False, window, document_ids
    )
    bq, bk = blocks(block_q, block_k)
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
            qa, ka = q.to(acc), k.to(acc)
            # dense or plain causal with moderate scores: the output and the statistics from one pass
            fused = stats_fused.attention_with_stats(qa, ka, v.to(acc), prob, top_k, column_sums)
            if fused is not None:
                out4, lse, ent, tw, ti, cs = fused
            else:
                out4, lse = engine.forward(q, k, v, prob)
                ent, tw, ti, cs = sweep(qa, ka, lse.to(acc), prob, top_k, column_sums)
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
        out = shape_out(c, out4.to(query.dtype), (tq, dv))
    stats = AttentionStats(
        lse=shape_out(c, lse, (tq,)),
        entropy=shape_out(c, ent, (tq,)),
        topk_indices=shape_out(c, ti, (tq, top_k)),
        topk_weights=shape_out(c, tw, (tq, top_k)),
        column_sums=None if cs is None else shape_out(c, cs, (tk,)),
    )
    return out, stats
