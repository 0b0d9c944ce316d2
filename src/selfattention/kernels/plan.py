"""The block plan: which kernel calls compute an attention problem, and which parts are never computed.

A :class:`~selfattention.visibility.Visibility` says which keys each query sees; the plan turns it into a
short list of :class:`Call`\\ s, each a rectangle of query rows × key columns handed to one block kernel
(:mod:`selfattention.kernels.vendor` or :mod:`selfattention.kernels.exact`). Rows covered by several calls
are merged by log-sum-exp (:mod:`selfattention.kernels.merge`); rows covered by none see no key (zeros).
The plan is built once and shared by the forward and the backward pass.

Strategies, cheapest first (the vendor kernel is fastest on few, large calls):

* nothing hidden → **one call** (what torch SDPA costs);
* causal at an offset → a **dense prefix + the causal square** on the diagonal (the kernel's own causal
  mask; a square call is the same top-left or bottom-right, so every vendor kernel agrees)::

      Tq = 3, Tk = 5 (bottom-right)        keys →  0 1 │ 2 3 4
                                           query 0  ■ ■ │ ◣ . .      ■ prefix call (no mask)
                                           query 1  ■ ■ │ ◣ ◣ .      ◣ causal call
                                           query 2  ■ ■ │ ◣ ◣ ◣

* sliding window W → the rows whose window reaches key 0 as above, then **bands**: every block of
  ``block_q`` rows sees W − 1 + block_q keys, with the same relative mask, so all those calls are **stacked
  into one kernel call** through strided views of the keys (no copy);
* sorted document ids shared by the batch → **one call per document** (stacked when documents repeat the
  same size), each with the structure above inside;
* anything else (dense masks, unsorted documents) → ``block_q`` × ``block_k`` blocks classified
  skip / full / partial; each query block gets one call per run of non-skipped key blocks, with a bias
  tile only when the run holds a partial block.

A key-only mask (e.g. padding, shape (b, 1, 1, Tk)) rides along any of the first strategies as a broadcast
bias and never needs a dense tile.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..visibility import FULL, PARTIAL, SKIP, Visibility

__all__ = ["Call", "Plan", "make_plan", "row_spans", "band_options", "BAND_ROWS_CPU"]


@dataclass(frozen=True)
class Call:
    """One kernel call: query rows [r0, r0 + rows) × key columns [c0, c0 + cols), or ``count`` of them
    stacked (sub-call n covers rows r0 + n·rows … and key columns c0 + n·step …).

    ``causal``: the rectangle is a square on the diagonal and the kernel applies its own causal mask.
    ``tile``: the kernel gets the bias of :meth:`Visibility.tile` (the same for every stacked sub-call).
    """

    r0: int
    rows: int
    c0: int
    cols: int
    causal: bool = False
    tile: bool = False
    count: int = 1
    step: int = 0

    @property
    def r1(self) -> int:
        return self.r0 + self.count * self.rows

    @property
    def c1(self) -> int:
        return self.c0 + (self.count - 1) * self.step + self.cols

    def entries(self) -> int:
        """Score entries handed to the kernel (a causal square counts its lower triangle)."""
        per = self.rows * (self.rows + 1) // 2 if self.causal else self.rows * self.cols
        return per * self.count

    def shifted(self, dr: int, dc: int) -> Call:
        return replace(self, r0=self.r0 + dr, c0=self.c0 + dc)


@dataclass
class Plan:
    """The calls of one problem; ``strategy`` names how they were chosen (for benchmarks and tests)."""

    calls: list[Call] = field(default_factory=list)
    strategy: str = "empty"
    block_q: int = 128
    block_k: int = 512

    def entries(self) -> int:
        return sum(c.entries() for c in self.calls)


def _row_independent(vis: Visibility) -> bool:
    m = vis.attn_mask
    return m is None or m.shape[-2] == 1


def make_plan(
    vis: Visibility,
    block_q: int,
    block_k: int,
    *,
    every_tile: bool = False,
    band_rows: int | None = None,
    band_align: int = 1,
) -> Plan:
    """The calls that compute ``vis``'s problem (see the module docstring).

    ``every_tile``: every non-skipped block gets a bias tile (the exact kernel then computes dS for the
    gradient of a float mask everywhere it is added). ``band_rows``: query rows of each stacked window band
    (default ``block_q``); ``band_align``: a band's key count is rounded up to a multiple of it where the
    keys allow (the extra keys are hidden by the band's tile) — see :func:`band_options`.
    """
    tq, tk = vis.q_len, vis.k_len
    plan = Plan(block_q=block_q, block_k=block_k)
    if tq == 0 or tk == 0:
        return plan
    if every_tile and vis.attn_mask is not None:
        return _generic(vis, block_q, block_k, plan, every_tile=True)
    if vis.mod is not None:  # a mask_mod / score bias: blocks classified by evaluating it
        prefix = _prefix_lm(vis, block_q, block_k)
        if prefix is not None:
            plan.calls, plan.strategy = prefix, "prefix-LM"
            return plan
        return _generic(vis, block_q, block_k, plan, every_tile=vis.mod.score_bias is not None)
    if vis.q_doc is None and _row_independent(vis):
        band = (band_rows or block_q, band_align)
        plan.calls = _structural(vis, 0, 0, tq, tk, block_q, vis.attn_mask is not None, band)
        plan.strategy = "single" if not vis.structural else ("window" if vis.window else "causal")
        return plan
    if vis.attn_mask is None and _sorted_shared_docs(vis):
        plan.calls = _documents(vis, block_q)
        plan.strategy = "documents"
        return plan
    plan = _generic(vis, block_q, block_k, plan, every_tile=False)
    if vis.q_doc is None and not vis.structural and _covers_everything(plan, tq, tk):
        # a dense mask that hides no whole block: one call with the whole bias beats a call per block
        plan.calls, plan.strategy = [Call(0, tq, 0, tk, tile=True)], "single"
    return plan


def _prefix_lm(vis: Visibility, bq: int, bk: int) -> list[Call] | None:
    """Two calls for :func:`selfattention.mods.prefix_lm` (keys < P seen by all, causal after), when it is
    the whole visibility of a square problem: every row × the P prefix keys, and the causal square on
    the diagonal after them — instead of a rectangle, a tile and a merge per row block::

        keys:  P P | 3 4 5        rows 0–2 see keys 0–1 (the prefix, call 1) and the diagonal of keys 2..
        row 2  1 1 | 1 0 0        (call 2: rows ≥ P × keys ≥ P, the kernel's own causal square; rows < P
        row 3  1 1 | 1 1 0        see no key ≥ P there: for them the causal square starts at P)
        row 4  1 1 | 1 1 1

    None where the predicate is anything else, or its block table (a BlockMask's) disagrees with that
    structure."""
    from ..mods.masks import PrefixLM  # (core: the mask mods; imported here only to recognise one)

    mod = vis.mod
    if (
        not isinstance(mod.mask_mod, PrefixLM)
        or mod.score_bias is not None
        or vis.structural
        or vis.attn_mask is not None
        or vis.q_doc is not None
        or vis.q_len != vis.k_len
    ):
        return None
    t, p = vis.q_len, max(0, min(int(mod.mask_mod.prefix_len), vis.k_len))
    if mod.block_kinds is not None:  # a BlockMask's table: FULL shows a block whatever the mod says
        rows, cols, table = _grid(vis, bq, bk)
        for (i0, i1), kinds in zip(rows, table, strict=True):
            for (j0, j1), kind in zip(cols, kinds, strict=True):
                full = j1 <= p or j1 - 1 <= i0
                skip = j0 >= p and j0 > i1 - 1
                if (kind == SKIP) != skip or (kind == FULL and not full):
                    return None
    if p >= t:
        return [Call(0, t, 0, t)]
    calls = [Call(0, t, 0, p)] if p > 0 else []
    return calls + [Call(p, t - p, p, t - p, causal=True)]


def _covers_everything(plan: Plan, tq: int, tk: int) -> bool:
    return sum(c.rows * c.cols for c in plan.calls) == tq * tk


# ---------------------------------------------------------------------------------------------------------
# Structural problems (causal / window at an offset), also the inside of one document
# ---------------------------------------------------------------------------------------------------------


def _structural(
    vis: Visibility,
    r_base: int,
    c_base: int,
    tq: int,
    tk: int,
    bq: int,
    tile: bool,
    band: tuple[int, int] | None = None,
) -> list[Call]:
    """Calls for query rows [0, tq) × keys [0, tk) of a problem whose only constraints are causal/window
    (query i at key position ``off + i``), shifted by (r_base, c_base). ``tile``: a row-independent mask
    rides along as a bias on every call. ``band``: (rows, key alignment) of the stacked window bands."""
    off = vis.offset
    if not vis.structural:
        return [Call(r_base, tq, c_base, tk, tile=tile)]
    calls: list[Call] = []
    d0, d1 = max(0, -off), max(0, min(tq, tk - off))  # rows whose position falls on a key
    w = vis.window
    if d1 > d0:
        e = d1 if w is None else max(d0, min(d1, w - off))  # rows whose window reaches key 0 (pure causal)
        if e - d0 == 1:  # one row: its whole past, no causal work (a decoding step)
            calls.append(Call(d0, 1, 0, off + e, tile=tile))
        elif e > d0:
            if off + d0 > 0:
                calls.append(Call(d0, e - d0, 0, off + d0, tile=tile))  # dense prefix
            calls.append(Call(d0, e - d0, off + d0, e - d0, causal=True, tile=tile))  # diagonal square
        if w is not None and d1 > e:
            cols = w - 1 + bq
            n = (d1 - e) // bq
            br, align = band if band is not None else (bq, 1)
            nb = (d1 - e) // br
            if (
                nb and not tile
            ):  # bands: rows [e, e + nb·br), band b sees keys off + e + b·br − w + 1 … + cols
                calls.append(_band(e, br, off + e - w + 1, w - 1 + br, nb, align, tk))
                a = e + nb * br
            else:  # a mask rides along: its tile differs from band to band, so no stacking
                calls += [Call(e + b * bq, bq, off + e + b * bq - w + 1, cols, tile=True) for b in range(n)]
                a = e + n * bq
            if d1 > a:
                calls.append(Call(a, d1 - a, off + a - w + 1, w - 1 + d1 - a, tile=True))
    if d1 < tq:
        # rows at positions ≥ tk: every key is in the past; a window may have dropped the early ones
        lo_rows = max(d1, d0)
        if w is None:
            calls.append(Call(lo_rows, tq - lo_rows, 0, tk, tile=tile))
        else:
            for a in range(lo_rows, tq, bq):
                b = min(tq, a + bq)
                c0 = max(0, off + a - w + 1)
                if c0 < tk:
                    calls.append(Call(a, b - a, c0, tk - c0, tile=True))
    return [c.shifted(r_base, c_base) for c in calls]


def _band(r0: int, rows: int, c0: int, cols: int, count: int, align: int, tk: int) -> Call:
    """The stacked band call, its key count rounded up to a multiple of ``align`` by keys on its left (or,
    where the first band starts too close to key 0, on its right) when they exist: the tile hides them, and
    the fused CPU kernel runs ≈ 10 % faster on a key count that is a multiple of 16 than on W − 1 + rows."""
    pad = -cols % align
    if pad and c0 >= pad:
        c0, cols = c0 - pad, cols + pad
    elif pad and c0 + (count - 1) * rows + cols + pad <= tk:
        cols += pad
    return Call(r0, rows, c0, cols, tile=True, count=count, step=rows)


BAND_ROWS_CPU = 32
"""Rows of a stacked window band on torch's fused CPU kernel. That kernel splits a call's rows into blocks
of 32 when it has fewer than 192 (and every block computes every key of the call), so a band of 32 rows
costs no more per entry than one of 128 and computes W − 1 + 32 keys per row instead of W − 1 + 128."""


def band_options(device_type: str, kernel: str, block_q: int) -> dict:
    """``band_rows``/``band_align`` for :func:`make_plan` on a kernel and device: for the vendor kernel on
    CPU, bands of at most :data:`BAND_ROWS_CPU` rows with a key count that is a multiple of 16 (measured
    in docs/performance.md, "The sliding window on the fused CPU kernel"); elsewhere ``block_q``."""
    if device_type == "cpu" and kernel == "vendor":
        return {"band_rows": min(block_q, BAND_ROWS_CPU), "band_align": 16}
    return {}


# ---------------------------------------------------------------------------------------------------------
# Documents
# ---------------------------------------------------------------------------------------------------------


def _runs(ids) -> list[tuple[int, int, int]]:
    """(id, start, end) of the runs of equal ids in a 1-D integer tensor."""
    vals = ids.tolist()
    runs, start = [], 0
    for i in range(1, len(vals) + 1):
        if i == len(vals) or vals[i] != vals[start]:
            runs.append((vals[start], start, i))
            start = i
    return runs


def _sorted_shared_docs(vis: Visibility) -> bool:
    if vis.q_doc is None:
        return False
    for ids in (vis.q_doc, vis.k_doc):
        if ids.shape[0] > 1 and not bool((ids == ids[:1]).all()):
            return False
        row = ids[0]
        if row.numel() > 1 and not bool((row[1:] >= row[:-1]).all()):
            return False
    return True


def _documents(vis: Visibility, bq: int) -> list[Call]:
    k_runs = {d: (c, e) for d, c, e in _runs(vis.k_doc[0])}
    docs = []  # (a, c, sub-calls relative to the document's corner)
    for d, a, b in _runs(vis.q_doc[0]):
        if d not in k_runs:
            continue  # these queries see no key
        c, e = k_runs[d]
        off = vis.offset + a - c if vis.doc_offset is None else (e - c) - (b - a) + vis.doc_offset
        sub = Visibility(b - a, e - c, is_causal=vis.is_causal, window=vis.window, q_offset=off)
        docs.append((a, c, b - a, e - c, _structural(sub, 0, 0, b - a, e - c, bq, False)))
    calls: list[Call] = []
    i = 0
    while i < len(docs):
        a, c, lq, lk, sub = docs[i]
        j = i + 1
        stackable = all(s.count == 1 and s.r0 == 0 and s.rows == lq for s in sub)
        while stackable and j < len(docs):
            a2, c2, lq2, lk2, sub2 = docs[j]
            if (lq2, lk2, sub2) != (lq, lk, sub) or a2 != a + (j - i) * lq or c2 != c + (j - i) * lk:
                break
            j += 1
        n = j - i
        for s in sub:
            if n > 1:
                calls.append(replace(s.shifted(a, c), count=n, step=lk))
            else:
                calls.append(s.shifted(a, c))
        i = j
    return calls


# ---------------------------------------------------------------------------------------------------------
# Anything else: a grid of blocks
# ---------------------------------------------------------------------------------------------------------


def _grid(vis: Visibility, bq: int, bk: int):
    """Row blocks, column blocks and, per row block, the kind of each of its blocks."""
    tq, tk = vis.q_len, vis.k_len
    rows = [(i, min(tq, i + bq)) for i in range(0, tq, bq)]
    cols = [(j, min(tk, j + bk)) for j in range(0, tk, bk)]
    mkinds = vis.mask_kinds(rows, cols).tolist()
    if not (vis.structural or vis.q_doc is not None):  # the mask's kinds are the kinds
        return rows, cols, mkinds
    table = []
    for a, (i0, i1) in enumerate(rows):
        kinds = []
        for c, (j0, j1) in enumerate(cols):
            mk = mkinds[a][c]
            kind = SKIP if mk == SKIP else vis.kind(i0, i1, j0, j1)
            if kind != SKIP and mk == PARTIAL:
                kind = PARTIAL
            kinds.append(kind)
        table.append(kinds)
    return rows, cols, table


def row_spans(vis: Visibility, bq: int, bk: int) -> list[tuple[int, int, int, int]]:
    """(i0, i1, c0, c1) per block of ``bq`` query rows that sees any key: the keys from its first to its
    last non-skipped block of ``bk`` keys (for kernels that take one span of keys per row block)."""
    if vis.q_len == 0 or vis.k_len == 0:
        return []
    rows, cols, table = _grid(vis, bq, bk)
    out = []
    for (i0, i1), kinds in zip(rows, table, strict=True):
        seen = [c for c, kind in enumerate(kinds) if kind != SKIP]
        if seen:
            out.append((i0, i1, cols[seen[0]][0], cols[seen[-1]][1]))
    return out


def _generic(vis: Visibility, bq: int, bk: int, plan: Plan, *, every_tile: bool) -> Plan:
    rows, cols, table = _grid(vis, bq, bk)
    last: dict[tuple[int, int, bool], int] = {}  # segment of the previous row block → index of its call
    for (i0, i1), kinds in zip(rows, table, strict=True):
        here: dict[tuple[int, int, bool], int] = {}
        for seg in _segments(cols, kinds, every_tile):
            n = last.get(seg)
            prev = plan.calls[n] if n is not None else None
            if (
                prev is not None
                and prev.r1 == i0
                and (not seg[2] or (prev.rows + i1 - i0) * prev.cols <= _TILE_MAX)
            ):
                plan.calls[n] = replace(prev, rows=prev.rows + i1 - i0)  # the same keys as the rows above
                here[seg] = n
            else:
                here[seg] = len(plan.calls)
                plan.calls.append(Call(i0, i1 - i0, seg[0], seg[1] - seg[0], tile=seg[2]))
        last = here
    plan.strategy = "blocks"
    return plan


_TILE_MAX = 1 << 20
"""Entries of a bias tile beyond which row blocks with the same keys are not merged into one call."""


def _segments(cols: list[tuple[int, int]], kinds: list[int], every_tile: bool) -> list[tuple[int, int, bool]]:
    """(first key, end key, needs a tile) of the calls of one row block: runs of non-skipped blocks, split
    into runs of full blocks (no tile) and of partial ones (a lone full block joins its partial
    neighbours: one call with a tile costs less than two calls and a merge)."""
    groups: list[list] = []  # [tile, first block, last block]
    for c, kind in enumerate(kinds):
        if kind == SKIP:
            groups.append(None)
            continue
        tile = every_tile or kind != FULL
        g = groups[-1] if groups else None
        if g is not None and g[0] == tile:
            g[2] = c
        else:
            groups.append([tile, c, c])
    runs = [g for g in groups if g is not None]
    for n, g in enumerate(groups):  # a lone full block between partial ones (or at a run's end)
        if g is None or g[0] or g[2] > g[1]:
            continue
        nb = [groups[m] for m in (n - 1, n + 1) if 0 <= m < len(groups) and groups[m] is not None]
        if nb and all(x[0] for x in nb):
            g[0] = True
    out: list[tuple[int, int, bool]] = []
    prev_end = None
    for g in runs:
        j0, j1 = cols[g[1]][0], cols[g[2]][1]
        if out and out[-1][2] and g[0] and prev_end == g[1]:
            out[-1] = (out[-1][0], j1, True)
        else:
            out.append((j0, j1, g[0]))
        prev_end = g[2] + 1
    return out
