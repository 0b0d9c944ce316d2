"""flash_attn_with_kvcache against an oracle that recomputes every sequence on its own in float64.

The oracle follows flash-attn's documented semantics written independently: for sequence b it takes the
keys at positions cache_leftpad[b] … cache_seqlens[b] + seqlen_new − 1 (after the in-place append), places
query i at relative position i + sk − sq (sk = visible keys), and applies causal/window, softcap, ALiBi and
rotary (through complex numbers, not the module's formula) one sequence at a time.
"""

from __future__ import annotations

import math

import pytest
import torch

from selfattention.flash_kvcache import flash_attn_with_kvcache

I32 = torch.int32


def _rotary_tables(n, rd, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos(), ang.sin()


def _rot_oracle(x, cos, sin, pos, interleaved):
    """x (T, h, D) float64 at positions pos (T,): complex multiplication by e^{iθ}."""
    rd = 2 * cos.shape[1]
    xr = x[..., :rd]
    if interleaved:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2])
    else:
        z = torch.complex(xr[..., : rd // 2], xr[..., rd // 2 :])
    e = torch.complex(cos[pos], sin[pos])[:, None, :]  # (T, 1, rd/2)
    z = z * e
    if interleaved:
        out = torch.stack([z.real, z.imag], -1).flatten(-2)
    else:
        out = torch.cat([z.real, z.imag], -1)
    return torch.cat([out, x[..., rd:]], -1)


def _oracle(q, keys_b, vals_b, *, causal, window, softcap, slopes, scale, sk_offset=0):
    """One sequence: q (Tq, H, D), keys/vals (Sk, Hkv, D) float64 → out (Tq, H, Dv), lse (H, Tq)."""
    tq, h, d = q.shape
    sk, hkv = keys_b.shape[0], keys_b.shape[1]
    g = h // hkv
    kk = keys_b.repeat_interleave(g, 1)  # head h uses kv head h // g
    vv = vals_b.repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    row = torch.arange(tq)[:, None]
    col = torch.arange(sk)[None, :]
    qp = row + sk - tq
    ok = torch.ones(tq, sk, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
    if right >= 0:
        ok &= col <= qp + right
    if left >= 0:
        ok &= col >= qp - left
    if slopes is not None:
        s = s - slopes[:, None, None] * (qp - col).abs()[None].double()
    s = s.masked_fill(~ok[None], -math.inf)
    lse = torch.logsumexp(s, -1)  # (H, Tq)
    p = torch.exp(s - torch.where(lse == -math.inf, 0.0, lse)[..., None])
    out = torch.einsum("hqk,khd->qhd", p, vv)
    return out, torch.where(lse == -math.inf, math.inf, lse)


def _check_against_oracle(
    *,
    B=3,
    H=4,
    Hkv=2,
    D=12,
    Dv=None,
    cap=37,
    lens=(5, 0, 23),
    new=1,
    tq=None,
    causal=True,
    window=(-1, -1),
    softcap=0.0,
    alibi=False,
    leftpad=None,
    page=None,
    shuffle=False,
    batch_idx=None,
    rotary=None,
    dtype=torch.float32,
    seed=0,
):
    gen = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    tq = max(new, 1) if tq is None else tq
    rows_n = B if batch_idx is None else max(batch_idx) + 2
    kc_log = torch.randn(rows_n, cap, Hkv, D, generator=gen, dtype=torch.float64)  # logical caches
    vc_log = torch.randn(rows_n, cap, Hkv, Dv, generator=gen, dtype=torch.float64)
    q = torch.randn(B, tq, H, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, new, Hkv, D, generator=gen, dtype=torch.float64) if new else None
    v = torch.randn(B, new, Hkv, Dv, generator=gen, dtype=torch.float64) if new else None
    seqlens = torch.tensor(lens, dtype=I32)
    kwargs = {}
    if page is not None:  # scatter the logical caches into a pool through a block table
        per = -(-cap // page)
        n_pages = B * per + 3
        order = torch.randperm(n_pages, generator=gen) if shuffle else torch.arange(n_pages)
        table = order[: B * per].view(B, per).to(I32)
        kc = torch.full((n_pages, page, Hkv, D), float("nan"), dtype=torch.float64)  # unused pages: NaN
        vc = torch.full((n_pages, page, Hkv, Dv), float("nan"), dtype=torch.float64)
        for b in range(B):
            for j in range(per):
                lo, hi = j * page, min(cap, (j + 1) * page)
                kc[table[b, j], : hi - lo] = kc_log[b, lo:hi]
                vc[table[b, j], : hi - lo] = vc_log[b, lo:hi]
        kwargs["block_table"] = table
    else:
        kc, vc = kc_log.clone(), vc_log.clone()
    if batch_idx is not None:
        kwargs["cache_batch_idx"] = torch.tensor(batch_idx, dtype=I32)
    if leftpad is not None:
        kwargs["cache_leftpad"] = torch.tensor(leftpad, dtype=I32)
    slopes = torch.rand(H, generator=gen, dtype=torch.float32) if alibi else None
    cos = sin = None
    if rotary is not None:
        rd, interleaved = rotary
        cos, sin = _rotary_tables(cap + tq, rd)
        kwargs.update(rotary_cos=cos.to(dtype), rotary_sin=sin.to(dtype), rotary_interleaved=interleaved)
    kc_t, vc_t = kc.to(dtype), vc.to(dtype)
    out, lse = flash_attn_with_kvcache(
        q.to(dtype), kc_t, vc_t, None if k is None else k.to(dtype), None if v is None else v.to(dtype),
        cache_seqlens=seqlens, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
        return_softmax_lse=True, **kwargs,
    )  # fmt: skip
    scale = 1 / math.sqrt(D)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for b in range(B):
        r = b if batch_idx is None else batch_idx[b]
        n = lens[b]
        kb, vb = kc_log[r].clone(), vc_log[r].clone()
        qb = q[b]
        if new:
            kn = k[b]
            if rotary is not None:
                kn = _rot_oracle(kn, cos, sin, torch.arange(n, n + new), rotary[1])
            kb[n : n + new], vb[n : n + new] = kn, v[b]
        if rotary is not None:
            local = causal or window != (-1, -1)
            qpos = torch.arange(n, n + tq) if local else torch.full((tq,), n)
            qb = _rot_oracle(qb, cos, sin, qpos, rotary[1])
        lp = 0 if leftpad is None else leftpad[b]
        want, want_lse = _oracle(
            qb, kb[lp : n + new], vb[lp : n + new], causal=causal, window=window, softcap=softcap,
            slopes=None if slopes is None else slopes.double(), scale=scale,
        )  # fmt: skip
        torch.testing.assert_close(out[b].double(), want, atol=tol, rtol=tol)
        ltol = max(tol, 1e-6)  # lse is float32 (as flash-attn) whatever the dtype
        torch.testing.assert_close(lse[b].double(), want_lse, atol=ltol, rtol=ltol)
        # the cache now holds the (rotated) new keys at the sequence's own positions, nothing else changed
        if new:
            got_k = (
                kc_t[r, n : n + new]
                if page is None
                else _paged_rows(kc_t, kwargs["block_table"][b], n, new, page)
            )
            torch.testing.assert_close(got_k.double(), kb[n : n + new], atol=tol, rtol=tol)
    return out


def _paged_rows(pool, table_row, n, new, page):
    return torch.stack([pool[table_row[p // page], p % page] for p in range(n, n + new)])


# ------------------------------------------------------------------------------------------ the oracle
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("new", [0, 1, 3])
def test_ragged_contiguous(new, dtype):
    _check_against_oracle(lens=(5, 0, 23), new=new, dtype=dtype, seed=new)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [(-1, -1), (4, -1), (3, 0), (2, 2), (0, 0)])
def test_windows_causal_and_not(causal, window):
    _check_against_oracle(lens=(9, 1, 30), new=3, causal=causal, window=window, seed=7)


@pytest.mark.parametrize("page,shuffle", [(4, False), (4, True), (5, True), (16, True), (1, True)])
@pytest.mark.parametrize("new", [1, 4])
def test_paged_pages_in_any_order(page, shuffle, new):
    _check_against_oracle(lens=(6, 0, 30), new=new, page=page, shuffle=shuffle, cap=37, seed=page + new)


def test_paged_equals_contiguous_bit_for_bit_when_pages_are_in_order():
    a = _check_against_oracle(lens=(6, 2, 30), new=1, seed=3)
    b = _check_against_oracle(lens=(6, 2, 30), new=1, page=8, seed=3)
    # same inputs drawn (same seed): the paged result equals the contiguous one
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (6, 2)])
def test_gqa_mqa(heads):
    _check_against_oracle(H=heads[0], Hkv=heads[1], D=7, Dv=5, lens=(3, 11, 0), new=2, seed=heads[1])


def test_leftpad_and_batch_idx():
    _check_against_oracle(lens=(8, 4, 20), leftpad=(3, 4, 0), new=2, batch_idx=[2, 0, 3], seed=5)


def test_leftpad_with_pages():
    _check_against_oracle(lens=(8, 4, 20), leftpad=(3, 1, 7), new=2, page=4, shuffle=True, seed=6)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary(interleaved, causal):
    _check_against_oracle(lens=(4, 0, 17), new=2, rotary=(8, interleaved), causal=causal, D=12, seed=9)


def test_softcap_and_alibi():
    _check_against_oracle(lens=(4, 9, 17), new=2, softcap=0.7, seed=10)
    _check_against_oracle(lens=(4, 9, 17), new=2, alibi=True, window=(5, -1), causal=True, seed=11)
    _check_against_oracle(lens=(4, 9, 17), new=1, alibi=True, softcap=2.0, causal=False, seed=12)


def test_more_queries_than_keys_rows_see_nothing():
    # seqlen_q > keys: the first rows of sequence 1 (no cache, 2 new keys, 4 queries) see nothing: 0, lse +inf
    out = _check_against_oracle(lens=(5, 0), B=2, new=2, tq=4, seed=13)
    assert torch.equal(out[1, :2], torch.zeros_like(out[1, :2]))


def test_odd_sizes_long():
    _check_against_oracle(
        B=2, H=3, Hkv=1, D=5, cap=1100, lens=(1025, 97), new=7, page=13, shuffle=True, seed=14
    )


def test_uniform_lengths_int_seqlens():
    gen = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(2, 10, 1, 4, generator=gen), torch.randn(2, 10, 1, 4, generator=gen)
    q = torch.randn(2, 1, 2, 4, generator=gen)
    a = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=6, causal=True)
    b = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([6, 6], dtype=I32), causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kc[:, :6].transpose(1, 2), vc[:, :6].transpose(1, 2), enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(a, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(b, ref, atol=1e-6, rtol=1e-6)
    full = flash_attn_with_kvcache(q, kc, vc)  # cache_seqlens None: the whole cache
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(full, ref, atol=1e-6, rtol=1e-6)


def test_hidden_nan_in_the_cache_never_leaks():
    kc = torch.full((2, 9, 1, 4), float("nan"))
    vc = torch.full((2, 9, 1, 4), float("nan"))
    kc[:, :3], vc[:, :3] = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    out = flash_attn_with_kvcache(
        torch.randn(2, 1, 1, 4), kc, vc, cache_seqlens=torch.tensor([3, 2], dtype=I32)
    )
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------ bad input
def _setup(paged=False):
    gen = torch.Generator().manual_seed(0)
    if paged:
        kc, vc = torch.randn(6, 4, 1, 4, generator=gen), torch.randn(6, 4, 1, 4, generator=gen)
    else:
        kc, vc = torch.randn(2, 8, 1, 4, generator=gen), torch.randn(2, 8, 1, 4, generator=gen)
    q, k = torch.randn(2, 1, 2, 4, generator=gen), torch.randn(2, 1, 1, 4, generator=gen)
    return q, kc, vc, k


BAD = [
    (
        dict(cache_seqlens=torch.tensor([3, 8], dtype=I32)),
        ValueError,
        r"cache_seqlens\[1\] = 8 \+ seqlen_new 1 = 9 exceeds",
    ),
    (
        dict(cache_seqlens=torch.tensor([3, -1], dtype=I32)),
        ValueError,
        r"cache_seqlens\[1\] = -1 is negative",
    ),
    (
        dict(cache_seqlens=torch.tensor([3, 1])),
        TypeError,
        r"cache_seqlens must have dtype torch.int32.*int64",
    ),
    (dict(cache_seqlens=torch.tensor([3], dtype=I32)), ValueError, r"cache_seqlens must have shape \(2\)"),
    (
        dict(cache_batch_idx=torch.tensor([0, 2], dtype=I32)),
        ValueError,
        r"cache_batch_idx\[1\] = 2 is outside",
    ),
    (dict(cache_batch_idx=torch.tensor([1, 1], dtype=I32)), ValueError, r"repeats a row"),
    (
        dict(cache_leftpad=torch.tensor([4, 0], dtype=I32)),
        ValueError,
        r"cache_leftpad\[0\] = 4 must be in \[0, cache_seqlens\[0\] = 3\]",
    ),
    (dict(window_size=(-2, 0)), ValueError, r"window_size"),
    (dict(softcap=-1.0), ValueError, r"softcap"),
    (dict(num_splits=-1), ValueError, r"num_splits"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, r"alibi_slopes must have shape \(2,\)"),
    (
        dict(rotary_cos=torch.ones(3, 2), rotary_sin=torch.ones(3, 2)),
        ValueError,
        r"rotary_cos has 3 positions",
    ),
    (
        dict(rotary_cos=torch.ones(9, 3), rotary_sin=torch.ones(9, 3)),
        ValueError,
        r"rotary_dim = 2 × 3 exceeds head_dim 4",
    ),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be finite, got nan"),
    (dict(softmax_scale=float("inf")), ValueError, r"softmax_scale must be finite, got inf"),
    (dict(softcap=float("inf")), ValueError, r"softcap must be a finite number >= 0.*inf"),
    (
        dict(alibi_slopes=torch.tensor([float("nan"), 1.0])),
        ValueError,
        r"alibi_slopes must be finite",
    ),
]


@pytest.mark.parametrize("extra,exc,match", BAD)
def test_bad_input_names_the_argument_and_changes_nothing(extra, exc, match):
    q, kc, vc, k = _setup()
    before = (kc.clone(), vc.clone())
    args = dict(cache_seqlens=torch.tensor([3, 5], dtype=I32))
    args.update(extra)
    with pytest.raises(exc, match=match):
        flash_attn_with_kvcache(q, kc, vc, k, k, **args)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


PAGED_BAD = [
    ([[0, 1], [2, 6]], r"block_table\[1, 1\] = 6 points outside the pool of 6 pages"),
    ([[0, 1], [2, -1]], r"block_table\[1, 1\] = -1 points outside"),
    ([[0, 0], [2, 3]], r"block_table row 0 uses page 0 twice"),
    ([[0, 1], [2, 1]], r"page 1 would be written by sequences 0 and 1"),
    # sequence 0 appends at position 5 (page 1, slot 1) while sequence 1 reads page 1 as its first page
    (
        [[0, 1], [1, 3]],
        r"page 1 would be written by sequence 0 while sequence 1 reads it \(block_table\[1, 0\]\)",
    ),
]


@pytest.mark.parametrize("table,match", PAGED_BAD)
def test_bad_block_tables(table, match):
    q, kc, vc, k = _setup(paged=True)
    before = kc.clone()
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(
            q,
            kc,
            vc,
            k,
            k,
            cache_seqlens=torch.tensor([5, 6], dtype=I32),
            block_table=torch.tensor(table, dtype=I32),
        )
    assert torch.equal(kc, before)


def test_paged_capacity_names_pages():
    q, kc, vc, k = _setup(paged=True)
    with pytest.raises(ValueError, match=r"max_num_blocks_per_seq 2 × page_block_size 4"):
        flash_attn_with_kvcache(
            q, kc, vc, k, k, cache_seqlens=torch.tensor([8, 1], dtype=I32),
            block_table=torch.tensor([[0, 1], [2, 3]], dtype=I32),
        )  # fmt: skip


def test_dtype_and_shape_mismatches():
    q, kc, vc, k = _setup()
    with pytest.raises(TypeError, match=r"k_cache has dtype torch.float64 but q has torch.float32"):
        flash_attn_with_kvcache(q, kc.double(), vc.double())
    with pytest.raises(TypeError, match=r"k has dtype torch.float64 but the cache holds torch.float32"):
        flash_attn_with_kvcache(q, kc, vc, k.double(), k.double(), cache_seqlens=1)
    with pytest.raises(ValueError, match=r"heads \(2\) must be a multiple of the cache's kv heads \(3\)"):
        flash_attn_with_kvcache(q, torch.zeros(2, 8, 3, 4), torch.zeros(2, 8, 3, 4))
    with pytest.raises(ValueError, match="give both k and v"):
        flash_attn_with_kvcache(q, kc, vc, k, None, cache_seqlens=1)
    with pytest.raises(ValueError, match="need the new k and v"):
        flash_attn_with_kvcache(
            q, kc, vc, rotary_cos=torch.ones(9, 2), rotary_sin=torch.ones(9, 2), cache_seqlens=1
        )


@pytest.mark.parametrize(
    "kw",
    [
        dict(new=1, causal=True),
        dict(new=0, tq=1, causal=True, lens=(31,)),
        dict(new=3, causal=False),
        dict(new=1, causal=True, leftpad=(5,)),
        dict(new=1, causal=True, softcap=0.5),
        dict(B=3, lens=(30, 0, 12), new=1, causal=True),  # several sequences: their queries rows of one call
        dict(B=2, lens=(5, 20), new=2, causal=False, leftpad=(1, 3)),
        dict(B=2, H=6, Hkv=2, lens=(7, 19), new=1, causal=True, softcap=1.5),
    ],
)
def test_scattered_pages_are_read_in_place(kw, monkeypatch):
    import selfattention.flash_kvcache as fk

    used = []
    real = fk._pool_span
    monkeypatch.setattr(fk, "_pool_span", lambda *a: used.append(1) or real(*a))
    args = dict(B=1, lens=(30,), page=4, shuffle=True, seed=21)  # unused pages hold NaN: never read as keys
    args.update(kw)
    _check_against_oracle(**args)
    assert used  # the path without a gather was taken


def test_device_mismatch_names_both_devices():
    q, kc, vc, k = _setup()
    with pytest.raises(ValueError, match=r"k_cache is on cpu but q is on meta"):
        flash_attn_with_kvcache(q.to("meta"), kc, vc)
    with pytest.raises(ValueError, match=r"k is on meta but the cache is on cpu"):
        flash_attn_with_kvcache(q, kc, vc, k.to("meta"), k.to("meta"), cache_seqlens=1)


def test_an_expanded_cache_is_refused_for_writes():
    # a stride-0 batch dim: both sequences' writes would land in one row (before the fix: accepted, silently)
    q, kc, vc, k = _setup()
    shared = kc[:1].expand(2, -1, -1, -1)
    before = kc.clone()
    with pytest.raises(ValueError, match=r"k_cache has stride 0 along a dimension"):
        flash_attn_with_kvcache(q, shared, vc, k, k, cache_seqlens=torch.tensor([3, 5], dtype=I32))
    assert torch.equal(kc, before)
    flash_attn_with_kvcache(q, shared, vc, cache_seqlens=torch.tensor([3, 5], dtype=I32))  # reading is fine
