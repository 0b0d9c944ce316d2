"""The spec against independent oracles: float64 loops (tests/oracle.py), torch SDPA, the lectures."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as TF

import selfattention as sa
from selfattention import masks
from tests.oracle import attention_ref, visible_mask

LECTURE_X = [[0.43, 0.15, 0.89, 0.55], [0.55, 0.87, 0.66, 0.58], [0.57, 0.85, 0.64, 0.80]]


def test_simple_attention_matches_lecture_scores_to_their_decimals():
    x = torch.tensor(LECTURE_X, dtype=torch.float64)
    steps = sa.simple_attention_steps(x)
    # lecture 000 prints ω_2j ≈ 1.27, 1.83, 1.94 (two decimals)
    for printed, exact in zip([1.27, 1.83, 1.94], steps.scores[1].tolist(), strict=True):
        assert abs(printed - exact) <= 0.005 + 1e-12


def test_simple_attention_against_float64_loops():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 5, dtype=torch.float64)
    out_ref, w_ref = attention_ref(x, x, x, scale=1.0)
    assert torch.allclose(sa.simple_attention(x), out_ref, atol=1e-12, rtol=0)
    assert torch.allclose(sa.simple_attention_steps(x).weights, w_ref, atol=1e-12, rtol=0)


def test_lecture_003_hand_example():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    wq = wk = torch.eye(2, dtype=torch.float64)
    wv = 2 * torch.eye(2, dtype=torch.float64)
    steps = sa.attention_steps(x @ wq, x @ wk, x @ wv)
    assert steps.weights[0].tolist() == pytest.approx([0.670, 0.330], abs=5e-4)
    assert steps.weights[1].tolist() == pytest.approx([0.330, 0.670], abs=5e-4)
    assert steps.context[0].tolist() == pytest.approx([1.340, 0.660], abs=5e-4)
    assert steps.context[1].tolist() == pytest.approx([0.660, 1.340], abs=5e-4)
    # exact closed form: weight = e^{1/√2} / (e^{1/√2} + 1)
    w = math.exp(2**-0.5) / (math.exp(2**-0.5) + 1)
    assert steps.weights[0, 0].item() == pytest.approx(w, abs=1e-15)


@pytest.mark.parametrize("tq,tk", [(1, 1), (7, 7), (97, 97), (7, 12), (12, 7), (1, 97)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_torch_sdpa_no_mask(tq, tk, dtype):
    g = torch.Generator().manual_seed(tq * 1000 + tk)
    q = torch.randn(2, 3, tq, 59, generator=g, dtype=dtype)
    k = torch.randn(2, 3, tk, 59, generator=g, dtype=dtype)
    v = torch.randn(2, 3, tk, 31, generator=g, dtype=dtype)
    ours = sa.scaled_dot_product_attention(q, k, v)
    ref = TF.scaled_dot_product_attention(q, k, v)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert torch.allclose(ours, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("tq,tk", [(7, 7), (5, 9), (97, 97), (1, 7)])
def test_causal_equals_explicit_bottom_right_mask_in_torch(tq, tk):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, tq, 59, generator=g, dtype=torch.float64)
    k = torch.randn(2, tk, 59, generator=g, dtype=torch.float64)
    v = torch.randn(2, tk, 59, generator=g, dtype=torch.float64)
    explicit = visible_mask(tq, tk, is_causal=True)
    ours = sa.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = TF.scaled_dot_product_attention(q, k, v, attn_mask=explicit)
    assert torch.allclose(ours, ref, atol=1e-10)
    if tq != tk:  # torch's own is_causal is top-left: it must differ, or the alignment test means nothing
        assert not torch.allclose(ours, TF.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)


def test_bool_and_float_masks_that_hide_something():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 7, 59, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 11, 59, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 11, 59, generator=g, dtype=torch.float64)
    bool_mask = torch.rand(2, 1, 7, 11, generator=g) > 0.4
    bool_mask[..., 0] = True  # no fully masked row here (torch would give NaN)
    assert not bool_mask.all()
    ours = sa.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask)
    assert torch.allclose(ours, TF.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask), atol=1e-10)
    assert torch.allclose(ours, attention_ref(q, k, v, bool_mask)[0], atol=1e-10)
    float_mask = torch.randn(1, 3, 7, 11, generator=g, dtype=torch.float64)
    float_mask[..., 3] = -math.inf
    ours = sa.scaled_dot_product_attention(q, k, v, attn_mask=float_mask)
    assert torch.allclose(ours, TF.scaled_dot_product_attention(q, k, v, attn_mask=float_mask), atol=1e-10)
    assert torch.allclose(ours, attention_ref(q, k, v, float_mask)[0], atol=1e-10)


def test_fully_masked_row_gives_zero_output_and_zero_gradient():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(4, 6, generator=g) > 0.5
    mask[2] = False
    mask[0, 0] = True
    out = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all()
    assert torch.equal(out[2], torch.zeros(8, dtype=torch.float64))
    assert torch.allclose(out, attention_ref(q, k, v, mask)[0], atol=1e-12)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[2], torch.zeros(8, dtype=torch.float64))
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_masked_keys_holding_nan_and_inf_do_not_leak():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 5, 4, generator=g)
    k = torch.randn(3, 6, 4, generator=g)
    v = torch.randn(3, 6, 4, generator=g)
    mask = torch.ones(6, dtype=torch.bool)
    mask[[1, 4]] = False
    clean = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[:, 1] = float("nan")
    v2[:, 1] = float("inf")
    v2[:, 4] = float("nan")
    dirty = sa.scaled_dot_product_attention(q, k2, v2, attn_mask=mask)
    assert torch.equal(clean, dirty)
    # ... but NaN in a visible key is reported, not hidden
    k2[:, 0] = float("nan")
    assert torch.isnan(sa.scaled_dot_product_attention(q, k2, v2, attn_mask=mask)).all()


def test_scale_none_is_inverse_sqrt_d_and_zero_is_honoured():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(5, 16, generator=g, dtype=torch.float64) for _ in range(3))
    assert torch.allclose(sa.scaled_dot_product_attention(q, k, v), attention_ref(q, k, v, scale=0.25)[0])
    uniform = sa.scaled_dot_product_attention(q, k, v, scale=0.0)
    assert torch.allclose(uniform, v.mean(0).expand(5, 16), atol=1e-14)
    assert torch.allclose(sa.attention_weights(q, k, scale=3.0), attention_ref(q, k, v, scale=3.0)[1])


def test_dropout_only_in_training_and_rescales():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(64, 8, generator=g) for _ in range(3))
    base = sa.scaled_dot_product_attention(q, k, v)
    assert torch.equal(sa.scaled_dot_product_attention(q, k, v, dropout_p=0.5, training=False), base)
    torch.manual_seed(0)
    dropped = sa.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert not torch.allclose(dropped, base)
    # expectation is preserved: average over many draws approaches the undropped output
    torch.manual_seed(1)
    mean = torch.stack([sa.scaled_dot_product_attention(q, k, v, dropout_p=0.5) for _ in range(400)]).mean(0)
    assert (mean - base).abs().mean() < 0.05


def test_permutation_swaps_rows_and_changes_nothing_else():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, generator=g, dtype=torch.float64)
    layer = sa.SelfAttention(5, 4).double()
    perm = torch.tensor([0, 3, 2, 1, 4, 5])  # swap tokens 1 and 3
    out, out_p = layer(x), layer(x[perm])
    assert torch.allclose(out_p, out[perm], atol=1e-12)
    assert not torch.allclose(out[1], out[3])  # the rows really are different


def test_gqa_equals_repeated_heads():
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 6, 7, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64)
    ours = sa.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    rep = sa.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True
    )
    assert torch.allclose(ours, rep, atol=1e-12)
    ref = TF.scaled_dot_product_attention(q, k, v, enable_gqa=True, attn_mask=visible_mask(7, 9, True))
    assert torch.allclose(ours, ref, atol=1e-10)


def test_empty_sequences():
    q = torch.randn(2, 0, 4)
    k = torch.randn(2, 5, 4)
    assert sa.scaled_dot_product_attention(q, k, k).shape == (2, 0, 4)
    q = torch.randn(2, 3, 4)
    out = sa.scaled_dot_product_attention(q, torch.randn(2, 0, 4), torch.randn(2, 0, 6))
    assert out.shape == (2, 3, 6) and torch.equal(out, torch.zeros(2, 3, 6))


def test_float16_inputs_whose_products_overflow_stay_finite():
    q = torch.full((2, 64), 60.0, dtype=torch.float16)
    k = torch.full((3, 64), 60.0, dtype=torch.float16)  # q·k = 230400 > fp16 max 65504
    v = torch.randn(3, 64).half()
    out = sa.scaled_dot_product_attention(q, k, v)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.float(), v.float().mean(0).expand(2, 64), atol=2e-3)


def test_inputs_are_not_modified():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 5, 4, generator=g) for _ in range(3))
    k[0, 1] = float("nan")
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[:, 1] = False
    copies = [t.clone() for t in (q, k, v, mask)]
    sa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    for before, after in zip(copies, (q, k, v, mask), strict=True):
        assert torch.equal(before.nan_to_num(7.0), after.nan_to_num(7.0))


def test_masks_module_against_loops():
    for tq, tk in [(3, 3), (2, 5), (5, 2), (1, 1)]:
        assert torch.equal(masks.causal_mask(tq, tk), visible_mask(tq, tk, is_causal=True))
        for w in (1, 2, 4):
            assert torch.equal(masks.sliding_window_mask(tq, tk, w), visible_mask(tq, tk, window=w))


def test_nan_key_seen_by_one_query_does_not_poison_gradients_it_cannot_see():
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k[0] = float("nan")
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[0, 1:] = False  # query 0 sees only the NaN key 0
    mask[1:, 0] = False  # nobody else sees key 0
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isnan(out[0]).all() and torch.isfinite(out[1:]).all()
    out.sum().backward()
    assert torch.isfinite(k.grad[1:]).all() and torch.isfinite(v.grad[1:]).all()
    assert torch.isfinite(q.grad[1:]).all()


def test_scale_accepts_numpy_numbers_and_refuses_grad_tensors():
    import numpy as np

    q = torch.randn(3, 4, dtype=torch.float64)
    ref = sa.scaled_dot_product_attention(q, q, q, scale=0.5)
    assert torch.equal(sa.scaled_dot_product_attention(q, q, q, scale=np.float32(0.5)), ref)
    with pytest.raises(ValueError, match="requires grad"):
        sa.scaled_dot_product_attention(q, q, q, scale=torch.tensor(0.5, requires_grad=True))


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_float64_float_mask_with_float32_query(backend):
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 5, 8, generator=g) for _ in range(3))
    mask = torch.randn(5, 5, generator=g, dtype=torch.float64)
    mask[1, :3] = -math.inf
    ref = attention_ref(q, k, v, mask)[0].float()
    out = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    assert torch.allclose(out, ref, atol=1e-5)
    ref_causal = attention_ref(q, k, v, mask, is_causal=True)[0].float()
    out = sa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, backend=backend)
    assert torch.allclose(out, ref_causal, atol=1e-5)
