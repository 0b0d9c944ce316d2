"""The KV cache changes nothing but speed: cached outputs equal the uncached ones at every step."""

from __future__ import annotations

import pytest
import torch

import selfattention as sa
from selfattention import masks
from selfattention.kv_cache import CacheCapacityError, KVCache
from selfattention.mha import MultiHeadAttention
from tests.oracle import visible_mask

E = 24


def _model(H=4, Hkv=None, backend=None, seed=0):
    torch.manual_seed(seed)
    return MultiHeadAttention(E, H, num_kv_heads=Hkv, backend=backend).eval()


def _uncached(mha, x, window):
    T = x.shape[1]
    if window is None:
        return mha(x, is_causal=True)[0]
    return mha(x, attn_mask=masks.sliding_window_mask(T, T, window))[0]


def _run_chunks(mha, x, chunks, window, capacity=None):
    cache = mha.new_cache(x.shape[0], capacity or x.shape[1], window=window)
    outs, start = [], 0
    for n in chunks:
        assert cache.offset == start
        out, _ = mha(x[:, start : start + n], kv_cache=cache)
        outs.append((start, out))
        start += n
    return cache, outs


SCHEDULES = {
    "prefill1": [1] + [1] * 11,
    "prefill3": [3] + [1] * 9,
    "prefill7": [7] + [1] * 6,
    "chunked": [2, 3, 1, 4, 2, 1],
}


CASES = [
    (schedule, window, (4, 2), backend)  # GQA, every schedule, with and without a window, both paths
    for schedule in SCHEDULES
    for window in (None, 3)
    for backend in (None, "torch")
] + [(schedule, 5, heads, "torch") for schedule in SCHEDULES for heads in ((4, 4), (4, 1))]  # MHA, MQA


@pytest.mark.parametrize("schedule,window,heads,backend", CASES)
def test_cached_equals_uncached_at_every_step(schedule, window, heads, backend):
    chunks = SCHEDULES[schedule]
    mha = _model(*heads, backend=backend, seed=len(chunks))
    x = torch.randn(2, sum(chunks), E)
    full = _uncached(mha, x, window)
    cache, outs = _run_chunks(mha, x, chunks, window)
    for start, out in outs:
        n = out.shape[1]
        err = (out - full[:, start : start + n]).abs().max().item()
        assert err <= 1e-5, (start, n, err)
    assert cache.offset == x.shape[1]


def test_uncached_window_reference_hides_something():
    # the windowed oracle really differs from plain causal (else the windowed tests could not fail)
    mha = _model()
    x = torch.randn(1, 9, E)
    assert not torch.allclose(_uncached(mha, x, 3), _uncached(mha, x, None), atol=1e-3)


@pytest.mark.parametrize("window", [2, 3])
def test_chunk_longer_than_the_window(window):
    mha = _model(4, 2, seed=11)
    x = torch.randn(2, 15, E)
    full = _uncached(mha, x, window)
    # capacity == window: the 7- and 5-token chunks do not fit and go through a temporary [cache ∪ chunk]
    cache, outs = _run_chunks(mha, x, [7, 1, 5, 1, 1], window, capacity=window)
    for start, out in outs:
        assert torch.allclose(out, full[:, start : start + out.shape[1]], atol=1e-5), start
    assert cache.key.shape[2] == window  # the buffers were never reallocated


@pytest.mark.parametrize("window", [1, 3, 4])
def test_window_keeps_exactly_the_keys_still_visible(window):
    mha = _model(seed=3)
    x = torch.randn(1, 11, E)
    k_all = mha.k_proj(x).view(1, 11, 4, 6).transpose(1, 2)  # (B, Hkv, T, D)
    cache = mha.new_cache(1, 6, window=window)
    start = 0
    for n in [4, 1, 2, 1, 3]:
        with torch.no_grad():
            mha(x[:, start : start + n], kv_cache=cache)
        start += n
        keep = min(window - 1, start)
        assert cache.length == keep
        assert cache.key_positions().tolist() == list(range(start - keep, start))
        assert torch.allclose(cache.keys(), k_all[:, :, start - keep : start], atol=1e-6)


def test_positions_offset_checked_through_captured_weights():
    """A chunk at positions 3-4 after a 3-token cache attends exactly to keys 0-3 and 0-4."""
    mha = _model(backend="torch", seed=4)
    x = torch.randn(1, 5, E)
    cache = mha.new_cache(1, 8)
    mha(x[:, :3], kv_cache=cache)
    assert cache.offset == 3 and cache.positions(2).tolist() == [3, 4]
    with sa.capture() as traces:
        out, _ = mha(x[:, 3:5], kv_cache=cache)
    w = traces[0]["weights"]  # (1, H, 2, 5)
    assert w.shape == (1, 4, 2, 5)
    seen = w[0] != 0  # (H, 2, 5)
    assert seen[:, 0].tolist() == [[True, True, True, True, False]] * 4  # position 3: keys 0-3
    assert seen[:, 1].tolist() == [[True, True, True, True, True]] * 4  # position 4: keys 0-4
    assert torch.equal(seen[0], visible_mask(2, 5, is_causal=True))  # the independent oracle agrees
    assert torch.allclose(out, _uncached(mha, x, None)[:, 3:5], atol=1e-5)


def test_positions_offset_with_window_through_captured_weights():
    mha = _model(seed=5)
    x = torch.randn(1, 5, E)
    cache = mha.new_cache(1, 8, window=3)
    mha(x[:, :3], kv_cache=cache)
    with sa.capture() as traces:
        mha(x[:, 3:5], kv_cache=cache)
    w = traces[0]["weights"][0, 0]  # keys are positions 1..4 (position 0 was evicted)
    assert cache.key_positions().tolist() == [3, 4]
    assert (w != 0).tolist() == [[True, True, True, False], [False, True, True, True]]


def test_capacity_error_leaves_the_cache_usable():
    mha = _model(seed=6)
    x = torch.randn(1, 6, E)
    cache = mha.new_cache(1, 5)
    mha(x[:, :4], kv_cache=cache)
    with pytest.raises(
        CacheCapacityError, match=r"holds 4 of 5 positions and cannot take 2 more \(needs 6\)"
    ):
        mha(x[:, 4:6], kv_cache=cache)
    assert cache.offset == 4 and cache.length == 4  # unchanged
    out, _ = mha(x[:, 4:5], kv_cache=cache)
    assert torch.allclose(out, _uncached(mha, x[:, :5], None)[:, 4:5], atol=1e-5)
    with pytest.raises(ValueError, match="capacity"):
        mha(x[:, 5:6], kv_cache=cache)


def test_reset_and_reuse():
    mha = _model(4, 2, seed=7)
    x = torch.randn(2, 6, E)
    y = torch.randn(2, 6, E)
    cache = mha.new_cache(2, 6, window=4)
    for seq in (x, y):
        cache.reset()
        outs = [mha(seq[:, :2], kv_cache=cache)[0]] + [
            mha(seq[:, i : i + 1], kv_cache=cache)[0] for i in range(2, 6)
        ]
        assert torch.allclose(torch.cat(outs, 1), _uncached(mha, seq, 4), atol=1e-5)
    assert cache.offset == 6


def test_padding_flags_are_remembered_by_the_cache():
    mha = _model(seed=8)
    a = torch.randn(1, 6, E)
    b = torch.randn(1, 4, E)
    batch = torch.cat([a, torch.cat([torch.full((1, 2, E), float("nan")), b], 1)])  # left-padded b
    real = torch.tensor([[True] * 6, [False, False] + [True] * 4])
    cache = mha.new_cache(2, 6)
    out3, _ = mha(batch[:, :3], kv_cache=cache, key_padding_mask=real[:, :3])
    steps = [
        mha(batch[:, i : i + 1], kv_cache=cache, key_padding_mask=real[:, i : i + 1])[0] for i in range(3, 6)
    ]
    out = torch.cat([out3, *steps], 1)
    assert torch.allclose(out[0], _uncached(mha, a, None)[0], atol=1e-5)
    assert torch.allclose(out[1, 2:], _uncached(mha, b, None)[0], atol=1e-5)


def test_bad_updates_give_clear_errors():
    cache = KVCache(2, 2, 4, 8)
    with pytest.raises(ValueError, match=r"shape \(batch_size=2, num_kv_heads=2, T, 4\).*got \(2, 3, 1, 4\)"):
        cache.update(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4))
    with pytest.raises(TypeError, match="float64"):
        cache.update(
            torch.zeros(2, 2, 1, 4, dtype=torch.float64), torch.zeros(2, 2, 1, 4, dtype=torch.float64)
        )
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        cache.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"capacity \(2\) must be >= window \(3\)"):
        KVCache(1, 1, 4, 2, window=3)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        KVCache(1, 1, 4, 0)
    assert cache.offset == 0  # failed updates changed nothing


# ----------------------------------------------------------------------------- autograd (review fix)
def test_cache_buffers_stay_out_of_the_autograd_graph():
    """Decoding WITHOUT torch.no_grad(): the buffers must not require grad nor hold a grad_fn (each step's
    graph would otherwise be kept alive by the next: a memory leak in generation loops)."""
    mha = _model(H=4, Hkv=2)
    for window, capacity, chunks in ((None, 16, (3, 1, 1, 2)), (2, 2, (3, 1, 1))):  # 2nd: chunk > window
        cache = mha.new_cache(1, capacity, window=window)
        for n in chunks:
            out, _ = mha(torch.randn(1, n, E), kv_cache=cache)
            assert out.requires_grad  # the parameters are live
            for buf in (cache.key, cache.value):
                assert not buf.requires_grad and buf.grad_fn is None


def test_backward_through_cached_chunks_differentiates_each_chunk_with_the_past_constant():
    """Training mode, two cached calls, one backward: works (no in-place error) and gives the documented
    gradients: w.r.t. the chunk's own input exactly as the uncached model; the cached past is a constant."""
    mha = _model(H=4, Hkv=2).train()  # dropout 0: train mode changes nothing else
    torch.manual_seed(1)
    x1 = torch.randn(1, 3, E, requires_grad=True)
    x2 = torch.randn(1, 2, E, requires_grad=True)
    cache = mha.new_cache(1, 8)
    o1, _ = mha(x1, kv_cache=cache)
    o2, _ = mha(x2, kv_cache=cache)
    g = torch.randn(1, 5, E)
    ((o1 * g[:, :3]).sum() + (o2 * g[:, 3:]).sum()).backward()

    # Oracle: the uncached model. d/dx2 of the cached loss = d/dx2 of the full-sequence loss (x1 does not
    # depend on x2). d/dx1 of the cached loss = d/dx1 of chunk 1's part only (the past is constant for o2).
    y1 = x1.detach().clone().requires_grad_(True)
    y2 = x2.detach().clone().requires_grad_(True)
    full, _ = mha(torch.cat([y1, y2], dim=1), is_causal=True)
    torch.testing.assert_close(torch.cat([o1, o2], 1), full, atol=1e-5, rtol=1e-5)
    (gx2,) = torch.autograd.grad((full * g).sum(), y2)
    torch.testing.assert_close(x2.grad, gx2, atol=1e-5, rtol=1e-5)
    z1 = x1.detach().clone().requires_grad_(True)
    (gx1,) = torch.autograd.grad((mha(z1, is_causal=True)[0] * g[:, :3]).sum(), z1)
    torch.testing.assert_close(x1.grad, gx1, atol=1e-5, rtol=1e-5)
    assert not cache.key.requires_grad
