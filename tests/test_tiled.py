"""The tiled path against the float64 loop oracle (tests/oracle.py) and the reference (functional.py)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import selfattention as sa
from selfattention import masks
from selfattention.tiled import computed_fraction, tiled_attention, tiled_attention_with_stats
from tests.oracle import attention_ref, visible_mask


def _qkv(b, h, hk, tq, tk, d, dv, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hk, tk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hk, tk, dv, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


# ---------------------------------------------------------------- forward against the loop oracle


@functools.cache
def _oracle(tq: int, tk: int, is_causal: bool) -> torch.Tensor:
    q, k, v = _qkv(1, 1, 1, tq, tk, 59, 31, seed=tq * 100 + tk)
    return attention_ref(q, k, v, is_causal=is_causal)[0]


@pytest.mark.parametrize("tq,tk", [(1, 1), (7, 7), (97, 97), (7, 12), (12, 7), (1, 97)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("blocks", [(3, 5), (16, 23)])
def test_forward_matches_float64_oracle(tq, tk, is_causal, blocks):
    q, k, v = _qkv(1, 1, 1, tq, tk, 59, 31, seed=tq * 100 + tk)
    out = tiled_attention(q, k, v, is_causal=is_causal, block_q=blocks[0], block_k=blocks[1])
    ref = _oracle(tq, tk, is_causal)
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("is_causal", [False, True])
def test_t1025_float32_default_blocks_matches_reference(is_causal):
    q, k, v = _qkv(1, 2, 2, 1025, 1025, 64, 64, dtype=torch.float32, seed=3)
    out = tiled_attention(q, k, v, is_causal=is_causal)
    ref = sa.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=is_causal)
    assert torch.allclose(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_t1025_float64_odd_blocks_matches_reference():
    q, k, v = _qkv(1, 1, 1, 1025, 1025, 59, 17, seed=4)
    for kw in ({"is_causal": True}, {"window": 100}):
        out = tiled_attention(q, k, v, block_q=97, block_k=130, **kw)
        mask = masks.sliding_window_mask(1025, window=kw["window"]) if "window" in kw else None
        ref = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal="is_causal" in kw)
        assert torch.allclose(out, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("window", [1, 3, 8, 40])
@pytest.mark.parametrize("tq,tk", [(37, 37), (13, 41)])
def test_window_matches_oracle(window, tq, tk):
    q, k, v = _qkv(1, 2, 2, tq, tk, 6, 5, seed=window)
    out = tiled_attention(q, k, v, window=window, block_q=4, block_k=7)
    ref, _ = attention_ref(q, k, v, attn_mask=visible_mask(tq, tk, window=window))
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("sorted_ids", [True, False])
def test_document_ids_match_dense_document_mask(is_causal, sorted_ids):
    t = 50
    g = torch.Generator().manual_seed(7)
    if sorted_ids:
        ids = torch.stack(
            [
                torch.repeat_interleave(torch.arange(4), torch.tensor(n))
                for n in ([5, 20, 1, 24], [30, 10, 9, 1])
            ]
        )
    else:
        ids = torch.randint(0, 3, (2, t), generator=g)
    q, k, v = _qkv(2, 3, 3, t, t, 8, 8, seed=8)
    out = tiled_attention(q, k, v, is_causal=is_causal, document_ids=ids, block_q=6, block_k=9)
    dense = masks.document_mask(ids)[:, None]  # (B, 1, T, T)
    ref = sa.scaled_dot_product_attention(q, k, v, attn_mask=dense, is_causal=is_causal)
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)


def test_document_ids_pair_for_tq_ne_tk():
    q, k, v = _qkv(1, 2, 2, 5, 12, 4, 4, seed=9)
    q_ids, k_ids = torch.tensor([1, 1, 2, 2, 2]), torch.tensor([0] * 4 + [1] * 4 + [2] * 4)
    out = tiled_attention(q, k, v, document_ids=(q_ids, k_ids), block_q=2, block_k=3)
    ref = sa.scaled_dot_product_attention(q, k, v, attn_mask=masks.document_mask(q_ids, k_ids))
    assert torch.allclose(out, ref, atol=1e-12, rtol=0)


def test_bool_mask_hiding_whole_blocks_and_rows():
    tq, tk = 29, 31
    q, k, v = _qkv(2, 2, 2, tq, tk, 5, 3, seed=10, grad=True)
    mask = torch.rand(2, 1, tq, tk, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, :, :, 8:20] = False  # whole key blocks hidden
    mask[0, :, 3] = False  # a query that sees nothing
    mask[1, :, 10:16] = False
    out = tiled_attention(q, k, v, attn_mask=mask, is_causal=True, block_q=4, block_k=5)
    ref, _ = attention_ref(q, k, v, attn_mask=mask, is_causal=True)
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)
    assert torch.all(out[0, :, 3] == 0) and torch.all(out[1, :, 10:16] == 0)
    out.sum().backward()
    assert torch.all(q.grad[0, :, 3] == 0) and torch.isfinite(q.grad).all()
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_float_mask_bias_and_neg_inf():
    q, k, v = _qkv(1, 2, 2, 13, 17, 4, 4, seed=11)
    bias = torch.randn(13, 17, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    bias[:, 5:9] = -math.inf
    bias[2] = -math.inf
    out = tiled_attention(q, k, v, attn_mask=bias, block_q=3, block_k=4)
    ref, _ = attention_ref(q, k, v, attn_mask=bias)
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)


def test_huge_negative_bias_is_a_bias_not_a_hide():
    # finfo.min as a "soft" mask (as some models use) is still visible in the reference: uniform rows
    q, k, v = _qkv(1, 1, 1, 6, 40, 4, 4, dtype=torch.float32, seed=12)
    bias = torch.full((6, 40), torch.finfo(torch.float32).min)
    out = tiled_attention(q, k, v, attn_mask=bias, block_q=4, block_k=16)
    ref = sa.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("factor", [30.0, 1e-3])
def test_extreme_scores_take_the_safe_path_exactly(factor):
    # scores far above exp's range (or all tiny) must still give the exact softmax
    q, k, v = _qkv(1, 2, 2, 40, 70, 8, 8, dtype=torch.float32, seed=13)
    out = tiled_attention(q * factor, k * factor, v, is_causal=True, block_q=16, block_k=32)
    ref = sa.scaled_dot_product_attention(
        (q * factor).double(), (k * factor).double(), v.double(), is_causal=True
    )
    assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_scale_zero_and_custom_scale():
    q, k, v = _qkv(1, 1, 1, 9, 9, 3, 3, seed=14)
    for scale in (0.0, 2.5):
        out = tiled_attention(q, k, v, scale=scale, is_causal=True, block_q=2, block_k=4)
        ref, _ = attention_ref(q, k, v, is_causal=True, scale=scale)
        assert torch.allclose(out, ref, atol=1e-10, rtol=0)


def test_gqa_without_repeating_kv():
    q, k, v = _qkv(2, 6, 2, 19, 23, 5, 7, seed=15)
    out = tiled_attention(q, k, v, is_causal=True, enable_gqa=True, block_q=4, block_k=6)
    ref, _ = attention_ref(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    assert torch.allclose(out, ref, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="enable_gqa"):
        tiled_attention(q, k, v)


def test_hidden_nan_and_inf_keys_do_not_leak():
    q, k, v = _qkv(1, 2, 2, 10, 10, 4, 4, seed=16)
    k, v = k.clone(), v.clone()
    k[..., 9, 0] = math.nan  # future key: hidden from every query but the last
    v[..., 9, 1] = math.inf
    k[..., 5, :] = math.inf
    mask = torch.ones(10, 10, dtype=torch.bool)
    mask[:, 5] = False
    out = tiled_attention(q, k, v, attn_mask=mask, is_causal=True, block_q=3, block_k=4)
    ref = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    assert torch.isfinite(out[..., :9, :]).all()
    assert torch.allclose(out[..., :9, :], ref[..., :9, :], atol=1e-12)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))


def test_visible_nan_propagates():
    q, k, v = _qkv(1, 1, 1, 4, 4, 3, 3, seed=17)
    v = v.clone()
    v[0, 0, 0, 0] = math.nan
    out = tiled_attention(q, k, v, block_q=2, block_k=2)
    assert torch.isnan(out[..., 0]).all() and torch.isfinite(out[..., 1:]).all()


def test_empty_lengths_like_reference():
    q, k, v = _qkv(1, 2, 2, 0, 5, 4, 3, grad=True)
    assert tiled_attention(q, k, v).shape == (1, 2, 0, 3)
    q, k, v = _qkv(1, 2, 2, 4, 0, 4, 3, grad=True)
    out = tiled_attention(q, k, v, is_causal=True)
    assert torch.equal(out, sa.scaled_dot_product_attention(q, k, v, is_causal=True))
    out.sum().backward()
    assert torch.all(q.grad == 0)


def test_unbatched_and_broadcast_batch():
    g = torch.Generator().manual_seed(18)
    x = torch.randn(11, 6, generator=g, dtype=torch.float64)
    assert torch.allclose(
        tiled_attention(x, x, x, block_q=3, block_k=4),
        sa.simple_attention(x) * 0 + sa.scaled_dot_product_attention(x, x, x),
        atol=1e-12,
    )
    q = torch.randn(3, 1, 5, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64)
    out = tiled_attention(q, k, k, block_q=2, block_k=3)
    assert torch.allclose(out, sa.scaled_dot_product_attention(q, k, k), atol=1e-12)


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize(
    "kw",
    [
        {"is_causal": True},
        {"window": 3},
        {"document_ids": torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])},
        {"attn_mask": torch.tensor([[True] * 4 + [False] * 5] * 5 + [[False] * 9] + [[True] * 9] * 3)},
    ],
    ids=["causal", "window", "documents", "dense-mask-with-empty-row"],
)
def test_gradcheck_float64(kw):
    q, k, v = _qkv(1, 2, 2, 9, 9, 3, 2, seed=19, grad=True)
    fn = lambda q, k, v: tiled_attention(q, k, v, block_q=2, block_k=3, **kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), atol=1e-8, fast_mode=True)


def test_gradcheck_gqa_tq_ne_tk():
    q, k, v = _qkv(1, 4, 2, 5, 8, 3, 2, seed=20, grad=True)
    fn = lambda q, k, v: tiled_attention(q, k, v, is_causal=True, enable_gqa=True, block_q=2, block_k=3)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), atol=1e-8, fast_mode=True)


@pytest.mark.parametrize("kw", [{"is_causal": True}, {}, {"window": 20}])
def test_float32_gradients_match_reference(kw):
    q, k, v = _qkv(2, 2, 2, 97, 97, 59, 31, dtype=torch.float32, seed=21, grad=True)
    g = torch.randn(2, 2, 97, 31, generator=torch.Generator().manual_seed(5))
    ours = torch.autograd.grad((tiled_attention(q, k, v, block_q=16, block_k=23, **kw) * g).sum(), (q, k, v))
    mask = masks.sliding_window_mask(97, window=kw["window"]) if "window" in kw else None
    ref_out = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=kw.get("is_causal", False))
    ref = torch.autograd.grad((ref_out * g).sum(), (q, k, v))
    for a, b in zip(ours, ref, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_extreme_scores_gradients_safe_path():
    q, k, v = _qkv(1, 1, 1, 12, 12, 4, 3, seed=22, grad=True)
    fn = lambda q, k, v: tiled_attention(q * 40, k, v, block_q=4, block_k=5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), atol=1e-7, fast_mode=True)


# ---------------------------------------------------------------- precision


def test_bfloat16_error_at_most_twice_naive():
    q, k, v = _qkv(1, 2, 2, 200, 200, 64, 64, dtype=torch.float32, seed=23)
    exact = sa.scaled_dot_product_attention(q[:, :, :40].double(), k.double(), v.double())
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    naive = torch.softmax((qb[:, :, :40] @ kb.transpose(-2, -1)) * 0.125, dim=-1) @ vb
    ours = tiled_attention(qb, kb, vb, block_q=16, block_k=48)[:, :, :40]
    assert ours.dtype == torch.bfloat16
    err_ours = (ours.double() - exact).abs().max()
    err_naive = (naive.double() - exact).abs().max()
    assert err_ours <= 2 * err_naive


# ---------------------------------------------------------------- dropout


def test_dropout_is_a_consistent_mask_of_the_weights():
    # V = I turns the output into the dropped weights themselves: each is 0 or weight / (1 - p)
    t, p = 24, 0.5
    g = torch.Generator().manual_seed(24)
    q, k = (
        torch.randn(1, 1, t, 5, generator=g, dtype=torch.float64),
        torch.randn(1, 1, t, 5, generator=g, dtype=torch.float64),
    )
    v = torch.eye(t, dtype=torch.float64)[None, None]
    out = tiled_attention(q, k, v, dropout_p=p, is_causal=True, block_q=5, block_k=7, dropout_seed=3)
    w = sa.attention_weights(q, k, is_causal=True)
    kept = out != 0
    assert torch.allclose(out[kept], w[kept] / (1 - p), atol=1e-12)
    frac = kept[w > 0].double().mean().item()
    assert 0.35 < frac < 0.65
    again = tiled_attention(q, k, v, dropout_p=p, is_causal=True, block_q=5, block_k=7, dropout_seed=3)
    assert torch.equal(out, again)
    no_drop = tiled_attention(q, k, v, dropout_p=p, is_causal=True, training=False)
    assert torch.allclose(no_drop, w, atol=1e-12)


def test_dropout_gradcheck_with_fixed_seed():
    q, k, v = _qkv(1, 2, 2, 7, 9, 3, 2, seed=25, grad=True)

    def fn(q, k, v):
        return tiled_attention(q, k, v, dropout_p=0.3, is_causal=True, block_q=3, block_k=4, dropout_seed=11)

    assert torch.autograd.gradcheck(fn, (q, k, v), atol=1e-8, fast_mode=True)


# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("kw", [{"is_causal": True}, {"window": 5}, {}])
def test_stats_match_materialised_weights(kw):
    q, k, v = _qkv(2, 4, 2, 23, 31, 6, 5, seed=26)
    out, st = tiled_attention_with_stats(q, k, v, enable_gqa=True, top_k=3, block_q=4, block_k=7, **kw)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    vis = visible_mask(23, 31, is_causal=kw.get("is_causal", False), window=kw.get("window"))
    ref_out, w = attention_ref(q, kr, vr, attn_mask=vis)
    assert torch.allclose(out, ref_out, atol=1e-10)
    scores = (q @ kr.transpose(-2, -1)) / math.sqrt(6)
    lse = torch.logsumexp(scores.masked_fill(~vis, -math.inf), dim=-1)
    assert torch.allclose(st.lse, lse, atol=1e-10)
    ent = -(w * torch.log(torch.where(w > 0, w, torch.ones_like(w)))).sum(-1)
    assert torch.allclose(st.entropy, ent, atol=1e-10)
    tw, ti = w.topk(3, dim=-1)
    assert torch.allclose(st.topk_weights, tw, atol=1e-10)
    assert torch.equal(st.topk_indices, ti)
    assert torch.allclose(st.column_sums, w.sum(-2), atol=1e-10)


def test_stats_rows_with_few_or_no_keys():
    q, k, v = _qkv(1, 1, 1, 5, 3, 4, 4, seed=27)
    out, st = tiled_attention_with_stats(q, k, v, is_causal=True, top_k=2, block_q=2, block_k=2)
    # Tq = 5 > Tk = 3, bottom-right: queries 0, 1 see nothing, query 2 sees one key
    assert torch.all(st.lse[0, 0, :2] == -math.inf) and torch.all(st.entropy[0, 0, :2] == 0)
    assert st.topk_indices[0, 0, 2].tolist() == [0, -1] and st.topk_weights[0, 0, 2].tolist() == [1.0, 0.0]
    assert torch.all(out[0, 0, :2] == 0) and torch.isfinite(out).all()


def test_stats_output_is_differentiable():
    q, k, v = _qkv(1, 1, 1, 6, 6, 3, 3, seed=28, grad=True)
    out, _ = tiled_attention_with_stats(q, k, v, is_causal=True)
    out.sum().backward()
    ref_q = q.detach().clone().requires_grad_()
    sa.scaled_dot_product_attention(ref_q, k.detach(), v.detach(), is_causal=True).sum().backward()
    assert torch.allclose(q.grad, ref_q.grad, atol=1e-12)


# ---------------------------------------------------------------- block skipping, registry, errors


def test_block_skipping_work_is_proportional_to_visible_area():
    t, w = 4096, 128
    frac = computed_fraction(t, t, window=w, block_q=64, block_k=256)
    visible = (w * t - w * (w - 1) / 2) / t**2
    assert visible < frac <= visible + 64 / t + 1e-9  # the band plus at most one block edge per row
    causal = computed_fraction(t, t, is_causal=True, block_q=64, block_k=256)
    assert causal <= 0.5 + 64 / t
    ids = torch.repeat_interleave(torch.arange(8), t // 8)
    assert computed_fraction(t, t, document_ids=ids, block_q=64, block_k=256) == pytest.approx(1 / 8)


def test_registered_backend_matches_reference():
    q, k, v = _qkv(1, 2, 2, 33, 33, 8, 8, seed=29)
    mask = masks.padding_mask([30], max_len=33)
    out = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, backend="tiled")
    ref = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    assert torch.allclose(out, ref, atol=1e-12)


def test_bad_arguments_name_the_argument():
    q, k, v = _qkv(1, 1, 1, 4, 4, 2, 2)
    with pytest.raises(ValueError, match="block_q"):
        tiled_attention(q, k, v, block_q=0)
    with pytest.raises(TypeError, match="block_k"):
        tiled_attention(q, k, v, block_k=2.5)
    with pytest.raises(ValueError, match="window"):
        tiled_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="document ids"):
        tiled_attention(q, k, v, document_ids=torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        tiled_attention(q, k, v, document_ids=torch.zeros(4))
    with pytest.raises(ValueError, match="dropout_p"):
        tiled_attention(q, k, v, dropout_p=1.0)


# ---------------------------------------------------------------- review fixes (issue 4 follow-up)


def test_double_backward_goes_through_the_spec_and_is_exact():
    q, k, v = _qkv(1, 1, 1, 4, 5, 3, 3, seed=3, grad=True)
    ref = functools.partial(sa.scaled_dot_product_attention, is_causal=True)
    assert torch.autograd.gradgradcheck(ref, (q, k, v))  # the reference has true second derivatives
    tiled = functools.partial(tiled_attention, is_causal=True, block_q=3, block_k=2)
    assert torch.autograd.gradgradcheck(tiled, (q, k, v))
    # with a learned float mask too
    m = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    masked = functools.partial(tiled_attention, block_q=3, block_k=2)
    assert torch.autograd.gradgradcheck(lambda q, k, v, m: masked(q, k, v, attn_mask=m), (q, k, v, m))


def test_double_backward_with_dropout_is_a_clear_error():
    q, k, v = _qkv(1, 1, 1, 4, 5, 3, 3, seed=3, grad=True)
    out = tiled_attention(q, k, v, dropout_p=0.5, dropout_seed=1)
    with pytest.raises(RuntimeError, match="dropout"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


@pytest.mark.parametrize("how", ["mask_row", "causal_tq_gt_tk"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_query_of_blind_row_gets_zero_gradient(how, bad):
    tq = 6 if how == "mask_row" else 8
    q, k, v = _qkv(1, 2, 2, tq, 6, 4, 5, seed=40)
    q = q.clone()
    mask, causal = None, how == "causal_tq_gt_tk"
    if how == "mask_row":
        mask = torch.rand(tq, 6, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[2] = False
        q[..., 2, 1] = bad
    else:
        q[..., 0, 0] = bad  # Tq = 8 > Tk = 6, bottom-right causal: queries 0, 1 see nothing
    grads = []
    for fn in (tiled_attention, sa.scaled_dot_product_attention):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        kw = dict(block_q=3, block_k=4) if fn is tiled_attention else {}
        out = fn(qq, kk, vv, attn_mask=mask, is_causal=causal, **kw)
        assert torch.isfinite(out).all()
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        grads.append((qq.grad, kk.grad, vv.grad))
    for got, want in zip(*grads, strict=True):
        assert torch.isfinite(got).all()
        assert torch.allclose(got, want, atol=1e-10)


def _nan_key_case():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k[..., 0, :] = math.nan
    m = torch.ones(6, 6, dtype=torch.bool)
    m[0, 1:] = False  # query 0 sees only the NaN key 0
    m[1:, 0] = False  # the other queries do not see it
    return q, k, v, m


@pytest.mark.parametrize("blocks", [(256, 1024), (2, 3), (1, 1)])
def test_nan_key_seen_by_one_query_does_not_poison_other_gradients(blocks):
    q, k, v, m = _nan_key_case()
    res = []
    for fn in (tiled_attention, sa.scaled_dot_product_attention):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        kw = dict(block_q=blocks[0], block_k=blocks[1]) if fn is tiled_attention else {}
        out = fn(qq, kk, vv, attn_mask=m, **kw)
        out.sum().backward()
        res.append((out.detach(), qq.grad, kk.grad, vv.grad))
    (out, dq, dk, dv), (rout, rdq, rdk, rdv) = res
    assert torch.isnan(out[..., 0, :]).all() and torch.allclose(out[..., 1:, :], rout[..., 1:, :])
    # keys/values 1..5 and queries 1..5 take no part in the NaN row: finite and as the reference
    for got, want in ((dk, rdk), (dv, rdv), (dq, rdq)):
        assert torch.isfinite(got[..., 1:, :]).all()
        assert torch.allclose(got[..., 1:, :], want[..., 1:, :], atol=1e-10)
    # the visible NaN key and the NaN query row: NaN in, NaN out (not a made-up finite gradient)
    assert torch.isnan(dk[..., 0, :]).all() and torch.isnan(dq[..., 0, :]).all()


def test_hidden_nan_value_does_not_poison_gradients_of_quick_blocks():
    q, k, v = _qkv(1, 1, 1, 9, 9, 4, 3, seed=41)
    v = v.clone()
    v[..., 8, :] = math.nan  # last value: only the last query sees it (causal)
    grads = []
    for fn in (tiled_attention, sa.scaled_dot_product_attention):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        kw = dict(block_q=2, block_k=3) if fn is tiled_attention else {}
        fn(qq, kk, vv, is_causal=True, **kw)[..., :8, :].sum().backward()
        grads.append((qq.grad, kk.grad, vv.grad[..., :8, :]))
    for got, want in zip(*grads, strict=True):
        assert torch.isfinite(got).all()
        assert torch.allclose(got, want, atol=1e-10)


@pytest.mark.parametrize(
    "shape",
    [(6,), (1, 6), (5, 1), (2, 1, 1, 6), (3, 5, 6), (1, 3, 1, 6)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_any_mask_check_mask_accepts_works(shape):
    q, k, v = _qkv(2, 3, 3, 5, 6, 8, 4, seed=42)
    g = torch.Generator().manual_seed(len(shape))
    mask = torch.rand(shape, generator=g) > 0.3
    mask.view(-1)[0] = False  # hide something
    out = tiled_attention(q, k, v, attn_mask=mask, block_q=2, block_k=4)
    ref = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(out, ref, atol=1e-12)
    reg = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend="tiled")
    assert torch.allclose(reg, ref, atol=1e-12)


@pytest.mark.parametrize(
    "shape", [(5, 6), (3, 1, 6), (2, 3, 5, 6), (6,)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("is_causal", [False, True])
def test_float_mask_gets_a_gradient_like_reference(shape, is_causal):
    q, k, v = _qkv(2, 3, 3, 5, 6, 4, 3, seed=43)
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(shape, generator=g, dtype=torch.float64)
    bias.view(-1)[1] = -math.inf  # hide one key somewhere
    grads = []
    for fn in (tiled_attention, sa.scaled_dot_product_attention):
        b = bias.clone().requires_grad_()
        kw = dict(block_q=2, block_k=4) if fn is tiled_attention else {}
        out = fn(q, k, v, attn_mask=b, is_causal=is_causal, **kw)
        (out * torch.linspace(-1, 2, out.shape[-1], dtype=out.dtype)).sum().backward()
        grads.append(b.grad)
    assert grads[0] is not None and grads[0].shape == bias.shape
    assert torch.allclose(grads[0], grads[1], atol=1e-10)


def test_float_mask_gradcheck_gqa():
    q, k, v = _qkv(1, 4, 2, 5, 7, 3, 2, seed=44, grad=True)
    bias = torch.randn(1, 4, 1, 7, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, b):
        return tiled_attention(q, k, v, attn_mask=b, enable_gqa=True, is_causal=True, block_q=2, block_k=3)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


@pytest.mark.parametrize("block_q", [1, 2, 3, 4, 256])
def test_stats_of_blind_rows_do_not_depend_on_block_size(block_q):
    g = torch.Generator().manual_seed(45)
    q, k, v = (
        torch.randn(1, 1, 6, 4, generator=g),
        torch.randn(1, 1, 2, 4, generator=g),
        torch.randn(1, 1, 2, 3),
    )
    _, st = tiled_attention_with_stats(q, k, v, is_causal=True, top_k=3, block_q=block_q)
    # Tq = 6 > Tk = 2, bottom-right causal: queries 0..3 see nothing, query 4 one key, query 5 two
    assert torch.equal(st.topk_weights[0, 0, :4], torch.zeros(4, 3))
    assert torch.equal(st.topk_indices[0, 0, :4], torch.full((4, 3), -1))
    assert st.topk_indices[0, 0, 4].tolist() == [0, -1, -1] and st.topk_weights[0, 0, 4].tolist() == [
        1.0,
        0,
        0,
    ]
    assert (
        torch.allclose(st.topk_weights[0, 0, 5].sum(), torch.tensor(1.0))
        and st.topk_indices[0, 0, 5, 2] == -1
    )


@pytest.mark.parametrize("head_dim", [0, 3])
@pytest.mark.parametrize("block_q", [None, 1])
def test_nan_value_hidden_by_float_mask_inside_causal_block_does_not_leak(head_dim, block_q):
    # found by the fuzzer: a -inf of the float mask must hide the key also where the causal mask shows it
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 2, head_dim, generator=g)
    k = torch.randn(1, 1, 2, head_dim, generator=g)
    v = torch.randn(1, 1, 2, 2, generator=g)
    v[0, 0, 0] = float("nan")
    mask = torch.tensor([[0.0, 0.0], [float("-inf"), 0.0]])
    out = tiled_attention(q, k, v, attn_mask=mask, is_causal=True, block_q=block_q)
    assert torch.isnan(out[0, 0, 0]).all()  # query 0 sees only the NaN value
    assert torch.equal(out[0, 0, 1], v[0, 0, 1])  # query 1 sees key 1 alone


def test_plain_calls_reuse_their_plan_and_stay_exact():
    # The validation and plan of a plain call (4-D, no mask, no autograd) are cached by shapes, dtypes,
    # devices and options; each later call still runs on its own values, NaN checks included.
    from selfattention import tiled as tiled_mod

    tiled_mod._PLANS.clear()
    g = torch.Generator().manual_seed(0)
    for round_ in range(2):
        for causal in (False, True):
            for scale in (None, 0.3):
                q, k, v = (torch.randn(2, 3, 37, 8, generator=g) for _ in range(3))
                if round_ == 1 and causal:
                    v[1, 2, 30, 4] = float("nan")  # a cached signature must not skip the NaN semantics
                with torch.no_grad():
                    out = tiled_attention(q, k, v, is_causal=causal, scale=scale)
                want = sa.scaled_dot_product_attention(
                    q.double(), k.double(), v.double(), is_causal=causal, scale=scale
                )
                assert torch.equal(torch.isnan(out), torch.isnan(want))
                torch.testing.assert_close(out.nan_to_num().double(), want.nan_to_num(), atol=2e-6, rtol=2e-6)
    assert len(tiled_mod._PLANS) == 4  # one per (causal, scale); the second round reused them
    # a cached signature with autograd takes the checked path and has gradients
    q = torch.randn(2, 3, 37, 8, generator=g, requires_grad=True)
    tiled_attention(q, k.nan_to_num(), v.nan_to_num(), is_causal=True).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    # bad input on a cached signature still gets its error (2.0 == 2 in a dict key: floats are checked)
    with pytest.raises(ValueError, match="scale"):
        tiled_attention(q.detach(), k, v, scale=float("nan"))
    with torch.no_grad():
        tiled_attention(q, k, v, window=2, block_q=4)
        for bad in ({"window": 2.0, "block_q": 4}, {"window": 2, "block_q": 4.0}):
            with pytest.raises(TypeError, match="must be a positive int, got float"):
                tiled_attention(q, k, v, **bad)
