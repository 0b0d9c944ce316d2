"""Attempts to break :func:`selfattention.tiled.tiled_attention_with_stats` after the statistics sweep's
rewrite (scripted jobs on pool workers, −ℓ folded into the gemm, spans of top-k, scratch per thread).

Every statistic is checked against a dense float64 oracle written here: weights = softmax over the visible
scores, entropy −Σ α log α, top-k weights (indices checked to point at a visible key of that weight, since
ties make the oracle's own indices one valid answer among several) with -1 past the visible keys, and
column sums Σ_i α_ij."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from selfattention.tiled import tiled_attention, tiled_attention_with_stats


def _oracle(q, k, v, vis, top_k, scale=None, bias=None):
    """(out, entropy, top weights, number of visible keys, column sums, weights, visible) in float64.
    ``vis`` bool broadcastable to (B, H, Tq, Tk); ``bias`` added to the scores where visible."""
    g = q.shape[-3] // k.shape[-3]
    kr, vr = (t.detach().double().repeat_interleave(g, -3) for t in (k, v))
    sc = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q.detach().double() @ kr.transpose(-1, -2) * sc
    vis = vis.expand_as(s)
    if bias is not None:
        s = s + torch.where(vis, bias.double(), 0.0)
    s = s.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(s, -1, keepdim=True)
    w = torch.exp(s - lse).nan_to_num(0.0)
    ent = -(w * torch.where(w > 0, s - lse, 0.0)).sum(-1)
    tw = w.topk(min(top_k, w.shape[-1]), -1).values
    out = torch.where(vis[..., None], w[..., None] * vr[..., None, :, :], 0.0).sum(-2)  # hidden v: no NaN
    return out, ent, tw, vis.sum(-1), w.sum(-2), w, vis


def _check(st, out, ref, top_k, tol):
    r_out, r_ent, r_tw, n_vis, r_cs, w, vis = ref
    kk = r_tw.shape[-1]
    assert torch.allclose(out.double(), r_out, atol=tol, rtol=tol)
    assert torch.allclose(st.entropy.double(), r_ent, atol=tol, rtol=tol)
    assert torch.allclose(st.column_sums.double(), r_cs, atol=tol, rtol=tol)
    assert st.topk_weights.shape == st.topk_indices.shape == (*r_ent.shape, top_k)
    assert torch.allclose(st.topk_weights[..., :kk].double(), r_tw, atol=tol, rtol=tol)
    assert (st.topk_indices[..., kk:] == -1).all() and (st.topk_weights[..., kk:] == 0).all()
    ti = st.topk_indices[..., :kk]
    assert torch.equal(ti >= 0, torch.arange(kk) < n_vis[..., None]), "-1 exactly past the visible keys"
    j = ti.clamp_min(0)
    assert (vis.gather(-1, j) | (ti < 0)).all(), "an index points at a hidden key"
    assert torch.allclose(
        w.gather(-1, j).masked_fill(ti < 0, 0.0), st.topk_weights[..., :kk].double(), atol=tol
    )
    if kk > 1:
        srt = ti.sort(-1).values
        assert not ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any(), "a key reported twice"


@pytest.fixture
def small_tiles(small_stat_tiles):
    return small_stat_tiles


def _rand(*shape, dtype=torch.float64, seed=0, sc=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * sc).to(dtype)


# --- defect found (fixed): a bias of large finite values, transformers-style -----------------------------


@pytest.mark.parametrize(
    "dtype, big", [(torch.float32, -1e9), (torch.float32, "min"), (torch.float64, "min")], ids=str
)
def test_rows_masked_everywhere_by_a_large_finite_bias_get_uniform_weights(small_tiles, dtype, big):
    """A padding query masked on every key by -1e9 or finfo.min (what transformers builds) has uniform
    weights: its scores are swamped, softmax of equal values. The sweep folded −ℓ into the gemm and added
    the bias after it, (s − ℓ) + bias, and ℓ ≈ −1e9 is only known to ulp(1e9) = 64 in float32: every weight
    came out as exp(0) = 1 (top-k weights 1.0, entropy 0, column sums off by the padding rows)."""
    big = torch.finfo(dtype).min if big == "min" else big
    b, h, hk, tq, tk = 2, 4, 2, 21, 101
    q, k, v = (
        _rand(b, h, tq, 12, dtype=dtype, seed=1),
        _rand(b, hk, tk, 12, dtype=dtype, seed=2),
        _rand(b, hk, tk, 5, dtype=dtype, seed=3),
    )
    keep = torch.ones(b, 1, tq, tk, dtype=torch.bool)
    keep[0, :, :5] = False  # left padding of batch row 0: its first queries see nothing...
    keep[0, :, :, :5] = False  # ...and nobody sees the padded keys
    keep[1, :, 7] = False
    mask = torch.zeros(b, 1, tq, tk, dtype=dtype).masked_fill(~keep, big)
    out, st = tiled_attention_with_stats(q, k, v, attn_mask=mask, top_k=3, enable_gqa=True)
    # float64 oracle of the same arithmetic: a swamped row has equal scores; others softmax over the kept keys
    swamped = ~keep.any(-1, keepdim=True)
    ref = _oracle(q, k, v, keep | swamped, 3)
    s_rows = swamped.expand(b, h, tq, 1)[..., 0]
    r_out, r_ent, r_tw, n_vis, r_cs, w, vis = ref
    uniform = torch.full_like(w, 1.0 / tk)
    w = torch.where(s_rows[..., None], uniform, w)
    r_ent = torch.where(s_rows, math.log(tk), r_ent)
    r_tw = torch.where(s_rows[..., None], 1.0 / tk, r_tw)
    r_out = torch.where(s_rows[..., None], v.double().repeat_interleave(2, 1).mean(-2, keepdim=True), r_out)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    _check(st, out, (r_out, r_ent, r_tw, n_vis, w.sum(-2), w, vis), 3, tol)


def test_causal_plus_padding_bias_float32_matches_sdpa_weights(small_tiles):
    """is_causal with a finfo.min padding bias (several chunks and spans): statistics of the weights that
    torch's own SDPA uses, computed densely in float32 (the bias swamps the scores the same way)."""
    b, h, t = 2, 2, 83
    q, k, v = (_rand(b, h, t, 16, dtype=torch.float32, seed=s) for s in (4, 5, 6))
    pad = torch.zeros(b, 1, t, t)
    pad[1, :, :, :9] = torch.finfo(torch.float32).min  # keys 0..8 of batch row 1 are padding
    out, st = tiled_attention_with_stats(q, k, v, attn_mask=pad, is_causal=True, top_k=4)
    s = q @ k.transpose(-1, -2) / 4.0 + pad
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    w = torch.softmax(s, -1).double()
    ent = -(w * torch.log(w.clamp_min(1e-300))).sum(-1)
    assert torch.allclose(
        out, torch.nn.functional.scaled_dot_product_attention(q, k, v, pad, is_causal=True), atol=1e-5
    )
    assert torch.allclose(st.entropy.double(), ent, atol=1e-5)
    assert torch.allclose(st.column_sums.double(), w.sum(-2), atol=1e-4, rtol=1e-5)
    assert torch.allclose(st.topk_weights.double(), w.topk(4, -1).values, atol=1e-6)
    # query 2 of batch row 1 sees only padding keys 0..2: equal weights, and no fourth key
    assert torch.allclose(st.topk_weights[1, :, 2], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]), atol=1e-6)
    assert (st.topk_indices[1, :, 2, 3] == -1).all()


# --- regressions: each of these was tried against the rewrite and holds ----------------------------------

_CASES = {
    "dense Tq < Tk, GQA 3": (1, 6, 2, 7, 97, {}),
    "dense Tq > Tk, GQA 4": (2, 4, 1, 97, 7, {}),
    "causal Tq < Tk": (1, 2, 1, 30, 200, {"is_causal": True}),
    "causal Tq > Tk (blind rows)": (1, 2, 2, 120, 45, {"is_causal": True}),
    "window, GQA 2": (2, 4, 2, 150, 151, {"window": 17}),
    "Tq = Tk = 1": (1, 1, 1, 1, 1, {"is_causal": True}),
}


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.parametrize("top_k", [0, 3, 9, 300])
def test_shapes_and_top_k_paths_match_float64(small_tiles, case, top_k):
    """top_k ≤ 8 (rounds of max), > 8 (torch.topk), larger than the visible keys and than Tk."""
    b, h, hk, tq, tk, kw = _CASES[case]
    q, k, v = _rand(b, h, tq, 13, seed=7, sc=2), _rand(b, hk, tk, 13, seed=8), _rand(b, hk, tk, 5, seed=9)
    out, st = tiled_attention_with_stats(q, k, v, top_k=top_k, enable_gqa=True, **kw)
    i = torch.arange(tq)[:, None] + tk - tq
    j = torch.arange(tk)
    vis = torch.ones(tq, tk, dtype=torch.bool)
    if kw.get("is_causal") or "window" in kw:
        vis = j <= i
    if "window" in kw:
        vis = vis & (j > i - kw["window"])
    _check(st, out, _oracle(q, k, v, vis, top_k), top_k, 1e-10)


@pytest.mark.parametrize("shape", [(2, 1, 37, 131), (1, 4, 1, 131), (37, 131), (1, 1, 1, 131)], ids=str)
@pytest.mark.parametrize("kind", ["bool", "-inf", "-1e9"])
def test_broadcast_masks_match_float64(small_tiles, shape, kind):
    q, k, v = _rand(2, 4, 37, 9, seed=10, sc=2), _rand(2, 2, 131, 9, seed=11), _rand(2, 2, 131, 5, seed=12)
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(13)) > 0.6
    if kind == "bool":
        mask, vis, bias = keep, keep, None
    else:
        fill = -math.inf if kind == "-inf" else -1e9
        bias = _rand(*shape, seed=14)
        mask = torch.where(keep, bias, fill)
        vis = keep if kind == "-inf" else torch.ones(shape, dtype=torch.bool)
        bias = mask if kind == "-1e9" else bias
    out, st = tiled_attention_with_stats(q, k, v, attn_mask=mask, top_k=5, enable_gqa=True)
    _check(st, out, _oracle(q, k, v, vis, 5, bias=bias), 5, 1e-10)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=str)
@pytest.mark.parametrize("how", ["bool", "float -inf", "window", "causal triangle", "masked query"])
def test_hidden_nan_inf_does_not_leak(small_tiles, bad, how):
    tq = tk = 120
    q, k, v = _rand(1, 2, tq, 8, seed=15), _rand(1, 1, tk, 8, seed=16), _rand(1, 1, tk, 4, seed=17)
    kw = {}
    i, j = torch.arange(tq)[:, None], torch.arange(tk)
    rows = slice(None)
    if how in ("bool", "float -inf"):
        vis = torch.rand(tq, tk, generator=torch.Generator().manual_seed(18)) > 0.5
        vis[:, 50] = False
        k[..., 50, :], v[..., 50, :] = bad, bad
        kw["attn_mask"] = (
            vis if how == "bool" else torch.zeros(tq, tk, dtype=torch.float64).masked_fill(~vis, -math.inf)
        )
    elif how == "window":
        vis = (j <= i) & (j > i - 30)
        k[..., 0, :], v[..., 0, :] = bad, bad
        kw["window"] = 30
        rows = slice(30, None)  # the rows that do not see key 0
    elif how == "causal triangle":
        vis = j <= i
        k[..., -1, :], v[..., -1, :] = bad, bad
        kw["is_causal"] = True
        rows = slice(0, tq - 1)  # the last row sees it
    else:
        vis = torch.ones(tq, tk, dtype=torch.bool)
        vis[3] = False
        q[..., 3, :] = bad
        kw["attn_mask"] = vis
    out, st = tiled_attention_with_stats(q, k, v, top_k=4, enable_gqa=True, **kw)
    r_out, r_ent, r_tw, n_vis, r_cs, w, visx = _oracle(q, k, v, vis, 4)
    assert torch.allclose(out[..., rows, :], r_out[..., rows, :], atol=1e-10)
    assert torch.allclose(st.entropy[..., rows], r_ent[..., rows], atol=1e-10)
    assert torch.allclose(st.topk_weights[..., rows, :], r_tw[..., rows, :], atol=1e-10)
    ti = st.topk_indices[..., rows, :]
    assert torch.equal(ti >= 0, torch.arange(4) < n_vis[..., rows, None])
    assert (visx[..., rows, :].gather(-1, ti.clamp_min(0)) | (ti < 0)).all()
    if rows == slice(None):
        assert torch.allclose(st.column_sums, r_cs, atol=1e-10)


@pytest.mark.parametrize("top_k", [3, 12])
def test_ties_duplicate_and_equal_keys(small_tiles, top_k):
    q = _rand(1, 2, 40, 8, seed=19)
    k = _rand(1, 2, 130, 8, seed=20)
    k[:, :, 1::2] = k[:, :, 0:-1:2]  # every key twice
    v = _rand(1, 2, 130, 4, seed=21)
    out, st = tiled_attention_with_stats(q, k, v, top_k=top_k)
    _check(st, out, _oracle(q, k, v, torch.ones(40, 130, dtype=torch.bool), top_k), top_k, 1e-10)
    z = torch.zeros_like(k)  # all keys equal, causal
    out, st = tiled_attention_with_stats(q, z, v, top_k=top_k, is_causal=True)
    vis = torch.arange(130) <= torch.arange(40)[:, None] + 90
    _check(st, out, _oracle(q, z, v, vis, top_k), top_k, 1e-10)


def test_real_tiles_tk_9000_several_spans():
    """The real tile sizes: 9000 keys are 9 chunks of 1024, two top-k spans."""
    q, k, v = (
        _rand(1, 2, 130, 40, seed=22, sc=1.5),
        _rand(1, 1, 9000, 40, seed=23),
        _rand(1, 1, 9000, 3, seed=24),
    )
    out, st = tiled_attention_with_stats(q, k, v, is_causal=True, top_k=12, enable_gqa=True)
    vis = torch.arange(9000) <= torch.arange(130)[:, None] + 9000 - 130
    _check(st, out, _oracle(q, k, v, vis, 12), 12, 1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_within_twice_the_naive_error(dtype):
    q, k, v = (
        _rand(1, 4, 50, 24, dtype=dtype, seed=25, sc=2),
        _rand(1, 2, 230, 24, dtype=dtype, seed=26),
        _rand(1, 2, 230, 8, dtype=dtype, seed=27),
    )
    _, st = tiled_attention_with_stats(q, k, v, is_causal=True, top_k=5, enable_gqa=True)
    vis = torch.arange(230) <= torch.arange(50)[:, None] + 180
    _, r_ent, r_tw, _, r_cs, w, _ = _oracle(q, k, v, vis, 5)
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(24)
    naive = torch.softmax(s.masked_fill(~vis, -math.inf), -1).double()
    assert (st.topk_weights.double() - r_tw).abs().max() <= 2 * (naive.topk(5, -1).values - r_tw).abs().max()
    assert (st.column_sums.double() - r_cs).abs().max() <= 2 * (naive.sum(-2) - r_cs).abs().max()


def test_two_threads_at_once_equal_sequential_and_thread_counts_agree():
    specs = [
        (300, 300, {"is_causal": True}, 5),
        (97, 1025, {}, 12),
        (200, 200, {"window": 33}, 1),
        (64, 64, {}, 0),
    ]

    def one(n):
        tq, tk, kw, top_k = specs[n]
        q, k, v = (
            _rand(1, 4, tq, 16, seed=n),
            _rand(1, 2, tk, 16, seed=n + 9),
            _rand(1, 2, tk, 6, seed=n + 19),
        )
        _, st = tiled_attention_with_stats(q, k, v, top_k=top_k, enable_gqa=True, **kw)
        return st

    seq = [one(n) for n in range(len(specs))]
    got: list = [None] * len(specs)

    def work(n):
        got[n] = one(n)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(seq, got, strict=True):
        assert torch.equal(a.topk_indices, b.topk_indices)
        for x, y in [
            (a.entropy, b.entropy),
            (a.topk_weights, b.topk_weights),
            (a.column_sums, b.column_sums),
        ]:
            assert torch.allclose(x, y, atol=1e-12)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = one(0)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one_thread.topk_indices, seq[0].topk_indices)
    assert torch.allclose(one_thread.entropy, seq[0].entropy, atol=1e-12)


def test_transposed_views_are_not_mutated_and_grad_matches_tiled_attention():
    q = _rand(2, 37, 4, 16, seed=30).transpose(1, 2)  # (B, T, H, D) seen as (B, H, T, D)
    k, v = _rand(2, 131, 2, 16, seed=31).transpose(1, 2), _rand(2, 131, 2, 6, seed=32).transpose(1, 2)
    mask = torch.rand(37, 131, generator=torch.Generator().manual_seed(33)) > 0.3
    before = [t.clone() for t in (q, k, v, mask)]
    out, st = tiled_attention_with_stats(q, k, v, attn_mask=mask, is_causal=True, top_k=4, enable_gqa=True)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v, mask), strict=True))
    vis = mask & (torch.arange(131) <= torch.arange(37)[:, None] + 94)
    _check(st, out, _oracle(q, k, v, vis, 4), 4, 1e-10)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, _ = tiled_attention_with_stats(qg, kg, vg, is_causal=True, top_k=2, enable_gqa=True)
    ref = tiled_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
    assert out.requires_grad and torch.allclose(out, ref, atol=1e-12)
    g1 = torch.autograd.grad(out.square().sum(), (qg, kg, vg))
    g2 = torch.autograd.grad(ref.square().sum(), (qg, kg, vg))
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(g1, g2, strict=True))


@pytest.mark.parametrize("kw", [{"is_causal": True}, {"attn_mask": "random"}], ids=["causal", "mask"])
def test_top_k_weights_below_the_floor_are_zero_like_the_column_sums(small_tiles, kw):
    """float32, queries 40× the keys: a row's 2nd/3rd best key can lie below e^-87. The column sums and the
    entropy count such a weight as 0 (no denormals); the top-k weights reported it as a denormal (1e-40)."""
    q = _rand(1, 2, 120, 16, dtype=torch.float32, seed=40, sc=40.0)
    k, v = (
        _rand(1, 2, 120, 16, dtype=torch.float32, seed=41),
        _rand(1, 2, 120, 4, dtype=torch.float32, seed=42),
    )
    if "attn_mask" in kw:
        kw = {"attn_mask": torch.rand(120, 120, generator=torch.Generator().manual_seed(43)) > 0.5}
    _, st = tiled_attention_with_stats(q, k, v, top_k=3, **kw)
    tiny = torch.finfo(torch.float32).tiny
    for t in (st.topk_weights, st.column_sums, st.entropy):
        assert not ((t != 0) & (t.abs() < tiny)).any()
    vis = kw.get("attn_mask", torch.arange(120) <= torch.arange(120)[:, None])
    _, _, r_tw, n_vis, _, _, _ = _oracle(q, k, v, vis, 3)
    assert torch.allclose(st.topk_weights.double(), r_tw, atol=1e-6)
    assert torch.equal(st.topk_indices >= 0, torch.arange(3) < n_vis[..., None])  # the keys are still named


@pytest.mark.parametrize("threads", [1, 2])
def test_inference_mode_calls_and_the_calls_after_them(threads):
    """Under torch.inference_mode (generate, eval loops) the pool's workers ran outside it and refused to
    write into the sweep's buffers made under it ("Inplace update to inference tensor outside
    InferenceMode"); and scratch buffers kept per thread, when first made under inference mode, made every
    later ordinary call on that thread fail the same way."""
    q, k, v = (_rand(1, 4, 300, 32, dtype=torch.float32, seed=s) for s in (50, 51, 52))
    mask = torch.rand(300, 300, generator=torch.Generator().manual_seed(53)) > 0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        ref = [
            tiled_attention_with_stats(q, k, v, top_k=3, **kw)[1]
            for kw in ({"is_causal": True}, {"attn_mask": mask})
        ]
        for dtype in (torch.float64, torch.float32):  # a dtype change makes every thread's scratch anew
            with torch.inference_mode():
                got = [
                    tiled_attention_with_stats(q.to(dtype), k.to(dtype), v.to(dtype), top_k=3, **kw)[1]
                    for kw in ({"is_causal": True}, {"attn_mask": mask})
                ]
            for a, b in zip(ref, got, strict=True):
                assert torch.allclose(a.entropy, b.entropy.float(), atol=1e-5)
                assert torch.allclose(a.column_sums, b.column_sums.float(), atol=1e-5)
        again = tiled_attention_with_stats(q, k, v, is_causal=True, top_k=3)[1]  # same dtype as the last
        assert torch.allclose(again.entropy, ref[0].entropy, atol=1e-5)
    finally:
        torch.set_num_threads(before)


# --- defect found (fixed): scores of 10⁹ and more ---------------------------------------------------------


@pytest.mark.parametrize("scale", [1e9, 1e12], ids=str)
@pytest.mark.parametrize("case", ["dense", "causal", "window", "gqa-tq<tk", "bias"], ids=str)
@pytest.mark.parametrize("top_k", [0, 3])
def test_scores_of_a_billion_give_weights_one_hot_on_the_largest_score(small_tiles, scale, case, top_k):
    """Scores of 10⁹ and more: ℓ is known only to ulp(ℓ) ≥ 64 in float32, so exp(s − ℓ) under- or overflowed
    on every key of a row: the top weight came out 0 (not 1), column sums 0 and the entropy 0 by accident.
    Such rows are now swept with their largest score as ℓ. Oracle: float64 softmax of the same scores
    (random scores of 10⁹ differ by far more than ulp, so the weights are one-hot)."""
    b, h, hk, tq, tk = 1, 4, 4, 37, 37
    window, causal, bias = None, False, None
    if case == "gqa-tq<tk":
        hk, tk = 2, 53
    q, k, v = (
        _rand(b, h, tq, 8, dtype=torch.float32, seed=1),
        _rand(b, hk, tk, 8, dtype=torch.float32, seed=2),
        _rand(b, hk, tk, 5, dtype=torch.float32, seed=3),
    )
    vis = torch.ones(1, 1, tq, tk, dtype=torch.bool)
    if case in ("causal", "window"):
        causal = True
        vis = vis.tril()
    if case == "window":
        window = 5
        vis = vis & ~torch.ones(tq, tk, dtype=torch.bool).tril(-window)
    if case == "bias":
        bias = _rand(1, 1, tq, tk, dtype=torch.float32, seed=4)
    out, st = tiled_attention_with_stats(
        q, k, v, attn_mask=bias, is_causal=causal, window=window, scale=scale, top_k=top_k,
        enable_gqa=hk != h,
    )  # fmt: skip
    ref = _oracle(q, k, v, vis, max(top_k, 1), scale=scale, bias=bias)
    r_out, r_ent, r_tw, n_vis, r_cs, w, _ = ref
    assert torch.allclose(w.amax(-1), torch.ones((), dtype=w.dtype), atol=1e-6), (
        "the oracle's weights are one-hot"
    )
    assert torch.allclose(out.double(), r_out, atol=1e-5)
    assert torch.allclose(st.column_sums.double(), r_cs, atol=1e-5)
    assert torch.allclose(st.entropy.double(), r_ent, atol=1e-5)
    if top_k:
        assert torch.allclose(st.topk_weights.double(), r_tw, atol=1e-5)
        assert torch.equal(st.topk_indices[..., 0], w.argmax(-1))


@pytest.mark.parametrize("exponent", [20, 26, 40, 50])
@pytest.mark.parametrize("causal", [False, True])
def test_tied_huge_scores_share_their_weight(small_tiles, exponent, causal):
    """Two keys tied at the largest score 2ᵉ·|q|: ℓ = s + log 2 rounds to s in float32 from 2²⁴ on, and the
    gemm's −ℓ + correction column rounded the correction away: each tied key got weight 1 and the entropy
    0 (found by a breaker run). With a large ℓ every term is now added after the score."""
    q = torch.zeros(1, 1, 5, 3)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 5, 3)
    k[0, 0, :, 0] = torch.tensor([1.0, -1.0, 1.0, 0.5, 1.0])  # ties at keys 0, 2, 4
    v = _rand(1, 1, 5, 4, dtype=torch.float32, seed=7)
    out, st = tiled_attention_with_stats(q, k, v, is_causal=causal, scale=2.0**exponent, top_k=3)
    vis = torch.ones(5, 5, dtype=torch.bool)
    if causal:
        vis = vis.tril()
    # the oracle as softmax (max subtracted: exact in float64 for ties, where s − logsumexp(s) is not at 2⁵⁰)
    sc = (q.double() @ k.double().transpose(-1, -2) * 2.0**exponent).masked_fill(~vis, -math.inf)
    w = torch.softmax(sc, -1)
    ent = -(w * torch.log(w.clamp_min(1e-300))).sum(-1)
    assert torch.allclose(st.topk_weights.double(), w.topk(3, -1).values, atol=1e-5)
    assert torch.allclose(st.entropy.double(), ent, atol=1e-5)
    assert torch.allclose(st.column_sums.double(), w.sum(-2), atol=1e-5)
    assert torch.allclose(out.double(), w @ v.double(), atol=1e-5)
    assert ent.max() > 1.0  # log 3 where three keys tie: the case is live
