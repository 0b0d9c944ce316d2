"""Which keys each query may see: the one predicate of this library, and its block classification.

Every path asks this module, and only this module, whether query i may attend to key j: the spec
(:mod:`selfattention.functional`) turns a :class:`Visibility` into a dense bool matrix, the mask builders of
:mod:`selfattention.masks` are its dense forms, the block engine (:mod:`selfattention.kernels`) classifies
blocks of it as skip / full / partial (the idea of flex_attention's ``BlockMask``), the KV cache hands it
"causal at offset, window W" instead of a dense (Tq, Tk) mask, and ring attention classifies its tiles with
:func:`classify`.

Positions. Key j sits at position j. Query i sits at position ``q_offset + i``; by default
``q_offset = Tk - Tq`` (**bottom-right**: the last query is the last key, as for a query chunk that follows
cached keys). Then::

    causal:     key j visible to query i  ⇔  j ≤ p(i)                      (Vaswani et al. 2017, §3.2.3)
    window W:   key j visible to query i  ⇔  p(i) − W < j ≤ p(i)           (Longformer; Mistral 7B)

Tq = 2, Tk = 4, causal (bottom-right, positions 2 and 3) and the same with ``q_offset=0`` (top-left, what
``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` does when Tq != Tk)::

    keys →   0 1 2 3            keys →   0 1 2 3
    query 0  1 1 1 0            query 0  1 0 0 0
    query 1  1 1 1 1            query 1  1 1 0 0

Documents: with ``q_doc``/``k_doc`` integer ids a query sees only keys of its own document (packed
sequences); with ``doc_offset`` set, each document's queries are aligned bottom-right on its own keys
(flash-attn's varlen convention) instead of sharing the global positions. A dense ``attn_mask`` (bool
True = attend, or float added to the scores, -inf = hidden) is ANDed with all of the above, and so is a
:class:`Predicate`: a flex_attention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (optionally with torch's
``BlockMask`` table of full / partial / empty blocks) and an additive ``score_bias(b, h, q_idx, kv_idx)``.
Whatever the constraints, :meth:`Visibility.tile` is the one function that turns them into the bias tile
of a block, for every consumer (engine, exact kernel, statistics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from .predicate import FULL, PARTIAL, SKIP, Predicate, evaluate_mod, index_tiles

__all__ = [
    "SKIP",
    "FULL",
    "PARTIAL",
    "visible",
    "same_document",
    "classify",
    "Predicate",
    "evaluate_mod",
    "index_tiles",
    "Visibility",
    "as_visibility",
]


def visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool, window: int | None = None
) -> torch.Tensor | None:
    """The predicate: bool, True where the query at ``q_pos`` may see the key at ``k_pos``.

    ``q_pos`` and ``k_pos`` are integer tensors that broadcast (e.g. (Tq, 1) and (1, Tk)). ``window`` W
    implies causal: the query at p sees keys p − W + 1 … p. Returns None when neither is set (all visible).

    >>> p = torch.arange(4)
    >>> visible(p[:, None], p[None, :], causal=True, window=2).int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    if not causal and window is None:
        return None
    vis = k_pos <= q_pos
    if window is not None:
        vis = vis & (k_pos > q_pos - window)
    return vis


def same_document(q_doc: torch.Tensor, k_doc: torch.Tensor) -> torch.Tensor:
    """Bool (..., Tq, Tk): True where query and key carry the same document id ((..., Tq), (..., Tk)).

    >>> same_document(torch.tensor([0, 0, 1]), torch.tensor([0, 1])).int()
    tensor([[1, 0],
            [1, 0],
            [0, 1]], dtype=torch.int32)
    """
    return q_doc[..., :, None] == k_doc[..., None, :]


def classify(
    q_first: int, q_last: int, k_first: int, k_last: int, *, causal: bool, window: int | None
) -> int:
    """Kind of the block of queries at positions q_first … q_last and keys at k_first … k_last under the
    predicate of :func:`visible`: :data:`SKIP`, :data:`FULL` or :data:`PARTIAL`.

    >>> classify(0, 3, 4, 7, causal=True, window=None)   # every key after every query
    0
    >>> classify(4, 7, 0, 3, causal=True, window=None)   # every key before every query
    1
    >>> classify(0, 3, 0, 3, causal=True, window=None)   # the diagonal
    2
    """
    if not causal and window is None:
        return FULL
    if k_first > q_last:
        return SKIP
    if window is not None and k_last <= q_first - window:
        return SKIP
    if k_last <= q_first and (window is None or k_first > q_last - window):
        return FULL
    return PARTIAL


def _range_kinds(lo_q, hi_q, lo_k, hi_k) -> int:
    """Document-id kind of a block from the id ranges of its queries and keys (SKIP if disjoint)."""
    if hi_k < lo_q or lo_k > hi_q:
        return SKIP
    if lo_q == hi_q == lo_k == hi_k:
        return FULL
    return PARTIAL


def _doc_local(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index inside its run, length of its run) of every position of (b, T) ids, runs of equal ids."""
    t = ids.shape[-1]
    pos = torch.arange(t, device=ids.device).expand_as(ids)
    change = torch.ones_like(ids, dtype=torch.bool)
    change[..., 1:] = ids[..., 1:] != ids[..., :-1]
    start = torch.where(change, pos, torch.zeros_like(pos)).cummax(dim=-1).values
    last = torch.ones_like(change)
    last[..., :-1] = change[..., 1:]
    end = torch.where(last, pos, torch.full_like(pos, t)).flip(-1).cummin(dim=-1).values.flip(-1)
    return pos - start, end - start + 1


@dataclass(frozen=True, eq=False)
class Visibility:
    """Which keys each query may see, without materialising the (Tq, Tk) matrix.

    Args:
        q_len, k_len: Tq and Tk.
        is_causal: hide keys after the query's position.
        window: sliding window W ≥ 1 (implies causal): the query at p sees keys p − W + 1 … p.
        q_offset: position of query 0 on the key axis; ``None`` = ``k_len - q_len`` (bottom-right).
        q_doc, k_doc: integer document ids, (b, Tq) and (b, Tk) with b = 1 or the flattened batch;
            a query sees only keys with its own id.
        attn_mask: bool (True = attend) or float (added to the scaled scores) of shape (b, h, tq, tk)
            with b ∈ {1, B}, h ∈ {1, H}, tq ∈ {1, Tq}, tk ∈ {1, Tk} (the engine's 4-D form), or any shape
            broadcastable to the scores for :meth:`dense`.
        mod: a :class:`~selfattention.predicate.Predicate` — flex_attention's ``mask_mod`` (with a
            BlockMask's tables) and an additive score bias, on absolute (b, h, q_idx, kv_idx).
        doc_offset: with document ids, each document's queries sit bottom-right on its own keys, shifted
            by ``doc_offset`` (flash-attn's varlen alignment; the query i of a document with lq queries and
            lk keys at local key position i + lk − lq + doc_offset); None = the global positions above.
            Documents [0, 0, 1 | 1 1] for queries [0, 1 | 1] with causal and ``doc_offset=0``::

                keys →   0 1 2 3 4
                query 0  1 1 0 0 0        (document 0: 1 query on 2 keys, at position 1)
                query 1  0 0 1 1 0        (document 1: 2 queries on 3 keys, at positions 1 and 2)
                query 2  0 0 1 1 1

    All constraints combine with AND. Build one for the public functions with
    ``Visibility(q_len, k_len, is_causal=True, window=512)`` and pass it as ``attn_mask``.

    >>> print(Visibility(2, 4, is_causal=True).to_mask().int())
    tensor([[1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """

    q_len: int
    k_len: int
    is_causal: bool = False
    window: int | None = None
    q_offset: int | None = None
    q_doc: torch.Tensor | None = field(default=None, repr=False)
    k_doc: torch.Tensor | None = field(default=None, repr=False)
    attn_mask: torch.Tensor | None = field(default=None, repr=False)
    mod: Predicate | None = field(default=None, repr=False)
    doc_offset: int | None = None

    def __post_init__(self) -> None:
        for name in ("q_len", "k_len"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"Visibility: {name} must be an int >= 0, got {n!r}")
        if not isinstance(self.is_causal, bool):
            raise TypeError(f"Visibility: is_causal must be a bool, got {type(self.is_causal).__name__}")
        w = self.window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise ValueError(f"Visibility: window must be a positive int or None, got {w!r}")
        o = self.q_offset
        if o is not None and (isinstance(o, bool) or not isinstance(o, int)):
            raise TypeError(f"Visibility: q_offset must be an int or None, got {type(o).__name__}")
        if (self.q_doc is None) != (self.k_doc is None):
            raise ValueError("Visibility: give both q_doc and k_doc, or neither")
        d = self.doc_offset
        if d is not None and (isinstance(d, bool) or not isinstance(d, int)):
            raise TypeError(f"Visibility: doc_offset must be an int or None, got {type(d).__name__}")
        if d is not None and self.q_doc is None:
            raise ValueError("Visibility: doc_offset needs document ids (q_doc, k_doc)")
        if self.mod is not None and not isinstance(self.mod, Predicate):
            raise TypeError(f"Visibility: mod must be a Predicate or None, got {type(self.mod).__name__}")

    # ------------------------------------------------------------------ properties
    @property
    def offset(self) -> int:
        """Position of query 0 on the key axis (``k_len - q_len`` unless ``q_offset`` was given)."""
        return self.k_len - self.q_len if self.q_offset is None else self.q_offset

    @property
    def structural(self) -> bool:
        """Whether positions matter (causal or a window)."""
        return self.is_causal or self.window is not None

    @property
    def restricts(self) -> bool:
        """Whether anything may hide a key or add to a score (else every key is visible, unbiased)."""
        return self.structural or self.q_doc is not None or self.attn_mask is not None or self.mod is not None

    @property
    def has_mask(self) -> bool:
        return self.attn_mask is not None

    def with_mask(self, mask: torch.Tensor | None) -> Visibility:
        """This visibility ANDed with a bool mask, or with a float mask added (a copy)."""
        if mask is None:
            return self
        if self.attn_mask is None:
            return replace(self, attn_mask=mask)
        a, b = self.attn_mask, mask
        if a.dtype == torch.bool and b.dtype == torch.bool:
            return replace(self, attn_mask=a & b)
        if a.dtype == torch.bool:
            a, b = b, a
        if b.dtype == torch.bool:
            merged = torch.where(b, a, torch.full((), -math.inf, dtype=a.dtype, device=a.device))
        else:
            merged = a + b
        return replace(self, attn_mask=merged)

    # ------------------------------------------------------------------ dense forms
    def positions(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(query positions (Tq, 1), key positions (1, Tk)), int64."""
        q_pos = torch.arange(self.q_len, device=device) + self.offset
        k_pos = torch.arange(self.k_len, device=device)
        return q_pos[:, None], k_pos[None, :]

    def structure(self, device: torch.device | str | None = None) -> torch.Tensor | None:
        """Bool (Tq, Tk) of the causal/window part alone; None if neither is set."""
        if not self.structural:
            return None
        q_pos, k_pos = self.positions(device)
        return visible(q_pos, k_pos, causal=self.is_causal, window=self.window)

    def to_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The dense bool mask, True = attend, broadcastable to the scores: (Tq, Tk), or more dims when
        document ids or ``attn_mask`` have them. A float ``attn_mask`` counts as visible where it is not -inf."""
        if device is None:
            for t in (self.attn_mask, self.q_doc):
                if t is not None:
                    device = t.device
                    break
        if self.doc_offset is not None or self.mod is not None:  # the tile of everything, (b, h, Tq, Tk)
            tile = self.tile(0, self.q_len, 0, self.k_len, torch.float32, device or "cpu")
            if tile is None:
                return torch.ones(self.q_len, self.k_len, dtype=torch.bool, device=device)
            return tile != -math.inf
        out = self.structure(device)
        if self.q_doc is not None:
            docs = same_document(self.q_doc, self.k_doc)  # (b, Tq, Tk)
            docs = docs.unsqueeze(-3) if docs.dim() >= 3 else docs  # heads broadcast
            out = docs if out is None else out & docs
        if self.attn_mask is not None:
            m = self.attn_mask
            keep = m if m.dtype == torch.bool else m != -math.inf
            out = keep if out is None else out & keep
        if out is None:
            out = torch.ones(self.q_len, self.k_len, dtype=torch.bool, device=device)
        return out

    def bias(self) -> torch.Tensor | None:
        """The float part of ``attn_mask`` (added to the scores), or None."""
        m = self.attn_mask
        return m if m is not None and m.is_floating_point() else None

    def dense_bias(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor | None:
        """Everything added to the scores, dense: 0 / the float mask / the score bias where visible, −inf
        where hidden; (b, h, Tq, Tk) broadcastable to the scores; None when nothing is hidden or added."""
        return self.tile(0, self.q_len, 0, self.k_len, dtype, device or "cpu")

    # ------------------------------------------------------------------ blocks
    def rows_seen(self) -> tuple[int, int]:
        """The query rows [lo, hi) that can see any key at all as far as causal/window say (others are blind)."""
        lo, hi = 0, self.q_len
        if self.k_len == 0:
            return 0, 0
        if self.structural:
            lo = max(0, -self.offset)  # position < 0: no key at or before it
            if self.window is not None:
                # position p sees keys p − W + 1 … p: nothing when p − W + 1 > Tk − 1
                hi = min(hi, max(lo, self.k_len + self.window - 1 - self.offset))
        return lo, hi

    def kind(self, i0: int, i1: int, j0: int, j1: int) -> int:
        """Kind of the block of query rows [i0, i1) × key columns [j0, j1) from causal/window and document
        ids (a dense ``attn_mask`` is classified by :meth:`mask_kinds`)."""
        if i1 <= i0 or j1 <= j0:
            return SKIP
        kind = classify(
            self.offset + i0, self.offset + i1 - 1, j0, j1 - 1, causal=self.is_causal, window=self.window
        )
        if self.doc_offset is not None and self.structural:
            kind = PARTIAL  # positions are per document: the global classification does not apply
        if kind != SKIP and self.q_doc is not None:
            qd, kd = self.q_doc[..., i0:i1], self.k_doc[..., j0:j1]
            doc = _range_kinds(int(qd.min()), int(qd.max()), int(kd.min()), int(kd.max()))
            if doc == PARTIAL and kind != SKIP:
                # ranges overlap: look at the ids themselves (per batch row)
                eq = same_document(qd, kd)
                doc = FULL if bool(eq.all()) else (PARTIAL if bool(eq.any()) else SKIP)
            kind = _combine(kind, doc)
        return kind

    def tile(
        self,
        i0: int,
        i1: int,
        j0: int,
        j1: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        structure: bool = True,
    ) -> torch.Tensor | None:
        """The additive bias of the block rows [i0, i1) × keys [j0, j1): 0 or the float mask where
        visible, -inf where hidden; shape broadcastable to (B, H, i1 − i0, j1 − j0) (4-D, as small as the
        constraints allow: a key-only mask stays (b, h, 1, w)). None when the block needs no bias.
        ``structure=False`` leaves causal/window out (for a call whose kernel applies its own causal mask)."""
        hide = None  # bool, True = hidden
        struct_kind = classify(
            self.offset + i0, self.offset + i1 - 1, j0, j1 - 1, causal=self.is_causal, window=self.window
        )
        if structure and self.structural and self.doc_offset is not None:
            # each document's queries bottom-right on its own keys (+ doc_offset)
            ql, qn = (t[:, i0:i1, None] for t in _doc_local(self.q_doc))  # (b, R, 1)
            kl, kn = (t[:, None, j0:j1] for t in _doc_local(self.k_doc))  # (b, 1, C)
            hide = ~visible(ql + kn - qn + self.doc_offset, kl, causal=self.is_causal, window=self.window)
            hide = hide[:, None]  # (b, 1, R, C); pairs of different documents are hidden below
        elif structure and self.structural and struct_kind != FULL:
            q_pos = torch.arange(i0, i1, device=device)[:, None] + self.offset
            k_pos = torch.arange(j0, j1, device=device)[None, :]
            hide = ~visible(q_pos, k_pos, causal=self.is_causal, window=self.window)
            hide = hide[None, None]  # (1, 1, R, C)
        if self.q_doc is not None:
            qd, kd = self.q_doc[:, i0:i1], self.k_doc[:, j0:j1]  # (b, R), (b, C)
            if not (bool((qd == kd[:, :1]).all()) and bool((kd == kd[:, :1]).all())):
                other = ~same_document(qd, kd)[:, None]  # (b, 1, R, C)
                hide = other if hide is None else hide | other
        add = None
        m = self.attn_mask
        if m is not None:
            rows = slice(i0, i1) if m.shape[-2] != 1 else slice(None)
            cols = slice(j0, j1) if m.shape[-1] != 1 else slice(None)
            blk = m[..., rows, cols]
            if blk.dtype == torch.bool:
                if not bool(blk.all()):
                    hide = ~blk if hide is None else hide | ~blk
            elif bool((blk != 0).any()):
                add = blk.to(dtype)
        if self.mod is not None:
            shown = self.mod.shown(i0, i1, j0, j1, device)
            if shown is not None:
                hide = ~shown if hide is None else hide | ~shown
            extra = self.mod.bias(i0, i1, j0, j1, dtype, device)
            if extra is not None:
                add = extra if add is None else add + extra
        if hide is None and add is None:
            return None
        neg = torch.full((), -math.inf, dtype=dtype, device=device)
        if add is None:
            return torch.where(hide, neg, torch.zeros((), dtype=dtype, device=device))
        return add if hide is None else torch.where(hide, neg, add)

    def mask_kinds(
        self, row_blocks: list[tuple[int, int]], col_blocks: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Kinds (n_row_blocks, n_col_blocks) int8 of the dense ``attn_mask`` alone, over every batch entry
        and head: SKIP where it hides every key, FULL where it shows every key with no bias, else PARTIAL."""
        m = self.attn_mask
        kinds = torch.full((len(row_blocks), len(col_blocks)), FULL, dtype=torch.int8)
        if self.mod is not None:
            device = m.device if m is not None else (self.q_doc.device if self.q_doc is not None else "cpu")
            kinds = self.mod.kinds(row_blocks, col_blocks, device)
            if self.mod.score_bias is not None:  # a biased block is never plain
                kinds = torch.where(kinds == FULL, PARTIAL, kinds).to(torch.int8)
        if m is None:
            return kinds
        if m.dtype == torch.bool:
            shown, plain = m, m
        else:
            shown, plain = m != -math.inf, m == 0
        shown = shown.flatten(0, -3) if shown.dim() > 2 else shown[None]  # (bh, tq, tk)
        plain = plain.flatten(0, -3) if plain.dim() > 2 else plain[None]
        rows = row_blocks if shown.shape[-2] != 1 else [(0, 1)] * len(row_blocks)
        for a, (i0, i1) in enumerate(rows):
            any_row = shown[:, i0:i1].any(dim=1).any(dim=0)  # (tk,)
            all_row = plain[:, i0:i1].all(dim=1).all(dim=0)
            for c, (j0, j1) in enumerate(col_blocks):
                cs = slice(j0, j1) if any_row.shape[0] != 1 else slice(None)
                if not bool(any_row[cs].any()):
                    kinds[a, c] = SKIP
                elif not bool(all_row[cs].all()) and kinds[a, c] == FULL:
                    kinds[a, c] = PARTIAL
        return kinds


def _combine(a: int, b: int) -> int:
    if a == SKIP or b == SKIP:
        return SKIP
    if a == FULL and b == FULL:
        return FULL
    return PARTIAL


def as_visibility(
    attn_mask: torch.Tensor | Visibility | None, is_causal: bool, q_len: int, k_len: int
) -> Visibility:
    """The public arguments ``attn_mask`` (a tensor, a :class:`Visibility` or None) and ``is_causal`` as one
    :class:`Visibility` for Tq = ``q_len``, Tk = ``k_len``.

    Raises ``ValueError`` when a Visibility was made for other lengths, or when ``is_causal=True`` meets a
    Visibility whose queries are not placed bottom-right (two different causal masks).
    """
    if not isinstance(attn_mask, Visibility):
        return Visibility(q_len, k_len, is_causal=is_causal, attn_mask=attn_mask)
    vis = attn_mask
    if (vis.q_len, vis.k_len) != (q_len, k_len):
        raise ValueError(
            f"attn_mask is a Visibility for Tq={vis.q_len}, Tk={vis.k_len} but query/key have Tq={q_len}, "
            f"Tk={k_len}"
        )
    if is_causal and not vis.is_causal:
        if vis.q_offset not in (None, k_len - q_len):
            raise ValueError(
                f"is_causal=True with a Visibility whose queries start at key position {vis.q_offset} "
                f"(not bottom-right, {k_len - q_len}): put is_causal in the Visibility instead"
            )
        vis = replace(vis, is_causal=True)
    return vis
