"""The spec: self-attention as one page of plain, float64-safe math.

Every faster path in this library (tiled, torch, distributed, cached) is tested against the functions
here. They materialise the (Tq, Tk) score table on purpose: it is what the lectures draw.

Dimension legend (the layout of ``torch.nn.functional.scaled_dot_product_attention``)::

    B   batch                      H   query heads        Hkv  key/value heads (H % Hkv == 0 for GQA)
    Tq  query length (tokens)      Tk  key/value length   D    head_dim (query/key), Dv value head_dim
    query (B, H, Tq, D)   key (B, Hkv, Tk, D)   value (B, Hkv, Tk, Dv)   →   context (B, H, Tq, Dv)
    scores / weights (B, H, Tq, Tk)

Any number of leading batch dims is allowed (``(..., T, D)``), e.g. (T, D) for one unbatched head.

Sources:
    * lecture 000 (简化自注意力): ω_ij = x_i · x_j (eq. simple-attn-score), α_ij = softmax_j(ω_ij)
      (eq. simple-attn-weight), z_i = Σ_j α_ij x_j (eq. simple-attn-output), Z = softmax(X Xᵀ) X
      (eq. simple-attn-matrix).
    * lecture 003 (自注意力 Q/K/V), §3: Q = X·Wq, K = X·Wk, V = X·Wv; score(i, j) = Qᵢ·Kⱼ / √dₖ;
      Attention(Q, K, V) = softmax(QKᵀ/√dₖ)·V.
    * Vaswani et al. 2017, "Attention Is All You Need", eq. (1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from . import _hooks
from ._validation import all_finite, check_bool, parse_attention
from .visibility import Visibility

__all__ = [
    "AttentionSteps",
    "attention_steps",
    "scaled_dot_product_attention",
    "attention_weights",
    "row_logsumexp",
    "mask_outruns_lse",
    "simple_attention",
    "simple_attention_steps",
]


@dataclass
class AttentionSteps:
    """The named intermediates of one attention call (lecture 003 §3, in order).

    Tensors are in the computation dtype (float32 at least; float64 stays float64), except
    ``context``, which is cast back to the input dtype.

    Attributes:
        query, key, value: (..., H, Tq, D), (..., H, Tk, D), (..., H, Tk, Dv) — key/value with GQA heads
            already repeated to H.
        scores: Q Kᵀ, (..., H, Tq, Tk) — "attention scores" (logits), before scaling.
        scaled_scores: scores · scale.
        masked_scores: scaled scores plus the float mask, with hidden keys set to -inf.
        visible: bool (..., H, Tq, Tk), True where the query may attend to the key.
        weights: softmax over keys of ``masked_scores``, (..., H, Tq, Tk); rows sum to 1, or to 0 for a
            query with no visible key. Before dropout.
        context: weights · V, (..., H, Tq, Dv) — the "context vectors".
        scale: the factor used (1/√D unless given).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scores: torch.Tensor
    scaled_scores: torch.Tensor
    masked_scores: torch.Tensor
    visible: torch.Tensor
    weights: torch.Tensor
    context: torch.Tensor
    scale: float

    def as_dict(self) -> dict[str, torch.Tensor | float]:
        """The steps by name, in computation order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def empty_context(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shape: tuple[int, ...]
) -> torch.Tensor:
    """Zeros of ``shape`` for Tq = 0 or Tk = 0 (nothing to attend to), tied to the inputs' graphs so that
    they get zero gradients; the empty slices sum to exactly 0 even when the inputs hold NaN/inf."""
    zero = query[..., :0].sum() + key[..., :0].sum() + value[..., :0].sum()
    return zero.expand(shape).clone()


def _guarded_matmul(
    a: torch.Tensor, b: torch.Tensor, touches_bad: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``a @ b`` in which non-finite entries of ``b`` reach only the outputs that really use them.

    A NaN or inf in a key or value that only masked-out queries would touch must not turn other
    outputs (or gradients) into NaN through 0 · NaN. ``touches_bad(bad)`` maps the bool map of
    non-finite entries of ``b`` to the bool map of outputs that use one; those get the honest IEEE value
    (NaN/inf) as a constant: NaN in an attended position is reported, never scrubbed.
    """
    if all_finite(b):
        return a @ b
    bad = ~torch.isfinite(b)
    clean = a @ torch.where(bad, torch.zeros((), dtype=b.dtype, device=b.device), b)
    with torch.no_grad():
        honest = a @ b
        touches = touches_bad(bad)
    return torch.where(touches, honest, clean)


def guarded_pv(p: torch.Tensor, v: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """Context vectors ``p @ v`` (…, R, Dv) in which a NaN/±inf value reaches only the rows that see its key.

    ``p`` (…, R, C) weights, ``v`` (…, C, Dv), ``seen`` bool (…, R, C): the keys each row may see by the
    visibility (mask, causal, window …), not by its weights. A row's entry in a column that holds
    non-finite values is what IEEE gives for the keys that row *sees* alone: NaN if one is NaN, if +inf
    meets −inf, or if one is ±inf under a weight of exactly 0 or NaN (0 · inf, NaN · inf); else ±inf
    (plus the finite rest, inf + NaN = NaN). Hidden keys contribute nothing, not even 0 · NaN (a plain
    ``p @ v`` would turn a visible +inf next to a hidden NaN into NaN). Gradients flow through the finite
    part only. Shared by the spec and the exact block kernel (:mod:`selfattention.kernels.exact`).
    """
    if all_finite(v):
        return p @ v
    zero = torch.zeros((), dtype=v.dtype, device=v.device)
    bad = ~torch.isfinite(v)
    clean = p @ torch.where(bad, zero, v)
    with torch.no_grad():
        seen_f = seen.to(v.dtype).expand(p.shape)

        def hit(kind: torch.Tensor, rows: torch.Tensor = seen_f) -> torch.Tensor:  # a seen key of this kind
            return (rows @ kind.to(v.dtype)) > 0

        # 0 · inf and NaN · inf are NaN; a NaN weight already makes ``clean`` NaN
        odd = seen_f * ((p == 0) | torch.isnan(p)).to(v.dtype)
        nan = hit(torch.isnan(v)) | hit(torch.isinf(v), odd)
        pos, neg = hit(v == math.inf), hit(v == -math.inf)
        special = torch.where(
            nan,
            torch.full((), math.nan, dtype=v.dtype, device=v.device),
            torch.where(pos, torch.full((), math.inf, dtype=v.dtype, device=v.device), -math.inf),
        )
        # + inf and − inf meet as NaN, and the finite rest is added with IEEE rules (inf + NaN = NaN)
        special = special.to(clean.dtype) + torch.where(pos & neg, math.nan, clean.detach())
    return torch.where(nan | pos | neg, special, clean)


def visible_keys(vis: Visibility, shape: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """Bool (…, Tq, Tk) of the keys each query may see, or None when every key is visible."""
    if not vis.restricts:
        return None
    return vis.to_mask(device).expand(shape)


def mask_outruns_lse(vis: Visibility, compute: torch.dtype) -> bool:
    """True if, in some query row, the float mask's visible entries all lie so far from 0 that a log-sum-exp
    in ``compute`` cannot resolve the row (|row max| > 2^(digits/4): 2^13 in float64, 2^6 in float32).

    A kernel that recomputes the weights in its backward as exp(s − lse) (FlashAttention-2, Algorithm 2;
    torch's fused SDPA kernels) then gets them wrong: a row of ``torch.finfo(dtype).min`` (transformers'
    masked rows) or −1e30 has lse = M + log Tk rounded back to M, so every weight comes out 1 instead of
    1/Tk. The forward, which subtracts the running max, is right; only the gradients break. Such calls take
    the spec's math. ``vis``: the call's visibility (its ``attn_mask`` the checked mask). Memory: the
    mask's broadcast with the visibility's own dense form, never the (..., H, Tq, Tk) scores.

    >>> mask = torch.zeros(2, 3); mask[1] = torch.finfo(torch.float32).min
    >>> mask_outruns_lse(Visibility(2, 3, attn_mask=mask), torch.float32)
    True
    """
    mask = vis.attn_mask
    if mask is None or not mask.is_floating_point() or mask.numel() == 0:
        return False
    limit = 2.0 ** ((1 - round(math.log2(torch.finfo(compute).eps))) // 4)
    m = mask.to(compute)  # what the kernel sees (a float64 −1e300 is −inf in float32: hidden)
    if bool((m.abs() <= limit).all()):  # the common case: every entry near 0
        return False
    m = torch.where(vis.to_mask(mask.device), m, torch.full((), -math.inf, dtype=compute, device=m.device))
    row_max = m.amax(dim=-1)  # (..., Tq); −inf for a row that sees no key (zeros: no weights to recompute)
    return bool((torch.isfinite(row_max) & (row_max.abs() > limit)).any())


def row_logsumexp(masked_scores: torch.Tensor) -> torch.Tensor:
    """log Σ_j exp(masked_scores_ij) over the last dim: the log-sum-exp of each query row (natural log),
    ``-inf`` for a row whose scores are all ``-inf`` (it sees no key), with a zero gradient there (never
    NaN from −inf − (−inf)). A NaN score makes its row NaN.

    >>> row_logsumexp(torch.tensor([[0.0, 0.0], [-math.inf, -math.inf]]))
    tensor([0.6931,   -inf])
    """
    if masked_scores.shape[-1] == 0:
        return masked_scores.new_full(masked_scores.shape[:-1], -math.inf)
    m = masked_scores.amax(dim=-1, keepdim=True).detach()
    m = torch.where(m == -math.inf, torch.zeros((), dtype=m.dtype, device=m.device), m)
    total = torch.exp(masked_scores - m).sum(dim=-1)
    empty = total == 0
    safe = torch.where(empty, torch.ones((), dtype=total.dtype, device=total.device), total)
    neg = torch.full((), -math.inf, dtype=total.dtype, device=total.device)
    return torch.where(empty, neg, m.squeeze(-1) + torch.log(safe))


def attention_steps(
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
) -> AttentionSteps:
    """Scaled dot-product attention with every step kept, by name. Arguments as in
    :func:`scaled_dot_product_attention`; returns an :class:`AttentionSteps`.

    >>> q = k = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> steps = attention_steps(q, k, 2 * k)   # lecture 003's hand example: Wq = Wk = I, Wv = 2I
    >>> steps.scaled_scores
    tensor([[0.7071, 0.0000],
            [0.0000, 0.7071]])
    >>> steps.weights
    tensor([[0.6698, 0.3302],
            [0.3302, 0.6698]])
    >>> steps.context
    tensor([[1.3395, 0.6605],
            [0.6605, 1.3395]])
    """
    args = parse_attention(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa, training=training
    )
    batch, q_len, k_len, vis, scale = args.batch, args.q_len, args.k_len, args.vis, args.scale
    attn_mask, dropout_p = vis.attn_mask, args.dropout_p

    if enable_gqa and query.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        group = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(group, dim=-3)  # (..., Hkv, Tk, D) -> (..., H, Tk, D)
        value = value.repeat_interleave(group, dim=-3)

    # Softmax statistics in float32 at least; float64 stays float64.
    acc = torch.promote_types(query.dtype, torch.float32)
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    score_shape = (*batch, q_len, k_len)
    visible = visible_keys(vis, score_shape, query.device)
    all_visible = torch.ones((), dtype=torch.bool, device=query.device).expand(score_shape)
    visible_or_all = all_visible if visible is None else visible
    if visible is not None and not all_finite(q):
        # a query that sees no key takes no part: NaN/inf it holds must not reach the key gradients
        # through 0 · NaN either (its output and gradient are zero)
        blind = ~visible.any(dim=-1, keepdim=True)  # (..., Tq, 1)
        q = torch.where(blind & ~torch.isfinite(q), torch.zeros((), dtype=acc, device=q.device), q)

    # Step 1: scores ω_ij = q_i · k_j  (…, Tq, Tk)
    scores = _guarded_matmul(
        q, k.transpose(-2, -1), lambda bad: visible_or_all & bad.any(dim=-2, keepdim=True)
    )
    # Step 2: scale by 1/√d_k (lecture 003), then add the float mask and hide invisible keys
    scaled_scores = scores * scale
    masked_scores = scaled_scores
    if attn_mask is not None and attn_mask.is_floating_point():
        masked_scores = masked_scores + attn_mask.to(acc)
    if visible is not None:
        masked_scores = torch.where(
            visible, masked_scores, torch.full((), -math.inf, dtype=acc, device=q.device)
        )

    # Step 3: softmax over keys; a row with no visible key gets weights 0 (never 0/0 = NaN)
    if k_len == 0:
        # nothing to attend to: an empty table, still tied to query and key so that they get zero
        # gradients (not None), as on every other backend
        weights = masked_scores.expand(score_shape) * 0.0
    else:
        row_max = masked_scores.amax(dim=-1, keepdim=True).detach()
        row_max = torch.where(row_max == -math.inf, torch.zeros_like(row_max), row_max)
        exp = torch.exp(masked_scores - row_max)
        denom = exp.sum(dim=-1, keepdim=True)
        weights = exp / torch.where(denom == 0, torch.ones_like(denom), denom)
        if visible is not None:
            # a NaN score in a visible key makes its whole row NaN through the max and the sum; hidden keys
            # still get weight exactly 0, so no NaN reaches the gradients of keys/values the row cannot see
            weights = torch.where(visible, weights, torch.zeros((), dtype=acc, device=q.device))

    used = weights
    if dropout_p > 0.0:
        # torch's math backend's draw (at::dropout: bernoulli_(1 - p), scaled by 1/(1 - p)): under the same
        # seed the same weights are dropped as in torch.nn.functional.scaled_dot_product_attention on CPU
        keep = torch.empty_like(weights).bernoulli_(1.0 - dropout_p)
        used = weights * keep.div_(1.0 - dropout_p)

    # Step 4: context vectors z_i = Σ_j α_ij v_j  (…, Tq, Dv)
    context = guarded_pv(used, v, visible_or_all).to(query.dtype)

    steps = AttentionSteps(
        query=q,
        key=k,
        value=v,
        scores=scores,
        scaled_scores=scaled_scores,
        masked_scores=masked_scores,
        visible=visible_or_all,
        weights=weights,
        context=context,
        scale=scale,
    )
    _hooks.record(steps)
    return steps


def scaled_dot_product_attention(
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
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q Kᵀ · scale + mask) V — lecture 003's Attention(Q, K, V) = softmax(QKᵀ/√dₖ)·V: the spec.

    A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (same argument order and
    layout), with these documented differences: causal masks are aligned bottom-right, a query with no
    visible key returns zeros instead of NaN, and masked-out keys never leak into the result. The public
    :func:`selfattention.scaled_dot_product_attention` adds ``backend=`` to run a faster path instead
    (:mod:`selfattention.backends`); every path is tested against this one.

    Args:
        query: (..., H, Tq, D) floating tensor.
        key: (..., Hkv, Tk, D), same dtype and device as ``query``.
        value: (..., Hkv, Tk, Dv).
        attn_mask: optional, broadcastable to (..., H, Tq, Tk), or a
            :class:`~selfattention.visibility.Visibility` (causal at an offset, window, documents, mask).
            * bool: True = this query may attend to this key. E.g. a 2-query × 3-key mask::

                  1 1 0      query 0 sees keys 0, 1
                  0 1 1      query 1 sees keys 1, 2

            * float: added to the scaled scores (0 keeps, -inf hides, other values bias).
              A float mask of only 0s and 1s warns (:class:`FloatMaskWarning`): it was probably meant
              as a bool keep-mask.
            * torch's ``CausalBias`` (``torch.nn.attention.bias.causal_upper_left`` /
              ``causal_lower_right``): that causal mask (not together with ``is_causal=True``).
        dropout_p: probability of zeroing an attention weight (kept ones are scaled by 1/(1-p)).
            Applied only when ``training`` is True; the modules pass ``self.training``. The mask is torch's
            math backend's draw (``bernoulli_(1 - p)`` on the weights): the same seed drops the same
            weights as ``torch.nn.functional.scaled_dot_product_attention`` on CPU.
        is_causal: hide future keys, aligned **bottom-right**: query i sits at key position
            Tk - Tq + i and sees keys 0 .. Tk - Tq + i. Equal to the lower triangle when Tq == Tk;
            differs from torch SDPA (top-left) when Tq != Tk. May be combined with ``attn_mask`` (AND).
        scale: multiplies Q Kᵀ; ``None`` means 1/√D. ``0.0`` is honoured (uniform weights).
        enable_gqa: allow H to be a multiple of Hkv (grouped-query attention; query head h uses
            key/value head h // (H // Hkv)).
        training: whether dropout applies.
        return_lse: also return the log-sum-exp of each row (see Returns).

    Returns:
        Context vectors, (..., H, Tq, Dv), dtype of ``query``. A query row with no visible key (fully
        masked, or Tk = 0) gets a zero vector and zero gradient. NaN or inf in a visible key/value
        propagates (NaN in, NaN out); in a hidden one it never reaches the result.
        With ``return_lse=True``, ``(context, lse)``: lse (..., H, Tq) = log Σ_j exp(masked score_ij)
        (natural log, before dropout; float32 at least; ``-inf`` for a row that sees no key), the state
        that :func:`selfattention.merge_states` merges. Differentiable.

    Raises:
        TypeError: non-tensor or non-floating inputs, mixed dtypes, integer masks.
        ValueError: rank/size/head mismatches, a mask that does not broadcast, different devices,
            dropout_p outside [0, 1), non-finite scale.

    >>> q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> scaled_dot_product_attention(q, q, 2 * q)     # lecture 003: outputs (1.340, 0.660), (0.660, 1.340)
    tensor([[1.3395, 0.6605],
            [0.6605, 1.3395]])
    """
    check_bool("return_lse", return_lse)
    steps = attention_steps(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa=enable_gqa,
        training=training,
    )
    if return_lse:
        return steps.context, row_logsumexp(steps.masked_scores)
    return steps.context


def attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The attention weights softmax(Q Kᵀ · scale + mask), shape (..., H, Tq, Tk), float32 at least.

    Mask and causal semantics as in :func:`scaled_dot_product_attention`. Rows sum to 1, or to 0 for a
    query with no visible key.

    >>> attention_weights(torch.ones(2, 4), torch.ones(3, 4), is_causal=True)
    tensor([[0.5000, 0.5000, 0.0000],
            [0.3333, 0.3333, 0.3333]])
    """
    value = key[..., :0]  # (..., Tk, 0): no context vectors needed
    return attention_steps(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa=enable_gqa).weights


def simple_attention_steps(x: torch.Tensor) -> AttentionSteps:
    """Lecture 000's three steps for the parameter-free form, every intermediate kept.

    Query = key = value = x; no scaling (``scale=1``), no mask. See :func:`simple_attention`.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x must have shape (..., T, d), got shape {tuple(x.shape)}")
    _hooks.record({"inputs": x})
    return attention_steps(x, x, x, scale=1.0)


def simple_attention(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free self-attention Z = softmax(X Xᵀ) X (lecture 000, eq. simple-attn-matrix).

    Each input vector is its own query, key and value: ω_ij = x_i · x_j (eq. simple-attn-score, no
    1/√d scaling), α_ij = softmax_j(ω_ij) (eq. simple-attn-weight), z_i = Σ_j α_ij x_j
    (eq. simple-attn-output).

    Args:
        x: (..., T, d) floating tensor; leading dims are batch dims.

    Returns:
        Z, (..., T, d), same dtype as ``x``.

    Raises:
        TypeError: ``x`` is not a floating tensor. ValueError: fewer than 2 dims.

    >>> X = torch.tensor([[0.43, 0.15, 0.89, 0.55],    # Your      (lecture 000, Raschka ch. 3)
    ...                   [0.55, 0.87, 0.66, 0.58],    # journey
    ...                   [0.57, 0.85, 0.64, 0.80]])   # starts
    >>> simple_attention(X)[1]                          # z_journey
    tensor([0.5327, 0.7083, 0.7007, 0.6648])
    """
    return simple_attention_steps(x).context
