"""flash-attn's own kvcache cases, re-expressed (own code) against ``selfattention.flash.flash_attn_with_kvcache``.

Cases from flash-attn's ``tests/test_flash_attn.py`` (github.com/Dao-AILab/flash-attention, commit
0251105a): ``test_flash_attn_kvcache`` (MHA/MQA/GQA, new k/v appended or not, ALiBi (batch, nheads),
``window_size`` given as a **tensor** ``torch.randint(0, seqlen_k, (2,))``, causal, rotary fraction
0 / 0.5 / 1 interleaved or not, ``cache_leftpad``, ``cache_batch_idx`` into a cache of 2·batch rows, paged
caches whose block table is a random permutation, ``num_splits`` 0 / 1) and
``test_flash_attn_kvcache_paged_block_table_bounds`` (a ``RuntimeError`` naming ``block_table``, and the
exact-capacity call that must not raise). The sizes are small (CPU) and the head dims include odd ones.

The check is flash-attn's error ratio: ``max|out − ref64| ≤ mult · max|out_lowp − ref64| + 1e-5`` where
ref64 is attention in float64 (written here, vectorised) and out_lowp the same attention computed naively
in the input dtype (scaled keys, softmax in that dtype), mult = 3 (5 with ALiBi). The cache contents after
the in-place append are checked against the expected cache, every row and position.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from selfattention.flash import flash_attn_with_kvcache

from ..flash_oracle import fa_attention

I32 = torch.int32
SHAPES = [(1, 128), (1, 339), (3, 99), (17, 80), (32, 32), (5, 3)]  # (seqlen_q, seqlen_k); 5 > 3: no new kv
LAYOUTS = ["dense", "batch_idx", "leftpad", "paged16", "paged256"]
DIMS = [32, 59, 64, 80]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, inter: bool):
    """x (B, T, H, D) float64, pos (B, T) long: pairs (a, b) ↦ (a cos − b sin, a sin + b cos)."""
    half = cos.shape[1]
    if half == 0:
        return x
    first = [2 * i for i in range(half)] if inter else list(range(half))
    second = [2 * i + 1 for i in range(half)] if inter else [half + i for i in range(half)]
    c, s = cos[pos][:, :, None, :], sin[pos][:, :, None, :]  # (B, T, 1, half)
    a, b = x[..., first], x[..., second]
    out = x.clone()
    out[..., first] = a * c - b * s
    out[..., second] = a * s + b * c
    return out


def _case_extras(key: str):
    """The parameters drawn per case (a hash of the case id: fixed between runs)."""
    h = zlib.crc32(key.encode())
    return {
        "d": DIMS[h % len(DIMS)],
        "rotary_fraction": (0.0, 0.5, 1.0)[(h >> 3) % 3],
        "interleaved": bool((h >> 5) & 1),
        "new_eq_q": bool((h >> 6) & 1),
        "num_splits": (h >> 7) & 1,
    }


MHA = ["mha", "mqa", "gqa"]
# every (dtype, new_kv, alibi, local, causal, layout) combination once; the head layout and the shape drawn
# per case (shapes with seqlen_q > seqlen_k only without new keys, as flash-attn skips the others)
CASES = [
    (dt, MHA[zlib.crc32(repr(c).encode()) % 3], *c[1:],
     [s for s in SHAPES if not c[1] or s[0] <= s[1]][zlib.crc32(repr(c).encode()) % (len(SHAPES) - c[1])])
    for c in itertools.product(["float32", "bfloat16"], [False, True], [False, True], [False, True],
                               [False, True], LAYOUTS)
    for dt in [getattr(torch, c[0])]
]  # fmt: skip


@pytest.mark.parametrize("dtype, mha_type, new_kv, alibi, local, causal, layout, shape", CASES, ids=str)
def test_kvcache_against_float64(dtype, mha_type, new_kv, alibi, local, causal, layout, shape):
    seqlen_q, seqlen_k = shape
    ex = _case_extras(repr((dtype, mha_type, new_kv, alibi, local, causal, layout)))
    d = ex["d"]
    gen = torch.Generator().manual_seed(zlib.crc32(repr((shape, d, layout, causal, local)).encode()))
    batch, nheads = 2, 6
    nheads_k = {"mha": 6, "mqa": 1, "gqa": 3}[mha_type]
    rotary_dim = (int(ex["rotary_fraction"] * d) // 16) * 16 if new_kv else 0
    window = torch.randint(0, seqlen_k, (2,), generator=gen) if local else (-1, -1)

    def randn(*s):
        return torch.randn(*s, generator=gen).to(dtype)

    q = randn(batch, seqlen_q, nheads, d)
    seqlen_new = seqlen_q if ex["new_eq_q"] else int(torch.randint(1, seqlen_q + 1, (1,), generator=gen))
    k_new = randn(batch, seqlen_new, nheads_k, d) if new_kv else None
    v_new = randn(batch, seqlen_new, nheads_k, d) if new_kv else None

    # the cache as each sequence sees it (B, seqlen_k, Hk, D), and what is passed in
    rows_cache = 2 * batch if layout == "batch_idx" else batch
    block_table = cache_batch_idx = cache_leftpad = None
    if layout.startswith("paged"):
        page = int(layout[5:])
        per_seq = 3 * -(-seqlen_k // page)
        pool_k, pool_v = randn(batch * per_seq, page, nheads_k, d), randn(batch * per_seq, page, nheads_k, d)
        block_table = torch.randperm(batch * per_seq, generator=gen).to(I32).reshape(batch, per_seq)
        k_in, v_in = pool_k, pool_v
        rows_k = pool_k[block_table.long()].flatten(1, 2)[:, :seqlen_k]
        rows_v = pool_v[block_table.long()].flatten(1, 2)[:, :seqlen_k]
    else:
        k_in, v_in = randn(rows_cache, seqlen_k, nheads_k, d), randn(rows_cache, seqlen_k, nheads_k, d)
        if layout == "batch_idx":
            cache_batch_idx = torch.randperm(rows_cache, generator=gen)[:batch].to(I32)
            rows_k, rows_v = k_in[cache_batch_idx.long()], v_in[cache_batch_idx.long()]
        else:
            rows_k, rows_v = k_in, v_in
    k_before, v_before = k_in.clone(), v_in.clone()

    hi = (
        (seqlen_k - (seqlen_q if (causal or local) and rotary_dim > 1 else seqlen_new) + 1)
        if new_kv
        else seqlen_k + 1
    )
    cache_seqlens = torch.randint(0 if new_kv else 1, hi, (batch,), generator=gen).to(I32)
    if layout == "leftpad":
        cache_leftpad = torch.tensor(
            [int(torch.randint(0, int(n), (1,), generator=gen)) if n > 0 else 0 for n in cache_seqlens],
            dtype=I32,
        )
    slopes = torch.rand(batch, nheads, generator=gen) * 0.3 if alibi else None

    cos = sin = None
    q_ro, k_ro = q.double(), None if k_new is None else k_new.double()
    starts = cache_seqlens.long()[:, None]
    if rotary_dim > 0:
        ang = torch.rand(block_table.numel() * page if block_table is not None else seqlen_k, rotary_dim // 2,
                         generator=gen) * 2 * math.pi  # fmt: skip
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        q_steps = torch.arange(seqlen_q) if (causal or local) else torch.zeros(seqlen_q, dtype=torch.long)
        q_ro = _rotate(q_ro, cos.double(), sin.double(), starts + q_steps, ex["interleaved"])
        k_ro = _rotate(k_ro, cos.double(), sin.double(), starts + torch.arange(seqlen_new), ex["interleaved"])

    # expected cache rows after the append (float64; the stored keys are the rotated ones in dtype)
    exp_k, exp_v = rows_k.double().clone(), rows_v.double().clone()
    if new_kv:
        for b in range(batch):
            n = int(cache_seqlens[b])
            exp_k[b, n : n + seqlen_new] = k_ro[b].to(dtype).double()
            exp_v[b, n : n + seqlen_new] = v_new[b].double()

    out, lse = flash_attn_with_kvcache(
        q, k_in, v_in, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table, causal=causal,
        window_size=window, rotary_interleaved=ex["interleaved"], alibi_slopes=slopes,
        num_splits=ex["num_splits"], return_softmax_lse=True,
    )  # fmt: skip

    # the cache: appended where it should be, untouched elsewhere (and the other rows of a batch_idx cache)
    if block_table is not None:
        got_k = k_in[block_table.long()].flatten(1, 2)[:, :seqlen_k]
        got_v = v_in[block_table.long()].flatten(1, 2)[:, :seqlen_k]
        used = torch.zeros(k_in.shape[0], dtype=torch.bool)
        used[block_table.long().flatten()] = True
    else:
        idx = torch.arange(batch) if cache_batch_idx is None else cache_batch_idx.long()
        got_k, got_v = k_in[idx], v_in[idx]
        others = torch.ones(rows_cache, dtype=torch.bool)
        others[idx] = False
        assert torch.equal(k_in[others], k_before[others]) and torch.equal(v_in[others], v_before[others])
    assert torch.equal(got_v.double(), exp_v)
    tol = 0 if rotary_dim == 0 else (1e-5 if dtype == torch.float32 else 1.6e-2)
    torch.testing.assert_close(got_k.double(), exp_k, atol=tol, rtol=tol)

    # the reference attention over the expected cache, per sequence: keys leftpad … cache_seqlens + new − 1
    end = cache_seqlens.long() + (seqlen_new if new_kv else 0)
    left_pad = torch.zeros(batch, dtype=torch.long) if cache_leftpad is None else cache_leftpad.long()
    j = torch.arange(seqlen_k)
    qpos = end[:, None] - seqlen_q + torch.arange(seqlen_q)[None]  # (B, Tq): a query's key position
    ok = (j >= left_pad[:, None, None]) & (j < end[:, None, None])  # (B, 1, Tk)
    left, right = (int(w) for w in window)
    right = 0 if causal else right
    rel = qpos[:, :, None] - j  # (B, Tq, Tk)
    ok = ok & (rel >= -right if right >= 0 else True) & (rel <= left if left >= 0 else True)
    bias = None if slopes is None else -slopes.double()[:, :, None, None] * rel.abs()[:, None].double()
    q_in = q_ro.to(dtype)  # the rotated query as the library sees it (rounded to dtype)
    ref, ref_lse = fa_attention(q_in, exp_k, exp_v, ok, bias)
    low, _ = fa_attention(q_in, exp_k.to(dtype), exp_v.to(dtype), ok, bias, work=dtype)
    err, err_low = (out.double() - ref).abs().max().item(), (low.double() - ref).abs().max().item()
    mult = 5 if alibi else 3
    assert err <= mult * err_low + 1e-5, (err, err_low)
    assert out.shape == (batch, seqlen_q, nheads, d) and out.dtype == dtype
    # lse (B, H, Tq) float32, +inf where a query sees nothing (flash-attn's convention)
    blind = ~ok.any(-1)[:, None].expand_as(ref_lse)
    assert lse.dtype == torch.float32 and bool(torch.isposinf(lse[blind]).all())
    if rotary_dim == 0:
        torch.testing.assert_close(lse.double()[~blind], ref_lse[~blind], atol=2e-4, rtol=1e-5)


def test_num_splits_does_not_change_the_result():
    gen = torch.Generator().manual_seed(3)
    q, kc, vc = (torch.randn(2, s, 2, 16, generator=gen) for s in (1, 40, 40))
    lens = torch.tensor([7, 40], dtype=I32)
    ref = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    for n in (1, 2, 7):
        assert torch.equal(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=n), ref)


@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("page", [256, 8])
def test_paged_block_table_bounds(append, page):
    """flash-attn's regression test (its issue #2709): a sequence longer than its block_table row can
    address raises a RuntimeError naming block_table (here also a ValueError); exactly full does not."""
    gen = torch.Generator().manual_seed(0)
    pool_k, pool_v = torch.randn(4, page, 1, 64, generator=gen), torch.randn(4, page, 1, 64, generator=gen)
    table = torch.zeros(1, 1, dtype=I32)
    q = torch.randn(1, 1, 1, 64, generator=gen)
    new = torch.randn(1, 1, 1, 64, generator=gen) if append else None
    lens = torch.full((1,), page if append else page + 1, dtype=I32)
    before = pool_k.clone()
    for err in (RuntimeError, ValueError):
        with pytest.raises(err, match="block_table"):
            flash_attn_with_kvcache(q, pool_k, pool_v, k=new, v=new, cache_seqlens=lens, block_table=table)
    assert torch.equal(pool_k, before)  # nothing written
    out = flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=torch.full((1,), page, dtype=I32),
                                  block_table=table)  # fmt: skip
    ref = torch.softmax(q[0, 0, 0].double() @ pool_k[0, :, 0].double().T / 8, -1) @ pool_v[0, :, 0].double()
    assert out.shape == (1, 1, 1, 64)
    torch.testing.assert_close(out[0, 0, 0].double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [torch.tensor([3, 2]), [3, 2], (torch.tensor(3), torch.tensor(2))])
def test_window_size_spellings_agree(window):
    """flash-attn's tests pass ``window_size`` as a 2-element tensor; lists and 0-d tensors read the same."""
    gen = torch.Generator().manual_seed(1)
    q, kc, vc = (
        torch.randn(2, 4, 2, 8, generator=gen),
        torch.randn(2, 30, 1, 8, generator=gen),
        torch.randn(2, 30, 1, 8, generator=gen),
    )
    lens = torch.tensor([9, 25], dtype=I32)
    ref = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=(3, 2))
    assert torch.equal(flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=window), ref)
    with pytest.raises(ValueError, match=r"window_size\[0\] must be >= -1"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=torch.tensor([-2, 0]))
    with pytest.raises(TypeError, match=r"window_size\[1\] must be an int"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=(1, 2.5))
