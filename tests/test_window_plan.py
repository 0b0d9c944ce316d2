"""The sliding window's plan on the fused CPU kernel: 32-row stacked bands with aligned key counts forward,
and the band backward in large products (kernels/band.py), against float64 oracles.

The band backward serves long bands only (kernels/band.py's MIN_CHUNKS chunks of CHUNK rows); most tests
shrink both so that short sequences take it too, and count that it ran — a test that silently took the
fused kernel's own backward would prove nothing about the new path.
"""

from __future__ import annotations

import math

import pytest
import torch

import selfattention as sa
from selfattention import mods
from selfattention.kernels import band, engine
from selfattention.kernels.plan import BAND_ROWS_CPU, band_options, make_plan
from selfattention.tiled import describe, tiled_attention
from selfattention.visibility import Visibility
from tests.oracle import attention_ref, visible_mask


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 32 rows from 2 chunks on, and a count of the band backward's calls."""
    monkeypatch.setattr(band, "CHUNK", 32)
    monkeypatch.setattr(band, "MIN_CHUNKS", 2)
    calls = []
    real = band.backward

    def counted(*args, **kw):
        calls.append(args[0])
        return real(*args, **kw)

    monkeypatch.setattr(band, "backward", counted)
    return calls


def _dense_ref(q, k, v, keep, scale=None):
    """float64 softmax(q kᵀ·scale, hidden = −inf) v with grouped heads; rows that see nothing: 0."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None].clamp(min=-1e300)).nan_to_num(0.0)
    return p @ vv, lse


def _window_keep(tq, tk, w):
    pos = torch.arange(tq)[:, None] + tk - tq
    j = torch.arange(tk)[None, :]
    return (j <= pos) & (j > pos - w)


def _inputs(b, h, hk, tq, tk, d, dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return (
        mk(b, h, tq, d),
        mk(b, hk, tk, d),
        mk(b, hk, tk, dv),
        torch.randn(b, h, tq, dv, generator=g, dtype=dtype),
    )


def _grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do)


CASES = [  # (b, h, hk, tq, tk, d, dv, window)
    (1, 2, 2, 300, 300, 8, 8, 64),  # bands and a remainder shorter than a chunk
    (2, 4, 2, 263, 263, 12, 5, 37),  # GQA, B > 1, Dv ≠ D, a window that divides nothing
    (1, 3, 1, 250, 301, 7, 7, 50),  # Tq < Tk (bottom-right), multi-query
    (1, 2, 2, 333, 333, 16, 16, 100),
]


@pytest.mark.parametrize("case", CASES)
def test_band_backward_matches_the_loop_oracle(case, small_chunks):
    b, h, hk, tq, tk, d, dv, w = case
    q, k, v, do = _inputs(b, h, hk, tq, tk, d, dv, seed=sum(case))
    assert describe(q, k, v, window=w, is_causal=True, enable_gqa=True).kernel == "vendor"
    out = tiled_attention(q, k, v, window=w, is_causal=True, enable_gqa=True)
    got = _grads(out, (q, k, v), do)
    assert small_chunks, "the band backward did not run"
    g = h // hk
    ref, _ = attention_ref(
        q.detach(), k.detach().repeat_interleave(g, 1), v.detach().repeat_interleave(g, 1),
        attn_mask=visible_mask(tq, tk, window=w),
    )  # fmt: skip
    torch.testing.assert_close(out.detach(), ref, atol=1e-10, rtol=1e-10)
    qd, kd, vd = (t.detach().clone().requires_grad_() for t in (q, k, v))
    dense, _ = _dense_ref(qd, kd, vd, _window_keep(tq, tk, w))
    want = _grads(dense, (qd, kd, vd), do)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


def test_the_default_chunks_serve_a_long_band_float32():
    calls = []
    real = band.backward
    band.backward = lambda *a, **kw: (calls.append(a[0]), real(*a, **kw))[1]
    try:
        tq, w = band.MIN_CHUNKS * band.CHUNK + 700, 300  # whole chunks and a remainder
        q, k, v, do = _inputs(1, 2, 2, tq, tq, 16, 16, dtype=torch.float32, seed=3)
        out = tiled_attention(q, k, v, window=w, is_causal=True)
        got = _grads(out, (q, k, v), do)
    finally:
        band.backward = real
    assert calls and calls[0].count >= band.MIN_CHUNKS
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    dense, _ = _dense_ref(qd, kd, vd, _window_keep(tq, tq, w))
    want = _grads(dense, (qd, kd, vd), do.double())
    torch.testing.assert_close(out.detach().double(), dense.detach(), atol=1e-5, rtol=1e-5)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), e, atol=2e-5, rtol=1e-5)


def test_the_log_sum_exp_and_its_gradient(small_chunks):
    # flex_attention's lse, and a loss through it (dS gains + dℓ): the band backward takes it as a column
    tq, w = 290, 70
    q, k, v, do = _inputs(1, 2, 2, tq, tq, 8, 8, seed=11)
    bm = sa.create_block_mask(mods.sliding_window(w - 1), None, None, tq, tq, device="cpu")
    out, lse = sa.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    dl = torch.randn(lse.shape, dtype=lse.dtype)
    got = torch.autograd.grad((out * do).sum() + (lse * dl).sum(), (q, k, v))
    assert small_chunks
    qd, kd, vd = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _dense_ref(qd, kd, vd, _window_keep(tq, tq, w), scale=1 / math.sqrt(8))
    torch.testing.assert_close(lse.detach(), ref_lse.detach(), atol=1e-10, rtol=1e-10)
    want = torch.autograd.grad((ref * do).sum() + (ref_lse * dl).sum(), (qd, kd, vd))
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


def test_blind_rows_get_zeros_and_zero_gradients(small_chunks):
    # Tq > Tk: the first queries sit before key 0 (bottom-right) and see nothing
    tq, tk, w = 320, 260, 40
    q, k, v, do = _inputs(1, 2, 2, tq, tk, 8, 8, seed=5)
    out = tiled_attention(q, k, v, window=w, is_causal=True)
    gq, gk, gv = _grads(out, (q, k, v), do)
    blind = tq - tk
    assert torch.isfinite(out).all() and torch.isfinite(gq).all() and torch.isfinite(gk).all()
    assert (out[:, :, :blind] == 0).all() and (gq[:, :, :blind] == 0).all()
    qd, kd, vd = (t.detach().clone().requires_grad_() for t in (q, k, v))
    dense, _ = _dense_ref(qd, kd, vd, _window_keep(tq, tk, w))
    want = _grads(dense, (qd, kd, vd), do)
    torch.testing.assert_close(out.detach(), dense.detach(), atol=1e-10, rtol=1e-10)
    for a, e in zip((gq, gk, gv), want, strict=True):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("left,right", [(20, 5), (0, 9), (33, 33)])
def test_two_sided_windows_match_the_dense_oracle(left, right, small_chunks):
    t = 230
    q, k, v, do = _inputs(1, 2, 2, t, t, 8, 8, seed=left + right)
    bm = sa.create_block_mask(mods.sliding_window(left, right), None, None, t, t, device="cpu")
    out = sa.flex_attention(q, k, v, block_mask=bm)
    got = _grads(out, (q, k, v), do)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    keep = (j >= i - left) & (j <= i + right)
    qd, kd, vd = (x.detach().clone().requires_grad_() for x in (q, k, v))
    dense, _ = _dense_ref(qd, kd, vd, keep)
    torch.testing.assert_close(out.detach(), dense.detach(), atol=1e-10, rtol=1e-10)
    for a, e in zip(got, _grads(dense, (qd, kd, vd), do), strict=True):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


def test_flash_window_size_matches_the_dense_oracle(small_chunks):
    from selfattention.flash import flash_attn_func

    t, left = 300, 45
    q, k, v, do = _inputs(1, 2, 2, t, t, 8, 8, seed=9)
    tr = [x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]  # (B, T, H, D)
    out = flash_attn_func(*tr, causal=True, window_size=(left, 0))
    got = _grads(out, tr, do.transpose(1, 2))
    qd, kd, vd = (x.detach().clone().requires_grad_() for x in (q, k, v))
    dense, _ = _dense_ref(qd, kd, vd, _window_keep(t, t, left + 1))
    torch.testing.assert_close(out.detach().transpose(1, 2), dense.detach(), atol=1e-10, rtol=1e-10)
    for a, e in zip(got, _grads(dense, (qd, kd, vd), do), strict=True):
        torch.testing.assert_close(a.transpose(1, 2), e, atol=1e-10, rtol=1e-10)


def test_bfloat16_within_twice_the_naive_error(small_chunks):
    t, w = 300, 64
    q, k, v, do = _inputs(1, 2, 2, t, t, 16, 16, dtype=torch.float32, seed=21)
    qb, kb, vb = (x.detach().bfloat16().requires_grad_() for x in (q, k, v))
    out = tiled_attention(qb, kb, vb, window=w, is_causal=True)
    got = _grads(out, (qb, kb, vb), do.bfloat16())
    assert small_chunks
    keep = _window_keep(t, t, w)
    qd, kd, vd = (x.detach().bfloat16().double().requires_grad_() for x in (q, k, v))
    ref, _ = _dense_ref(qd, kd, vd, keep)
    ref_g = _grads(ref, (qd, kd, vd), do.bfloat16().double())
    # the naive bfloat16 computation: the same formula in bfloat16 ops
    qn, kn, vn = (x.detach().bfloat16().requires_grad_() for x in (q, k, v))
    s = ((qn @ kn.transpose(-1, -2)) * (1 / math.sqrt(16))).masked_fill(~keep, -math.inf)
    naive = torch.softmax(s, -1) @ vn
    naive_g = _grads(naive, (qn, kn, vn), do.bfloat16())
    err = lambda a, r: (a.double() - r).abs().max().item()  # noqa: E731
    assert err(out, ref.detach()) <= 2 * err(naive, ref.detach())
    for a, n, r in zip(got, naive_g, ref_g, strict=True):
        assert err(a, r) <= 2 * err(n, r)


def test_cpu_vendor_plan_uses_32_row_bands_with_aligned_keys():
    opts = band_options("cpu", "vendor", 128)
    assert opts == {"band_rows": BAND_ROWS_CPU, "band_align": 16}
    assert band_options("cpu", "exact", 128) == {} and band_options("cuda", "vendor", 128) == {}
    plan = make_plan(Visibility(16384, 16384, window=512), 128, 512, **opts)
    stacked = [c for c in plan.calls if c.count > 1]
    assert len(stacked) == 1 and stacked[0].rows == 32 and stacked[0].cols % 16 == 0
    assert stacked[0].cols >= 511 + 32 and stacked[0].count == (16384 - 512) // 32
    # every visible pair is computed once: the calls' rows cover each row exactly once
    rows = torch.zeros(16384, dtype=torch.int64)
    for c in plan.calls:
        rows[c.r0 : c.r1] += 1
    assert (rows == 1).all()
    info = describe(
        torch.zeros(1, 1, 16384, 8), torch.zeros(1, 1, 16384, 8), torch.zeros(1, 1, 16384, 8), window=512
    )
    assert info.calls == 2 and info.computed_fraction < (512 + 32 + 1) / 16384


def test_band_split_covers_the_band_exactly():
    plan = make_plan(Visibility(5000, 5000, window=300), 128, 512, band_rows=32, band_align=16)
    (call,) = [c for c in plan.calls if c.count > 1]
    assert band.usable(call)
    head, rest = band.split(call)
    assert head.r0 == call.r0 and head.rows == band.CHUNK and head.step == band.CHUNK
    assert head.cols == call.cols - call.rows + band.CHUNK
    end = head.r1 if rest is None else rest.r1
    assert end == call.r1 and (rest is None or rest.r0 == head.r1)
    assert engine.band is band  # the engine's backward goes through this module


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_forward_in_pieces_on_the_pool_matches_the_oracle(two_threads, monkeypatch):
    # with 2 threads a long stacked band runs as single-threaded pieces (kernels/band.py's forward_pieces)
    monkeypatch.setattr(band, "POOL_MIN_ENTRIES", 0)
    pieces = []
    real = band.forward_pieces
    monkeypatch.setattr(band, "forward_pieces", lambda *a: (pieces.append(a[1]), real(*a))[1])
    tq, w = 611, 50
    q, k, v, _ = _inputs(2, 2, 1, tq, tq, 8, 6, seed=17)
    with torch.no_grad():
        out = tiled_attention(q, k, v, window=w, is_causal=True, enable_gqa=True)
    assert pieces and pieces[0].count >= band.POOL_PIECES * 2
    dense, _ = _dense_ref(q.detach(), k.detach(), v.detach(), _window_keep(tq, tq, w))
    torch.testing.assert_close(out, dense, atol=1e-10, rtol=1e-10)


def test_a_nan_key_in_a_pooled_piece_falls_back_like_the_single_call(two_threads, monkeypatch):
    monkeypatch.setattr(band, "POOL_MIN_ENTRIES", 0)
    tq, w = 611, 50
    q, k, v, _ = _inputs(1, 2, 2, tq, tq, 8, 8, seed=19)
    k = k.detach().clone()
    k[0, 1, 400] = math.nan  # visible to queries 400 … 449 of head 1 only
    with torch.no_grad():
        out = tiled_attention(q.detach(), k, v.detach(), window=w, is_causal=True)
    nan_rows = torch.isnan(out).any(-1)
    assert nan_rows[0, 1, 400:450].all() and not nan_rows[0, 1, :400].any() and not nan_rows[0, 1, 450:].any()
    assert not nan_rows[0, 0].any()
    keep = _window_keep(tq, tq, w)
    dense, _ = _dense_ref(q.detach(), k.nan_to_num(0.0), v.detach(), keep)
    fine = ~nan_rows
    torch.testing.assert_close(out[fine], dense[fine], atol=1e-10, rtol=1e-10)


def test_a_merging_call_over_rows_no_earlier_call_wrote():
    # out/lse are not zero-filled: rows 64… of the second call were written by no earlier call and must
    # start as "sees nothing" before the merge (hand-made plan: the second call covers every row)
    from selfattention.kernels.plan import Call, Plan

    q, k, v, _ = _inputs(1, 2, 2, 128, 100, 8, 8, seed=23)
    q, k, v = q.detach(), k.detach(), v.detach()
    vis = Visibility(128, 100)
    prob = engine.make_problem(q, k, v, vis, 8**-0.5)
    prob.plan = Plan([Call(0, 64, 0, 50), Call(0, 128, 50, 50)], strategy="blocks")
    out, lse = engine.forward(q, k, v, prob)
    keep = torch.ones(128, 100, dtype=torch.bool)
    keep[64:, :50] = False
    dense, ref_lse = _dense_ref(q, k, v, keep)
    torch.testing.assert_close(out, dense, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)
