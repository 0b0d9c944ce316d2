"""KVCache for serving: per-sequence lengths, pages, finished slots, beams, forks — every sequence checked
against its own uncached run in float64 (the oracle recomputes each sequence alone)."""

from __future__ import annotations

import pytest
import torch

from selfattention import masks
from selfattention.flash_kvcache import flash_attn_with_kvcache
from selfattention.kv_cache import CacheCapacityError, KVCache, PoolExhaustedError
from selfattention.mha import MultiHeadAttention

E, H, HKV = 24, 4, 2
D = E // H


def _model(seed=0, heads=(H, HKV), backend="torch"):
    torch.manual_seed(seed)
    return MultiHeadAttention(E, heads[0], num_kv_heads=heads[1], backend=backend).double().eval()


def _alone(mha, x, window=None):
    """The oracle: one sequence (T, E), uncached, float64."""
    t = x.shape[0]
    if window is None:
        return mha(x[None], is_causal=True)[0][0]
    return mha(x[None], attn_mask=masks.sliding_window_mask(t, t, window))[0][0]


def _cache(mha, batch, capacity, page=None, window=None, shuffle=None, num_pages=None):
    c = KVCache(batch, mha.num_kv_heads, mha.head_dim, capacity, window=window, dtype=torch.float64,
                ragged=True, page_size=page, num_pages=num_pages)  # fmt: skip
    if shuffle is not None:
        c.pages.shuffle(shuffle)
    return c


def _step(mha, cache, seqs, done, counts):
    """Feed counts[b] next tokens of each sequence (right-padded chunk); returns {b: (start, out rows)}."""
    n = max(max(counts), 1)
    x = torch.zeros(len(seqs), n, E, dtype=torch.float64)
    real = torch.zeros(len(seqs), n, dtype=torch.bool)
    for b, c in enumerate(counts):
        x[b, :c] = seqs[b][done[b] : done[b] + c]
        real[b, :c] = True
    out, _ = mha(x, kv_cache=cache, key_padding_mask=real)
    res = {b: (done[b], out[b, :c]) for b, c in enumerate(counts) if c}
    for b, c in enumerate(counts):
        done[b] += c
    return res


def _run(mha, seqs, schedule, window=None, **kw):
    cap = max(len(s) for s in seqs) + 3
    page = kw.get("page")
    cache = _cache(mha, len(seqs), cap if page is None else -(-cap // page) * page, window=window, **kw)
    done = [0] * len(seqs)
    outs = [[] for _ in seqs]
    for counts in schedule:
        for b, (start, o) in _step(mha, cache, seqs, done, counts).items():
            outs[b].append((start, o))
    return cache, outs


def _assert_matches_alone(mha, seqs, outs, window=None):
    for b, x in enumerate(seqs):
        full = _alone(mha, x, window)
        for start, o in outs[b]:
            torch.testing.assert_close(o, full[start : start + o.shape[0]], atol=1e-10, rtol=1e-10)


LENS = (5, 1, 12)  # prompts
SCHEDULE = [[5, 1, 12], [1, 1, 1], [0, 2, 1], [1, 1, 0], [3, 1, 1]]  # ragged prefill, steps, chunks, pauses


@pytest.mark.parametrize("page,shuffle", [(None, None), (4, None), (4, 1), (3, 2), (1, 3), (16, 4)])
@pytest.mark.parametrize("window", [None, 3])
def test_ragged_and_paged_match_each_sequence_alone(page, shuffle, window):
    mha = _model(seed=1)
    gen = torch.Generator().manual_seed(2)
    totals = [sum(c[b] for c in SCHEDULE) for b in range(3)]
    seqs = [torch.randn(t, E, generator=gen, dtype=torch.float64) for t in totals]
    cap = max(totals) + 3
    cap = cap if page is None else -(-cap // page) * page
    cache = _cache(mha, 3, cap, page=page, window=window, shuffle=shuffle)
    done, outs = [0, 0, 0], [[], [], []]
    for counts in SCHEDULE:
        for b, (start, o) in _step(mha, cache, seqs, done, counts).items():
            outs[b].append((start, o))
    _assert_matches_alone(mha, seqs, outs, window)
    assert cache.lengths.tolist() == totals


@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_gqa_mqa_and_reference_backend(heads):
    mha = _model(seed=3, heads=heads, backend=None)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randn(t, E, generator=gen, dtype=torch.float64) for t in (7, 2)]
    _, outs = _run(mha, seqs, [[4, 2], [3, 0]], page=2, shuffle=0)
    _assert_matches_alone(mha, seqs, outs)


def test_paged_and_contiguous_give_identical_outputs():
    mha = _model(seed=4)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randn(t, E, generator=gen, dtype=torch.float64) for t in (9, 3, 14)]
    sched = [[6, 3, 10], [1, 0, 1], [2, 0, 3]]
    _, a = _run(mha, seqs, sched)
    _, b = _run(mha, seqs, sched, page=4, shuffle=5)
    for ra, rb in zip(a, b, strict=True):
        for (sa, oa), (sb, ob) in zip(ra, rb, strict=True):
            assert sa == sb and torch.equal(oa, ob)


def test_memory_accounting():
    mha = _model()
    cache = _cache(mha, 3, 16, page=4)
    assert cache.pages_used == 0 and cache.bytes == 0
    seqs = [torch.randn(t, E, dtype=torch.float64) for t in (5, 1, 12)]
    _step(mha, cache, seqs, [0, 0, 0], [5, 1, 12])
    assert cache.pages_used == 2 + 1 + 3  # ⌈5/4⌉ + ⌈1/4⌉ + ⌈12/4⌉
    assert cache.bytes == 6 * 4 * HKV * (D + D) * 8
    flat = _cache(mha, 3, 16)
    assert flat.pages_used == 3 and flat.bytes == 3 * 16 * HKV * 2 * D * 8


def test_finished_slot_is_refused_then_reused():
    mha = _model(seed=5)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randn(t, E, generator=gen, dtype=torch.float64) for t in (6, 5)]
    cache = _cache(mha, 2, 12, page=2)
    done = [0, 0]
    _step(mha, cache, seqs, done, [4, 4])
    cache.finish(1)
    key_before = cache.key_pages.clone()
    with pytest.raises(ValueError, match=r"sequence 1 is finished .* cannot take the 1 token\(s\) of row 1"):
        _step(mha, cache, seqs, [4, 4], [1, 1])
    assert torch.equal(cache.key_pages, key_before) and cache.lengths.tolist() == [4, 4]
    out = _step(mha, cache, seqs, done, [1, 0])  # a finished row marked as padding is fine
    torch.testing.assert_close(out[0][1], _alone(mha, seqs[0])[4:5], atol=1e-10, rtol=1e-10)
    used = cache.pages_used
    cache.release(1)  # slot 1 takes a new sequence
    assert cache.pages_used == used - 2 and cache.lengths.tolist() == [5, 0]
    new = torch.randn(3, E, generator=gen, dtype=torch.float64)
    seqs2 = [seqs[0], new]
    done = [5, 0]
    outs = _step(mha, cache, seqs2, done, [1, 3])
    torch.testing.assert_close(outs[1][1], _alone(mha, new), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(outs[0][1], _alone(mha, seqs[0])[5:6], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("page", [None, 3])
def test_reorder_for_beam_search(page):
    mha = _model(seed=6)
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randn(8, E, generator=gen, dtype=torch.float64) for _ in range(3)]
    cache = _cache(mha, 3, 12, page=page)
    _step(mha, cache, seqs, [0, 0, 0], [4, 5, 2])
    order = [2, 0, 0]  # beam 0 continues old 2, beams 1 and 2 both continue old 0
    cache.reorder(order)
    assert cache.lengths.tolist() == [2, 4, 4]
    if page is not None:
        assert cache.pages_used == 1 + 2  # old 0's pages are shared by two rows, old 1's are freed
    hist = [seqs[i] for i in order]
    tails = [torch.randn(2, E, generator=gen, dtype=torch.float64) for _ in range(3)]
    full = [torch.cat([hist[b][: cache.lengths[b]], tails[b]]) for b in range(3)]
    outs = _step(mha, cache, full, cache.lengths.tolist(), [2, 2, 1])
    for b, (start, o) in outs.items():
        torch.testing.assert_close(
            o, _alone(mha, full[b])[start : start + o.shape[0]], atol=1e-10, rtol=1e-10
        )


@pytest.mark.parametrize("page", [None, 4])
def test_fork_shares_the_prefix_and_copies_on_write(page):
    mha = _model(seed=7)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randn(6, E, generator=gen, dtype=torch.float64)
    cache = _cache(mha, 2, 16, page=page)
    _step(mha, cache, [prompt, prompt[:0]], [0, 0], [6, 0])
    cache.fork(0, 1)
    if page is not None:
        assert cache.pages_used == 2  # both sequences on the same 2 pages
    a, b = (
        torch.randn(3, E, generator=gen, dtype=torch.float64),
        torch.randn(3, E, generator=gen, dtype=torch.float64),
    )
    seqs = [torch.cat([prompt, a]), torch.cat([prompt, b])]
    outs = _step(mha, cache, seqs, [6, 6], [1, 2])  # both append into the shared partial page 1
    if page is not None:
        assert cache.pages_used == 3  # page 1 was copied once (the other writer got the copy)
    outs2 = _step(mha, cache, seqs, [7, 8], [2, 1])
    for res in (outs, outs2):
        for s, (start, o) in res.items():
            torch.testing.assert_close(
                o, _alone(mha, seqs[s])[start : start + o.shape[0]], atol=1e-10, rtol=1e-10
            )


def test_flash_args_read_the_cache_without_copying():
    mha = _model(seed=8)
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randn(t, E, generator=gen, dtype=torch.float64) for t in (5, 9)]
    for page in (None, 2):
        cache = _cache(mha, 2, 10, page=page, shuffle=None if page is None else 1)
        _step(mha, cache, seqs, [0, 0], [5, 9])
        q = torch.randn(2, 1, H, D, generator=gen, dtype=torch.float64)
        out = flash_attn_with_kvcache(q, **cache.flash_args(), causal=True)
        for b, n in enumerate((5, 9)):
            k = cache.keys()[b, :, :n]
            v = cache.values()[b, :, :n]
            want = torch.nn.functional.scaled_dot_product_attention(
                q[b].transpose(0, 1), k, v, enable_gqa=True
            ).transpose(0, 1)
            torch.testing.assert_close(out[b], want, atol=1e-10, rtol=1e-10)


# ----------------------------------------------------------------------------------------------- errors
def test_errors_name_the_value_and_change_nothing():
    mha = _model()
    cache = _cache(mha, 2, 8, page=4, num_pages=3)
    seqs = [torch.randn(8, E, dtype=torch.float64) for _ in range(2)]
    _step(mha, cache, seqs, [0, 0], [4, 3])
    snap = (cache.key_pages.clone(), cache.lengths.tolist(), cache.pages_used, cache.pages.tensor.clone())

    def unchanged():
        assert torch.equal(cache.key_pages, snap[0]) and cache.lengths.tolist() == snap[1]
        assert cache.pages_used == snap[2] and torch.equal(cache.pages.tensor, snap[3])

    with pytest.raises(PoolExhaustedError, match=r"1 free pages of 3 .* needs 2"):
        _step(mha, cache, seqs, [4, 3], [1, 2])  # seq 0 needs page 2, seq 1 page 2 too: only one is free
    unchanged()
    with pytest.raises(CacheCapacityError, match=r"sequence 0 holds 4 of 8 positions and cannot take 5 more"):
        _step(mha, cache, [torch.randn(9, E, dtype=torch.float64)] * 2, [4, 3], [5, 0])
    unchanged()
    x = torch.zeros(2, 2, E, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"key_padding_mask row 1 is \[F, T\]"):
        mha(x, kv_cache=cache, key_padding_mask=torch.tensor([[True, True], [False, True]]))
    unchanged()
    with pytest.raises(ValueError, match=r"indices must hold 2 sequence indices in \[0, 2\), got \[0, 2\]"):
        cache.reorder([0, 2])
    with pytest.raises(ValueError, match=r"dst must be a sequence index in \[0, 2\), got 5"):
        cache.fork(0, 5)
    unchanged()
    with pytest.raises(
        ValueError, match=r"capacity \(10\) must be a multiple of page_size \(4\).*capacity=12"
    ):
        KVCache(1, 1, 4, 10, page_size=4)
    with pytest.raises(ValueError, match="needs per-sequence lengths"):
        KVCache(1, 1, 4, 10).fork(0, 0)


@pytest.mark.parametrize("page", [None, 4])
def test_assign_a_sequence_prefilled_alone(page):
    mha = _model(seed=9)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(7, E, generator=gen, dtype=torch.float64)
    alone = _cache(mha, 1, 8)
    mha(x[None, :6], kv_cache=alone)
    cache = _cache(mha, 2, 8, page=page)
    cache.assign(1, alone.keys()[0], alone.values()[0])
    assert cache.lengths.tolist() == [0, 6]
    out = _step(mha, cache, [x[:0], x], [0, 6], [0, 1])
    torch.testing.assert_close(out[1][1], _alone(mha, x)[6:7], atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match=r"sequence 1 holds 7 tokens: release\(1\) before assigning"):
        cache.assign(1, alone.keys()[0], alone.values()[0])
    with pytest.raises(ValueError, match=r"shape"):
        cache.assign(0, alone.keys()[0, :1], alone.values()[0, :1])
    assert cache.lengths.tolist() == [0, 7]
