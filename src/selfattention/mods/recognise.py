"""A ready mask mod equal to any mask_mod, recognised from what it shows: the first and last visible key
and the number of visible keys of every query row, as :func:`selfattention.flex.create_block_mask` counts
them while it evaluates the mod anyway.

attention-gym and torch's documentation write their masks as plain functions — ``q_idx >= kv_idx``,
``(q_idx - kv_idx <= W) & causal``, ``(kv_idx < P) | causal``, ``doc[q_idx] == doc[kv_idx]`` — which carry
no structure the engine can plan from; evaluated, every row of them shows one run of keys, and those runs
follow a pattern of a ready mod. :func:`equivalent` returns that mod where the runs match it *exactly*
(every row's first key, last key and count), so the engine plans the function as it plans the ready mod
(one causal call, stacked window bands, one call per document) with identical results::

    q_idx - kv_idx <= 1 and causal       first  last  count     sliding_window(1): keys q − 1 … q
      1 0 0 0                              0      0     1
      1 1 0 0                              0      1     2
      0 1 1 0                              1      2     2
      0 0 1 1                              2      3     2

Recognised: every key visible (:data:`noop_mask`), causal at an offset with or without a window
(:func:`causal_at`, :func:`sliding_window`), prefix-LM (:func:`prefix_lm`), and — square problems —
documents (:func:`document_mask`, with or without causal; the ids may differ per batch entry). Anything
else (a row with a gap: dilated windows, sink tokens, NATTEN; rows that differ by head) gives None.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from .masks import (
    MaskMod,
    and_masks,
    causal_at,
    causal_mask,
    document_mask,
    noop_mask,
    prefix_lm,
    sliding_window,
)

__all__ = ["RowRuns", "equivalent", "reads"]


class RowRuns:
    """The first visible key, last visible key and visible-key count of each row, (b, h, Tq) int64 each,
    accumulated over column tiles (:meth:`add`); rows that see nothing: first = Tk, last = −1, count 0."""

    def __init__(self, b: int, h: int, q_len: int, k_len: int) -> None:
        self.k_len = k_len
        self.first = torch.full((b, h, q_len), k_len, dtype=torch.int64)
        self.last = torch.full((b, h, q_len), -1, dtype=torch.int64)
        self.count = torch.zeros((b, h, q_len), dtype=torch.int64)

    def add(self, m: torch.Tensor, i0: int, j0: int, block: int) -> torch.Tensor:
        """A bool tile (b or 1, h or 1, R, C) of rows i0 … and keys j0 …, C a multiple of ``block``: one
        pass counts each row's keys per block; only the first and last block a row sees are read key by key.
        Returns those counts, int32 (b or 1, h or 1, R, C / block)."""
        m = m.cpu()
        per = m.unflatten(-1, (-1, block)).sum(-1, dtype=torch.int32)  # (b, h, R, blocks)
        count = per.sum(-1)
        any_ = count > 0
        nb = per.shape[-1]
        idx = torch.arange(nb, dtype=torch.int32)
        fb = torch.where(per > 0, idx, nb).amin(-1).clamp(max=nb - 1).long()  # first block with a key
        lb = torch.where(per > 0, idx, -1).amax(-1).clamp(min=0).long()  # last block with a key
        blocks = m.expand(*per.shape[:3], m.shape[-1]).unflatten(-1, (nb, block))
        up = torch.arange(1, block + 1, dtype=torch.int32)

        def at(b: torch.Tensor) -> torch.Tensor:  # (b, h, R, block): each row's block b
            return blocks.gather(3, b[..., None, None].expand(*b.shape, 1, block)).squeeze(3)

        first_in = block - (at(fb) * up.flip(0)).amax(-1)
        last_in = (at(lb) * up).amax(-1) - 1
        first = torch.where(any_, j0 + fb * block + first_in, self.k_len)
        last = torch.where(any_, j0 + lb * block + last_in, -1)
        rows = slice(i0, i0 + m.shape[-2])
        self.first[:, :, rows] = torch.minimum(self.first[:, :, rows], first)
        self.last[:, :, rows] = torch.maximum(self.last[:, :, rows], last)
        self.count[:, :, rows] += count
        return per


_CONSTANTS = {"new_ones", "new_zeros", "new_full", "new_empty", "new_tensor"}  # take only b's dtype/device


def reads(mask_mod: Callable) -> tuple[bool, bool]:
    """(whether the result depends on b, on h), proved from the mod's code as traced by
    ``torch.fx.symbolic_trace`` (no value is looked at; ``b.new_ones(())``, as torch's ``and_masks`` starts,
    depends on nothing; ``q_idx.new_tensor(h)`` depends on h). A mod that cannot be traced counts as
    reading both. Tracing sees the mod's code for proxies, not tensors (a branch on ``isinstance(h,
    torch.Tensor)`` takes the other way): :func:`selfattention.flex.create_block_mask` also evaluates the
    mod at b, h = 1 … 7 before it takes it for one that reads neither.

    >>> reads(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx), reads(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < h)
    ((False, False), (False, True))
    """
    try:
        gm = torch.fx.symbolic_trace(lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx))
    except Exception:
        return True, True
    nodes = list(gm.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    outputs = [n for n in nodes if n.op == "output"]
    if len(inputs) != 4 or len(outputs) != 1:
        return True, True
    found = []
    for source in inputs[:2]:
        depends = {source}
        for n in nodes:
            if n.op in ("placeholder", "output"):
                continue
            inputs_of = n.all_input_nodes
            if n.op == "call_method" and n.target in _CONSTANTS and n.args:
                # x.new_ones(shape) takes x's dtype and device only; its other arguments carry values
                inputs_of = [a for a in inputs_of if a is not n.args[0]]
                inputs_of += [a for a in n.args[1:] if isinstance(a, torch.fx.Node)]
            if any(a in depends for a in inputs_of):
                depends.add(n)
        found.append(any(a in depends for a in outputs[0].all_input_nodes))
    return found[0], found[1]


def equivalent(runs: RowRuns, q_len: int, k_len: int) -> MaskMod | Callable | None:
    """The ready mod that shows exactly the keys ``runs`` describes (see the module docstring), or None."""
    first, last, count = runs.first, runs.last, runs.count
    seen = count > 0
    if not bool((~seen | (count == last - first + 1)).all()):
        return None  # a row with a gap
    if not bool(((first == first[:1, :1]) & (last == last[:1, :1])).all()):
        return _documents(first, last, seen, q_len, k_len)  # rows differ by batch entry (or head)
    f, la, s = first[0, 0], last[0, 0], seen[0, 0]
    if bool(s.all()) and bool((f == 0).all()) and bool((la == k_len - 1).all()):
        return noop_mask
    for mod in (_causal(f, la, s, q_len, k_len), _prefix(f, la, s, q_len, k_len)):
        if mod is not None:
            return mod
    return _documents(first, last, seen, q_len, k_len)


def _same(lo: torch.Tensor, hi: torch.Tensor, f, la, s) -> bool:
    """Whether rows that see keys lo … hi (none where lo > hi) have these first/last keys and seen flags."""
    shown = lo <= hi
    return bool((shown == s).all()) and bool((lo[s] == f[s]).all()) and bool((hi[s] == la[s]).all())


def _causal(f, la, s, q_len: int, k_len: int) -> MaskMod | None:
    """causal_at(o) or sliding_window(W − 1, 0, o): row i sees keys max(0, i + o − W + 1) … min(i + o, Tk − 1)."""
    if not bool(s.any()):
        return None
    r = int(s.nonzero()[0])  # the first row that sees a key
    if r > 0:
        o = -r  # the rows before it sit before key 0
    elif int(la[0]) < k_len - 1:
        o = int(la[0])
    else:
        o = k_len - 1  # row 0 sees up to the last key: a larger offset is the same mask
    pos = torch.arange(q_len) + o
    hi = pos.clamp(max=k_len - 1)
    later = (s & (f > 0)).nonzero()
    if later.numel() == 0:
        return causal_at(o) if _same(torch.zeros_like(pos), hi, f, la, s) else None
    i = int(later[0])
    w = int(pos[i]) - int(f[i]) + 1  # keys i + o − W + 1 … i + o
    if w < 1:
        return None
    return sliding_window(w - 1, 0, o) if _same((pos - w + 1).clamp(min=0), hi, f, la, s) else None


def _prefix(f, la, s, q_len: int, k_len: int) -> MaskMod | None:
    """prefix_lm(P) on a square problem: row i sees keys 0 … max(i, P − 1)."""
    if q_len != k_len or not bool(s.all()) or int(la[0]) < 1:
        return None
    p = int(la[0]) + 1
    hi = torch.arange(q_len).clamp(min=p - 1)
    return prefix_lm(p) if _same(torch.zeros_like(hi), hi, f, la, s) else None


def _documents(first, last, seen, q_len: int, k_len: int) -> MaskMod | None:
    """document_mask(ids) (and causal) on a square problem: each row sees the keys of its own run of rows,
    all of them or those up to itself; the runs may differ by batch entry, never by head."""
    if q_len != k_len or not bool(seen.all()):
        return None
    if not bool(((first == first[:, :1]) & (last == last[:, :1])).all()):
        return None  # differs by head
    f, la = first[:, 0], last[:, 0]  # (b, T)
    rows = torch.arange(q_len)
    starts = f == rows  # a document starts where a row's first key is itself
    ids = starts.cumsum(-1) - 1
    start_of = torch.where(starts, rows, 0).cummax(-1).values  # the start of each row's document
    if not bool((f == start_of).all()):
        return None
    if bool((la == rows).all()):
        causal = True
    else:
        causal = False
        # the end of each row's document: the last row of its run
        end_of = torch.where(torch.cat([starts[:, 1:], torch.ones_like(starts[:, :1])], -1), rows, q_len)
        end_of = end_of.flip(-1).cummin(-1).values.flip(-1)
        if not bool((la == end_of).all()):
            return None
    ids = ids[0] if ids.shape[0] == 1 else ids
    doc = document_mask(ids)
    return and_masks(doc, causal_mask) if causal else doc
