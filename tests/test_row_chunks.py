"""The generic plan in row chunks on the pool's single-threaded workers (kernels/row_chunks.py), forward and
backward, against float64 math written here. The chunked path is forced (its work threshold set to 0) and
a spy checks that it ran, so that every case below exercises it."""

from __future__ import annotations

import math

import pytest
import torch

import selfattention as sa
from selfattention import create_block_mask, flex_attention
from selfattention.kernels import row_chunks
from selfattention.tiled import tiled_attention


@pytest.fixture
def chunked(monkeypatch):
    """Two torch threads, no work threshold; yields the count of chunked forward / backward runs."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(row_chunks, "MIN_ENTRIES", 0)
    seen = {"forward": 0, "backward": 0}
    fwd, bwd = row_chunks.forward_chunks, row_chunks.backward_chunks

    def spy_f(*a):
        seen["forward"] += 1
        return fwd(*a)

    def spy_b(*a):
        seen["backward"] += 1
        return bwd(*a)

    monkeypatch.setattr(row_chunks, "forward_chunks", spy_f)
    monkeypatch.setattr(row_chunks, "backward_chunks", spy_b)
    yield seen
    torch.set_num_threads(old)


def _reference(q, k, v, visible, scale):
    """float64 (out, lse) of softmax(q kᵀ·scale) v over ``visible`` (B or 1, H or 1, Tq, Tk); a row that sees
    nothing gives 0 and −inf. GQA by repeating the key/value heads."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, -1)
    blind = lse == -math.inf
    p = torch.exp(s - torch.where(blind, 0.0, lse)[..., None])
    return p @ v, lse


def _dilated(b, h, q_idx, kv_idx):
    """A window of 48 keys, every second one (no run of columns is whole); rows 5, 42, 79, … see nothing."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 48) & ((q_idx - kv_idx) % 2 == 0) & (q_idx % 37 != 5)


@pytest.mark.parametrize(
    "tq,tk,h,hkv,block",
    [(197, 197, 4, 2, 32), (150, 263, 2, 2, 16), (257, 130, 3, 1, 32)],
)
def test_mask_mod_forward_lse_and_grads(chunked, tq, tk, h, hkv, block):
    torch.manual_seed(tq)
    q = torch.randn(2, h, tq, 24, requires_grad=True)
    k = torch.randn(2, hkv, tk, 24, requires_grad=True)
    v = torch.randn(2, hkv, tk, 40, requires_grad=True)
    bm = create_block_mask(_dilated, None, None, tq, tk, BLOCK_SIZE=block)
    out, lse = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    assert chunked["forward"] >= 1
    qi, ki = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
    visible = _dilated(None, None, qi, ki)
    assert not bool(visible.all(-1).all()) and bool((~visible).all(-1).any())  # some rows see nothing
    scale = 1 / math.sqrt(24)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = _reference(qd, kd, vd, visible, scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=1e-5)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), g.float())
    assert chunked["backward"] >= 1
    want = torch.autograd.grad(ref, (qd, kd, vd), g)
    for got, exp in zip(grads, want, strict=True):
        torch.testing.assert_close(got.double(), exp, atol=5e-5, rtol=1e-4)


def test_dense_mask_tiled_backend(chunked):
    """A dense bool mask that hides whole blocks and whole rows, through tiled_attention."""
    torch.manual_seed(3)
    tq, tk = 301, 287
    q = torch.randn(1, 4, tq, 32, requires_grad=True)
    k = torch.randn(1, 4, tk, 32, requires_grad=True)
    v = torch.randn(1, 4, tk, 32, requires_grad=True)
    mask = torch.rand(tq, tk) < 0.3
    mask[:, 100:220] = False  # whole key blocks hidden
    mask[40:45] = False  # rows that see nothing
    out = tiled_attention(q, k, v, attn_mask=mask, block_q=32, block_k=64)
    assert chunked["forward"] >= 1
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = _reference(qd, kd, vd, mask, 1 / math.sqrt(32))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    assert bool((out[:, :, 40:45] == 0).all())
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), g.float())
    assert chunked["backward"] >= 1
    for got, exp in zip(grads, torch.autograd.grad(ref, (qd, kd, vd), g), strict=True):
        torch.testing.assert_close(got.double(), exp, atol=5e-5, rtol=1e-4)


def test_hidden_nan_never_leaks(chunked):
    """A NaN in a hidden key: the chunked forward's deferred check sends the problem to the exact kernel."""
    torch.manual_seed(5)
    t = 200
    q, k, v = (torch.randn(1, 2, t, 16) for _ in range(3))
    k[0, 0, 150] = math.nan
    v[0, 1, 150] = math.inf
    bm = create_block_mask(lambda b, h, qi, ki: (ki != 150) & (qi >= ki), None, None, t, t, BLOCK_SIZE=32)
    with torch.no_grad():
        out = flex_attention(q, k, v, block_mask=bm)
    assert bool(torch.isfinite(out).all())
    vis = (torch.arange(t)[:, None] >= torch.arange(t)[None, :]) & (torch.arange(t)[None, :] != 150)
    k2, v2 = k.clone(), v.clone()
    k2[..., 150, :] = 0.0
    v2[..., 150, :] = 0.0
    ref, _ = _reference(q, k2, v2, vis, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_one_thread_runs_in_order(monkeypatch):
    """With torch at one thread nothing goes to the pool (the plan runs in this thread, in order)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(row_chunks, "MIN_ENTRIES", 0)
    try:
        q = torch.randn(1, 2, 130, 16)
        bm = create_block_mask(_dilated, None, None, 130, 130, BLOCK_SIZE=16)
        prob = sa.kernels.engine.make_problem(q, q, q, sa.visibility.Visibility(130, 130), 0.25)
        assert row_chunks.chunked(prob, q) is None
        out = flex_attention(q, q, q, block_mask=bm)
        assert out.shape == (1, 2, 130, 16)
    finally:
        torch.set_num_threads(old)
