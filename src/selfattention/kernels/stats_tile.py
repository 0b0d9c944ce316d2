"""One job of the statistics sweep (:mod:`selfattention.kernels.stats`): a few heads × a row tile of the
score table, over its key chunks, written so that TorchScript can compile it.

Why TorchScript: the sweep's jobs run on two (or more) single-threaded workers, and a job is ~50–100
torch ops. Called from Python, every op holds the GIL while its arguments are parsed, so two workers doing
small ops run one at a time (measured here: two threads each doing 20 000 ``exp`` of 16 K elements took
2.0× one thread's time; the same loop compiled with ``torch.jit.script`` 1.1×, since a scripted function
runs without the GIL). The functions below are plain Python too: :func:`compiled` returns the scripted
``row_tile``, or the function itself where scripting is unavailable (or switched off with
``SELFATTENTION_NO_SCRIPT=1``); both compute the same thing, and the tests run both.

The score tile of a job is (heads · G · rows, keys): q carries −ℓ as one more column against a column of
ones in kᵀ, so one ``bmm`` gives the log-weights log α = s − ℓ directly.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import List, Optional, Tuple  # noqa: UP035 — TorchScript reads these annotations

import torch

from .fast_exp import exp_into

__all__ = ["compiled", "row_tile", "row_topk", "topk_rounds"]


def topk_rounds(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
    """Top-k (values, indices) along the last dim, largest first, of a short last dim: k rounds of
    ``max`` (``torch.topk`` spends ≈ 1.4 µs per row on rows of 32–64 entries on CPU, ``max`` ≈ 20 ns)."""
    if k == 1:
        return x.max(dim=-1, keepdim=True)
    if k > 8 or k >= x.size(-1):
        return x.topk(k, dim=-1)
    x = x.clone()
    vals: List[torch.Tensor] = []  # noqa: UP006
    idx: List[torch.Tensor] = []  # noqa: UP006
    for _ in range(k):
        v, i = x.max(dim=-1, keepdim=True)
        vals.append(v)
        idx.append(i)
        x.scatter_(-1, i, float("-inf"))
    return torch.cat(vals, dim=-1), torch.cat(idx, dim=-1)


def span_topk(
    s_buf: torch.Tensor,
    groups: List[torch.Tensor],  # noqa: UP006
    rows: int,
    wmax: int,
    chunks: List[Tuple[int, int]],  # noqa: UP006
    k: int,
) -> Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
    """The k best (log-weights, key columns) per row among the chunks of one span, (rows, ≤ k) each.

    Chunk c of the span is the tile (rows, w_c) at offset c·rows·wmax of ``s_buf``; every chunk but the
    last is ``wmax`` wide. ``groups`` holds each chunk's group maxima (rows, w_c // 16), group j of a
    chunk being its columns j, j + m, j + 2m, … (m = w_c // 16): the k best scores lie in the k groups with
    the largest maxima (a score outside them is beaten by k group maxima), so only their 16·k members are
    ranked; a last chunk's w mod 16 columns are ranked directly."""
    group = 16  # top-k from groups of 16 strided columns (a local: TorchScript reads no globals)
    dev = s_buf.device
    last = len(chunks) - 1
    w_last = chunks[last][1] - chunks[last][0]
    per = wmax // group
    m_last = w_last // group
    rho = torch.arange(rows, device=dev).view(rows, 1)
    flats: List[torch.Tensor] = []  # noqa: UP006
    cols: List[torch.Tensor] = []  # noqa: UP006
    if len(groups) > 0:
        # (rows, M) log-weights; −inf raised to float32's lowest so that k rounds of max pick k distinct groups
        # (a group at −inf or below that weighs 0 either way)
        gm = torch.cat(groups, dim=-1).clamp_min(-3.4028234663852886e38)
        kk = min(k, gm.size(-1))
        if gm.size(-1) > kk:
            gid = topk_rounds(gm, kk)[1]  # (torch.topk: 1.1 µs a row of 512 group maxima, 4 × max: 0.2)
        else:
            gid = torch.arange(kk, device=dev).expand(rows, kk)
        c = torch.div(gid, per, rounding_mode="floor")
        is_last = (c == last).long()
        m = (per + is_last * (m_last - per)).unsqueeze(-1)
        w = (wmax + is_last * (w_last - wmax)).unsqueeze(-1)
        local = (gid - c * per).unsqueeze(-1) + m * torch.arange(group, device=dev)  # (rows, kk, 16)
        flats.append((c.unsqueeze(-1) * (rows * wmax) + rho.unsqueeze(-1) * w + local).flatten(1))
        cols.append((c.unsqueeze(-1) * wmax + local).flatten(1))
    if w_last > group * m_last:  # the last chunk's columns past its groups
        local = torch.arange(group * m_last, w_last, device=dev).view(1, -1)
        flats.append(last * rows * wmax + rho * w_last + local)
        cols.append((last * wmax + local).expand(rows, local.size(1)))
    flat = torch.cat(flats, dim=-1)
    col = torch.cat(cols, dim=-1)
    vals = s_buf.take(flat)
    if vals.size(-1) > k:
        vals, pick = topk_rounds(vals, k)
        col = col.gather(-1, pick)
    return vals, col + chunks[0][0]


def row_tile(
    q5: torch.Tensor,
    kt: torch.Tensor,
    bias5: Optional[torch.Tensor],  # noqa: UP045
    nl5: Optional[torch.Tensor],  # noqa: UP045
    safe5: Optional[torch.Tensor],  # noqa: UP045
    ent: torch.Tensor,
    zs: Optional[torch.Tensor],  # noqa: UP045
    tv: torch.Tensor,
    ti: torch.Tensor,
    base: torch.Tensor,
    above: torch.Tensor,
    s_buf: torch.Tensor,
    p_buf: torch.Tensor,
    c_buf: torch.Tensor,
    bi: int,
    h0: int,
    h1: int,
    i0: int,
    i1: int,
    chunks: List[Tuple[int, int]],  # noqa: UP006
    causal: bool,
    top_k: int,
    columns: bool,
    blind: bool,
    finite: bool,
    floor: float,
    span: int,
) -> Optional[torch.Tensor]:  # noqa: UP045
    """Key heads [h0, h1) of batch row ``bi``, query rows [i0, i1), over their key chunks [(j0, j1)]:
    subtracts −Σ α log α of those rows from ``ent`` (B', Hk, G, R), writes their top-k log-weights and key
    positions into ``tv``/``ti`` (B', Hk, G, R, k), returns their column sums (heads, G, last column) or
    None.

    q5 (B', Hk, G, R, D + 1) scaled queries with −ℓ last, kt (B', Hk, D + 1, C) keys with a row of ones,
    bias5 broadcastable to (B', Hk, G, R, C) (−inf hides) — then q5's last column is 0 and nl5
    (B', Hk, G, R, 2) holds −ℓ and a correction, added after the bias —, ``zs`` (B', Hk, G, R) or None
    receives the rows' Σ α; safe5 bool (B', Hk, G, R) rows whose weights
    cannot fall below e^floor, ``above`` a bool square at least rows × rows, True above the diagonal;
    scratch: ``s_buf`` ≥ span·rows·wmax, ``p_buf`` and ``c_buf`` ≥ rows·wmax elements. Each chunk's
    log-weights stay in ``s_buf`` (up to ``span`` chunks) for :func:`span_topk`."""
    group = 16  # top-k from groups of 16 strided columns (a local: TorchScript reads no globals)
    g = q5.size(2)
    d1 = q5.size(4)
    n = h1 - h0
    r = i1 - i0
    if len(chunks) == 0:
        tv[bi, h0:h1, :, i0:i1] = float("-inf")
        ti[bi, h0:h1, :, i0:i1] = -1
        return None
    rows = n * g * r
    qb = q5[bi, h0:h1, :, i0:i1].reshape(n, g * r, d1)
    ktb = kt[bi, h0:h1]
    cs: Optional[torch.Tensor] = None  # noqa: UP045
    if columns:
        cs = torch.zeros((n, g, chunks[len(chunks) - 1][1]), dtype=q5.dtype, device=q5.device)
    entb = ent[bi, h0:h1, :, i0:i1]
    zb: Optional[torch.Tensor] = None  # noqa: UP045
    if zs is not None:
        zb = zs[bi, h0:h1, :, i0:i1]
    nlb: Optional[torch.Tensor] = None  # noqa: UP045
    if nl5 is not None:
        nlb = nl5[bi, h0:h1, :, i0:i1]  # (n, g, r, 2)
    bias: Optional[torch.Tensor] = None  # noqa: UP045
    if bias5 is not None:
        bias = bias5[bi] if bias5.size(0) != 1 else bias5[0]
        if bias.size(0) != 1:
            bias = bias[h0:h1]
    # no weight of these rows can fall below the floor: no clamp before exp, no threshold after
    safe = False
    if safe5 is not None:
        safe = bool(safe5[bi, h0:h1, :, i0:i1].all())
    wmax = 0
    for jj in chunks:
        wmax = max(wmax, jj[1] - jj[0])
    thr = math.exp(floor) * 1.05
    cand_v: List[torch.Tensor] = []  # noqa: UP006
    cand_i: List[torch.Tensor] = []  # noqa: UP006
    groups: List[torch.Tensor] = []  # noqa: UP006
    for ci, jj in enumerate(chunks):
        j0 = jj[0]
        j1 = jj[1]
        w = j1 - j0
        m = rows * w
        at = (ci % span) * rows * wmax
        s = torch.bmm(qb, ktb[:, :, j0:j1], out=s_buf[at : at + m].view(n, g * r, w))  # log α = s − ℓ
        s4 = s.view(n, g, r, w)
        masked = blind
        if bias is not None:
            blk = bias
            if blk.size(-2) != 1:
                blk = blk[:, :, i0:i1]
            if blk.size(-1) != 1:
                blk = blk[:, :, :, j0:j1]
            s4.add_(blk)
            if nlb is not None:  # s + bias first, then − ℓ, then the correction
                s4.add_(nlb[:, :, :, 0:1])
                s4.add_(nlb[:, :, :, 1:2])
            # −inf hides the key even where its score is NaN/inf (NaN + −inf = NaN): a select, not a sum
            s4.masked_fill_(blk == float("-inf"), float("-inf"))
            masked = True
        a = j1
        if causal and j1 > i0:  # the tile crosses the diagonal: only its last columns need the mask
            a = max(j0, i0)
            s4[:, :, :, a - j0 :].masked_fill_(above[:r, a - i0 : j1 - i0], float("-inf"))
        if top_k > 0 and w >= group:
            mg = w // group
            groups.append(s[:, :, : group * mg].unflatten(-1, (group, mg)).amax(-2).view(rows, mg))
        p = p_buf[:m].view(n, g * r, w)
        fix_tri = False
        if not finite:
            lg = torch.nan_to_num(
                s, nan=0.0, neginf=0.0, out=c_buf[:m].view(n, g * r, w)
            )  # α log α = 0 at α = 0
            exp_into(s, p)
        elif safe and not masked:
            lg = s
            exp_into(s, p)  # a masked triangle gives exp(−inf) = 0; its α log α is set to 0 below
            fix_tri = a < j1
        else:
            # the log-weights floored (a copy: the scores stay as they are for top-k), their exp thresholded
            lg = torch.clamp_min(s, floor, out=c_buf[:m].view(n, g * r, w))
            exp_into(lg, p)
            torch.threshold_(p, thr, 0.0)
        if cs is not None:
            cs[:, :, j0:j1] += p.view(n, g, r, w).sum(2)
        if zb is not None:
            zb.add_(p.sum(-1).view(n, g, r))
        p.mul_(lg)  # p is scratch: α log α in place
        if fix_tri:  # 0 · (−inf) above the diagonal
            p.view(n, g, r, w)[:, :, :, a - j0 :].masked_fill_(above[:r, a - i0 : j1 - i0], 0.0)
        entb.sub_(p.sum(-1).view(n, g, r))
        if top_k > 0 and (ci % span == span - 1 or ci == len(chunks) - 1):
            first = ci - ci % span
            v_, i_ = span_topk(s_buf, groups, rows, wmax, chunks[first : ci + 1], top_k)
            cand_v.append(v_)
            cand_i.append(i_)
            groups.clear()  # (not a new list: TorchScript would keep appending to the old one)
    if top_k == 0:
        return cs
    mv = torch.cat(cand_v, dim=-1)
    mi = torch.cat(cand_i, dim=-1)
    if mv.size(-1) < top_k:  # fewer keys than k in this view
        pad = top_k - mv.size(-1)
        mv = torch.cat([mv, torch.full((rows, pad), float("-inf"), dtype=mv.dtype, device=mv.device)], -1)
        mi = torch.cat([mi, torch.full((rows, pad), -1, dtype=mi.dtype, device=mi.device)], -1)
    if mv.size(-1) > top_k:
        mv, pick = topk_rounds(mv, top_k)
        mi = mi.gather(-1, pick)
    tv[bi, h0:h1, :, i0:i1] = mv.view(n, g, r, top_k)
    ti[bi, h0:h1, :, i0:i1] = mi.view(n, g, r, top_k) + base[bi, h0:h1]
    return cs


def row_topk(
    s_buf: torch.Tensor, rows: int, w: int, k: int, fill: float
) -> Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
    """The k best (log-weights, key columns) of each row of the (rows, w) tile at the start of ``s_buf``,
    largest first, (rows, k) each; where a row has fewer than k columns, ``fill`` and column −1 make up
    the rest (one whole-row chunk of :func:`span_topk`)."""
    group = 16
    mg = w // group
    groups: List[torch.Tensor] = []  # noqa: UP006
    if mg > 0:
        flat = s_buf[: rows * w].view(rows, w)
        groups.append(flat[:, : group * mg].unflatten(-1, (group, mg)).amax(-2))
    vals, cols = span_topk(s_buf, groups, rows, w, [(0, w)], k)
    if vals.size(-1) < k:
        pad = k - vals.size(-1)
        vals = torch.cat([vals, torch.full((rows, pad), fill, dtype=vals.dtype, device=vals.device)], -1)
        cols = torch.cat([cols, torch.full((rows, pad), -1, dtype=cols.dtype, device=cols.device)], -1)
    vals, pick = topk_rounds(vals, k)  # largest first (span_topk leaves ≤ k candidates unsorted)
    return vals, cols.gather(-1, pick)


_COMPILED: dict = {}


def compiled(fn=row_tile):
    """``fn`` (:func:`row_tile` or :func:`row_topk`) compiled by TorchScript (runs without the GIL), or the
    Python function itself where scripting fails or ``SELFATTENTION_NO_SCRIPT=1``."""
    if fn.__name__ not in _COMPILED:
        out = fn
        if os.environ.get("SELFATTENTION_NO_SCRIPT", "") not in ("1", "true", "yes"):
            try:
                with warnings.catch_warnings():
                    # torch.jit.script is deprecated in favour of torch.compile, which needs a C++ compiler
                    # at run time and seconds per shape; the scripted function is only a GIL-free loop
                    warnings.simplefilter("ignore", DeprecationWarning)
                    warnings.simplefilter("ignore", FutureWarning)
                    out = torch.jit.script(fn)
            except Exception:  # noqa: BLE001 — any scripting failure: the same function, uncompiled
                out = fn
        _COMPILED[fn.__name__] = out
    return _COMPILED[fn.__name__]
