# More cases of PyTorch's test/test_transformers.py (https://github.com/pytorch/pytorch, BSD-3-Clause; the
# licence text is in tests/peer/test_torch_sdpa_peer.py), re-expressed for this library: the mask-shape
# sweep of test_scaled_dot_product_fused_attention_mask_vs_math_cpu, the 3-D inputs of
# test_scaled_dot_product_attention, TestAttnBias (causal_upper_left / causal_lower_right objects as
# attn_mask), test_sdp_math_gradcheck on packed non-contiguous q/k/v, the issue regressions it carries
# (#105190 negative scale, #127055 a band of -inf, test_flash_atteention_large_bf16_nan_values) and the
# failure modes of TestSDPAFailureModes that apply to a CPU library (1-D inputs, mixed dtypes). The code
# is written anew; the oracle is torch's SDPA math backend in float64, forward and gradients.
"""torch's SDPA tests, second part: every mask broadcast pattern, CausalBias, finfo.min rows, packing."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import selfattention as sa
from selfattention.tiled import describe, tiled_attention

from .test_torch_sdpa_peer import BACKENDS, _make, _qkv, compare, torch_math

pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")


def _leaves(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in ts]


def _check_grads(out, ref, ours, theirs, tol, seed=9):
    do = _make(out.shape, out.dtype, seed, grad=False)
    got = torch.autograd.grad(out, ours, do)
    want = torch.autograd.grad(ref, theirs, do)
    for i, (a, e) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, e, atol=tol, rtol=tol, msg=lambda m, i=i: f"grad of input {i}: {m}")


# ---------------------------------------------------------------------------------------------------------
# Every broadcast pattern of a mask (test_scaled_dot_product_fused_attention_mask_vs_math_cpu)
# ---------------------------------------------------------------------------------------------------------

B, H, TQ, TK = 2, 3, 7, 11
MASK_SHAPES = [
    *itertools.product([TQ, 1], [TK, 1]),
    *itertools.product([B, 1], [H, 1], [TQ, 1], [TK, 1]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bool", "float", "learned"])
def test_every_mask_broadcast_pattern_forward_and_backward(backend, kind):
    # 4 two-dim and 16 four-dim shapes: each dim either full or 1. Random bool masks hide whole rows now and
    # then (torch's math backend gives zeros there too); float masks hold -inf holes; "learned": the float
    # mask requires grad, and its gradient is dS summed over the broadcast dims.
    q, k, v = _qkv(B, H, TQ, TK, 8, dv=5)
    g = torch.Generator().manual_seed(11)
    for shape in MASK_SHAPES:
        keep = torch.rand(shape, generator=g) > 0.4
        if kind == "bool":
            compare(backend, q, k, v, {"attn_mask": keep})
            continue
        bias = torch.randn(shape, generator=g, dtype=torch.float64).masked_fill(~keep, -math.inf)
        if kind == "float":
            compare(backend, q, k, v, {"attn_mask": bias})
        else:
            bias = bias.clamp_min(-30.0).requires_grad_()  # finite: a learned bias
            compare(backend, q, k, v, {"attn_mask": None}, {"attn_mask": bias}, extra=(bias,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_dim", [None, 2, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_three_dim_inputs_with_two_and_three_dim_masks(backend, mask_dim, causal):
    # test_scaled_dot_product_attention: (N, L, E) inputs, masks (L, S) or (N, L, S); the causal case as
    # a tril bool mask (L == S: both alignments agree) and as is_causal=True
    n, t, e = 5, 4, 6
    q, k, v = (_make((n, t, e), seed=i) for i in range(3))
    mask = None
    if mask_dim is not None:
        shape = (t, t) if mask_dim == 2 else (n, t, t)
        g = torch.Generator().manual_seed(mask_dim)
        mask = torch.ones(shape, dtype=torch.bool).tril() if causal else torch.rand(shape, generator=g) > 0.5
    compare(backend, q, k, v, {"attn_mask": mask})
    if causal and mask_dim is None:
        compare(backend, q, k, v, {"is_causal": True})


@pytest.mark.parametrize("backend", BACKENDS)
def test_five_dim_inputs_with_a_key_only_float_mask_that_learns(backend):
    # pytorch/pytorch#120810: the mask need only broadcast, (1, 1, S) against (N, 2, 4, L, S) scores;
    # here a float one whose gradient must be summed over all the broadcast dims
    q = _make((3, 2, 4, 7, 16), seed=0)
    k, v = _make((3, 2, 4, 5, 16), seed=1), _make((3, 2, 4, 5, 32), seed=2)
    bias = _make((1, 1, 5), seed=3)
    compare(backend, q, k, v, {"attn_mask": None}, {"attn_mask": bias}, extra=(bias,))


# ---------------------------------------------------------------------------------------------------------
# torch's CausalBias objects as attn_mask (TestAttnBias)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
@pytest.mark.parametrize(("tq", "tk"), [(8, 8), (8, 16), (16, 8), (1, 23), (23, 1)], ids=str)
def test_causal_bias_objects_are_honoured(backend, variant, tq, tk):
    # test_causal_variants: a CausalBias passed as attn_mask equals its materialised bool mask. (A
    # CausalBias is a tensor subclass with no mask in its storage: read as a dense mask it was silently
    # wrong.) Lower-right with Tq > Tk hides every key of the first rows: zeros there (torch: NaN, and
    # test_causal_variants skips it), the math backend's result elsewhere.
    bias = (causal_upper_left if variant == "upper_left" else causal_lower_right)(tq, tk)
    q, k, v = _qkv(2, 2, tq, tk, 8)
    dense = bias._materialize()
    out = compare(backend, q, k, v, {"attn_mask": dense}, {"attn_mask": bias})
    if not dense.all():
        assert not torch.allclose(out, torch_math(q, k, v))  # the bias hid something


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_causal_is_lower_right_and_causal_bias_with_is_causal_raises(backend):
    # test_is_causal_equals_upper_left: OUR is_causal is the lower-right variant (documented); and
    # test_is_causal_and_mask_fails: a CausalBias together with is_causal=True is a ValueError
    q, k, v = _qkv(1, 2, 5, 9, 8)
    ours = sa.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    lower = sa.scaled_dot_product_attention(q, k, v, causal_lower_right(5, 9), backend=backend)
    upper = sa.scaled_dot_product_attention(q, k, v, causal_upper_left(5, 9), backend=backend)
    torch.testing.assert_close(ours, lower, atol=1e-12, rtol=0)
    assert not torch.allclose(ours, upper)
    with pytest.raises(ValueError, match="CausalBias.*is_causal"):
        sa.scaled_dot_product_attention(q, k, v, causal_upper_left(5, 9), is_causal=True, backend=backend)
    with pytest.raises(ValueError, match="seq_len_q=4.*query has length 5"):
        sa.scaled_dot_product_attention(q, k, v, causal_lower_right(4, 9), backend=backend)


def test_causal_bias_with_tiled_window_and_documents_keeps_the_causal_part():
    # the tiled path's extras combine with a CausalBias (AND), as they do with is_causal
    q, k, v = _qkv(1, 1, 12, 12, 8)
    docs = torch.tensor([0] * 5 + [1] * 7)
    for kw in ({"window": 3}, {"document_ids": docs}):
        out = tiled_attention(q, k, v, causal_upper_left(12, 12), **kw)
        want = tiled_attention(q, k, v, is_causal=True, **kw)
        torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# Rows of a float mask far from 0 (transformers' finfo.min): the gradients too
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("far", ["finfo.min", "-1e30", "+1e30"])
def test_rows_of_a_far_finite_mask_get_the_gradients_of_their_forward(backend, dtype, far):
    # pytorch/pytorch#109517 and #103749 (finfo.min as "masked"): a query row whose visible mask entries are
    # all about -3.4e38 is a uniform average in torch's math backend (the scores vanish in the rounding),
    # and so was ours; but the fused kernels' backward recomputes the weights as exp(s - lse) and lse
    # = M + log Tk rounds back to M: every weight 1 instead of 1/Tk (dq off by 3 here, torch's own fused
    # CPU kernel included). Also two keys tied at +1e30, and a row of -1e30 next to 0 (a plain hole).
    value = {"finfo.min": torch.finfo(dtype).min, "-1e30": -1e30, "+1e30": 1e30}[far]
    q, k, v = _qkv(2, 2, 5, 7, 6, dtype=dtype)
    mask = torch.zeros(5, 7, dtype=dtype)
    if far == "+1e30":
        mask[1, [2, 5]] = value
    else:
        mask[1] = value
    mask[3, :4] = -1e30
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    ours, theirs = _leaves(q, k, v), _leaves(q, k, v)
    out = sa.scaled_dot_product_attention(*ours, mask, backend=backend)
    ref = torch_math(*theirs, attn_mask=mask)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    _check_grads(out, ref, ours, theirs, tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_learned_bias_with_a_finfo_min_row_gets_its_gradient(backend):
    q, k, v = _qkv(1, 2, 4, 6, 8)
    bias = torch.randn(1, 2, 4, 6, dtype=torch.float64)
    bias[0, 1, 2] = torch.finfo(torch.float64).min
    bias.requires_grad_()
    compare(backend, q, k, v, {"attn_mask": None}, {"attn_mask": bias}, extra=(bias,))


def test_far_mask_rows_leave_the_fused_kernels_and_say_so():
    q, k, v = _qkv(1, 1, 4, 6, 8)
    mask = torch.zeros(4, 6, dtype=torch.float64)
    mask[0] = -1e30
    assert describe(q, k, v, mask).kernel == "spec"
    assert describe(q.detach(), k.detach(), v.detach(), mask).kernel != "spec"  # no gradient: the kernel
    with pytest.raises(ValueError, match="kernel='vendor'"):
        tiled_attention(q, k, v, mask, kernel="vendor")


# ---------------------------------------------------------------------------------------------------------
# Issue regressions carried by test_transformers.py
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_105190_large_negative_scale(backend):
    # test_scaled_dot_product_attention_math_with_negative_scale: scale = -1/1e-4
    x = _make((1, 3, 16, 16), seed=0)
    want = torch.softmax((x @ x.transpose(-1, -2)) / -1e-4, dim=-1) @ x
    out = sa.scaled_dot_product_attention(x, x, x, scale=-1.0 / 1e-4, backend=backend)
    torch.testing.assert_close(out, want, atol=1e-9, rtol=1e-9)
    compare(backend, *_qkv(1, 2, 6, 6, 8), {"scale": -2.0, "is_causal": True})


@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_127055_band_of_neg_inf(backend):
    # test_scaled_dot_product_fused_attention_with_inf: a float mask of -inf outside a band of 10
    # diagonals (600 tokens there; 70 and 200 here, the second more than one query block of the tiled path)
    for t in (70, 200):
        full = torch.full((t, t), -math.inf, dtype=torch.float64)
        band = torch.triu(full, diagonal=1) + torch.tril(full, diagonal=-10)
        compare(backend, *_qkv(1, 2, t, t, 8), {"attn_mask": band})


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_bfloat16_values_give_no_nan(backend):
    # test_flash_atteention_large_bf16_nan_values: q = k = v = 133120 in bfloat16 (scores ~1.4e11)
    x = torch.full((1, 1, 3, 64), 133120.0, dtype=torch.bfloat16)
    out = sa.scaled_dot_product_attention(x, x, x, backend=backend)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, x)  # equal scores: the mean of equal values


# ---------------------------------------------------------------------------------------------------------
# Layouts: packed non-contiguous inputs, expanded (stride-0) inputs and masks
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("contiguous", [False, True])
def test_packed_qkv_gradcheck(backend, contiguous):
    # test_sdp_math_gradcheck: q, k, v cut from one packed (B, T, 3·H·D) tensor, viewed and transposed
    b, t, h, d = 2, 4, 2, 3
    qkv = _make((b, t, 3 * h * d))
    parts = [p.view(b, t, h, d).transpose(1, 2) for p in qkv.chunk(3, dim=-1)]
    if contiguous:
        parts = [p.contiguous() for p in parts]

    def f(q, k, v):
        return sa.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)

    assert torch.autograd.gradcheck(f, tuple(parts))


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_inputs_and_masks(backend):
    # stride-0 keys/values (one key set shared by the batch) and an expanded key-padding mask: the gradient
    # of the un-expanded leaf is the sum over the batch, as torch's
    q = _make((3, 2, 5, 4), seed=0)
    k1, v1 = _make((1, 2, 6, 4), seed=1), _make((1, 1, 6, 4), seed=2)
    keep = (torch.rand(1, 6, generator=torch.Generator().manual_seed(0)) > 0.3).expand(5, 6)
    ours, theirs = _leaves(q, k1, v1), _leaves(q, k1, v1)

    def run(fn, lv):
        return fn(lv[0], lv[1].expand(3, 2, 6, 4), lv[2].expand(3, 2, 6, 4), keep)

    out = run(lambda *a: sa.scaled_dot_product_attention(*a, backend=backend), ours)
    ref = run(lambda q, k, v, m: torch_math(q, k, v, attn_mask=m), theirs)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    _check_grads(out, ref, ours, theirs, 1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_with_broadcast_batch_three_dims_and_a_per_query_head_mask(backend):
    # enable_gqa with key/value batch 1, with (H, T, D) inputs, and with a learned (B, Hq, L, S) bias; a
    # mask with the key/value head count (not broadcastable to Hq) is refused (pytorch/pytorch#177482:
    # the mask is (N, Hq, L, S))
    compare(backend, _make((2, 4, 5, 4)), _make((1, 2, 6, 4), seed=1), _make((1, 2, 6, 4), seed=2),
            {"enable_gqa": True})  # fmt: skip
    compare(
        backend, _make((4, 5, 4)), _make((2, 6, 4), seed=1), _make((2, 6, 4), seed=2), {"enable_gqa": True}
    )
    q, k, v = _qkv(2, 4, 5, 6, 4, hkv=2)
    bias = _make((2, 4, 5, 6), seed=5)
    compare(backend, q, k, v, {"enable_gqa": True}, {"enable_gqa": True, "attn_mask": bias}, extra=(bias,))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(2, 2, 5, 6\)"):
        sa.scaled_dot_product_attention(q, k, v, torch.ones(2, 2, 5, 6, dtype=torch.bool), enable_gqa=True,
                                         backend=backend)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_and_head_dims_broadcast_without_gqa(backend):
    # torch's math backend broadcasts the batch dims of q against k/v like matmul: one key/value head for
    # every query head (multi-query by broadcasting, no enable_gqa), one key/value batch for every sample
    compare(backend, _make((2, 3, 5, 4)), _make((2, 1, 6, 4), seed=1), _make((2, 1, 6, 4), seed=2), {})
    compare(backend, _make((2, 3, 5, 4)), _make((1, 3, 6, 4), seed=1), _make((1, 3, 6, 4), seed=2), {})
    compare(backend, _make((1, 3, 5, 4)), _make((2, 1, 6, 4), seed=1), _make((2, 1, 6, 4), seed=2), {})


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_mask_alone_requires_grad(backend):
    # pytorch/pytorch#148476 (PR #188302): a float mask as the only input with requires_grad crashed a
    # fused backward; ours gives its gradient, q/k/v get none
    q, k, v = (t.detach() for t in _qkv(2, 2, 5, 7, 6))
    bias = _make((1, 2, 5, 7), seed=4)
    ref_bias = bias.detach().clone().requires_grad_()
    out = sa.scaled_dot_product_attention(q, k, v, bias, backend=backend)
    ref = torch_math(q, k, v, attn_mask=ref_bias)
    (g,), (e,) = torch.autograd.grad(out.sum(), bias), torch.autograd.grad(ref.sum(), ref_bias)
    torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_sizes_have_torch_shapes_and_zero_gradients(backend):
    cases = [((0, 2, 3, 4), (0, 2, 5, 4), 4), ((2, 0, 3, 4), (2, 0, 5, 4), 4), ((2, 2, 0, 4), (2, 2, 5, 4), 4),
             ((2, 2, 3, 4), (2, 2, 5, 4), 0), ((2, 2, 3, 4), (2, 2, 0, 4), 4)]  # fmt: skip
    for qs, ks, dv in cases:
        q, k, v = _make(qs), _make(ks, seed=1), _make((*ks[:-1], dv), seed=2)
        out = sa.scaled_dot_product_attention(q, k, v, backend=backend)
        assert out.shape == F.scaled_dot_product_attention(q, k, v).shape
        assert not out.any()  # empty, or Tk = 0: zeros (torch: NaN)
        grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
        for t, gr in zip((q, k, v), grads, strict=True):
            assert gr is not None and gr.shape == t.shape and not gr.any()


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("input_dim", [3, 4])
@pytest.mark.parametrize("dropout_p", [0.2, 0.5])
def test_dropout_draws_what_torch_draws_under_the_same_seed(backend, input_dim, dropout_p):
    # test_scaled_dot_product_attention: under freeze_rng_state, SDPA with dropout equals the Python
    # reference softmax → F.dropout → @ v (the same weights dropped). The tiled backend draws its masks
    # per tile (docs: dropout replayed block by block), so it is not in this list.
    shape = (5, 4, 6) if input_dim == 3 else (5, 2, 4, 6)
    q, k, v = (_make(shape, dtype=torch.float32, seed=i, grad=False) for i in range(3))
    keep = torch.rand(4, 4, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[:, 0] = True
    with torch.random.fork_rng():
        torch.manual_seed(0)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(6)).masked_fill(~keep, -math.inf)
        want = F.dropout(torch.softmax(scores, dim=-1), p=dropout_p) @ v
        torch.manual_seed(0)
        out = sa.scaled_dot_product_attention(q, k, v, keep, dropout_p=dropout_p, backend=backend)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Failure modes (TestSDPAFailureModes) and precision
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_failure_modes_on_cpu(backend):
    # test_invalid_inputs_1_dimensional_inputs, test_invalid_inputs_different_datatypes (float32 query,
    # float16 key/value): clear errors naming the argument
    with pytest.raises(ValueError, match="query must have at least 2 dims"):
        sa.scaled_dot_product_attention(torch.randn(4), torch.randn(1, 4), torch.randn(1, 4), backend=backend)
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(TypeError, match="query torch.float32, key torch.float16"):
        sa.scaled_dot_product_attention(q, q.half(), q.half(), backend=backend)
    with pytest.raises(TypeError, match="value torch.float64"):
        sa.scaled_dot_product_attention(q, q, q.double(), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failure_modes_are_also_the_runtime_errors_torch_raises(backend):
    # TestSDPAFailureModes asserts RuntimeError (torch's type for these inputs); ours are TypeError/
    # ValueError naming the argument, and RuntimeError too, so such tests run on ours unchanged
    q = torch.randn(1, 4, 8, 16)
    bad = [
        ((torch.randn(4), torch.randn(1, 4), torch.randn(1, 4)), {}),  # 1-D query
        ((q, q.half(), q.half()), {}),  # float32 query, float16 key/value
        ((q, q.to("meta"), q), {}),  # devices
        ((q, torch.randn(1, 4, 8, 12), torch.randn(1, 4, 8, 12)), {}),  # head_dim
        ((q, q, q), {"attn_mask": torch.ones(8, 9, dtype=torch.bool)}),  # mask shape
        ((q, q, q), {"attn_mask": torch.ones(8, 8, dtype=torch.int32)}),  # mask dtype
        ((q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16)), {"enable_gqa": True}),  # 4 % 3 heads
    ]
    for args, kw in bad:
        with pytest.raises(RuntimeError) as info:
            sa.scaled_dot_product_attention(*args, backend=backend, **kw)
        assert isinstance(info.value, TypeError | ValueError), info.value


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_forward_and_backward_within_twice_the_naive_error(backend):
    # the fp16 line of test_scaled_dot_product_fused_attention_mask_vs_math_cpu, with PyTorch's criterion
    # (error vs the float64 golden within a fudge factor of the same-precision math error)
    q, k, v = (t.detach().half() for t in _qkv(2, 2, 33, 41, 40))
    mask = torch.rand(33, 41, generator=torch.Generator().manual_seed(6)) > 0.2
    ours, naive, gold = _leaves(q, k, v), _leaves(q, k, v), _leaves(q.double(), k.double(), v.double())
    outs = [
        sa.scaled_dot_product_attention(*ours, mask, backend=backend),
        torch_math(*naive, attn_mask=mask),
        torch_math(*gold, attn_mask=mask),
    ]
    assert outs[0].dtype == torch.float16
    assert (outs[0].double() - outs[2]).abs().max() <= 2 * (outs[1].double() - outs[2]).abs().max() + 1e-4
    do = _make(outs[0].shape, seed=9, grad=False)
    g = [torch.autograd.grad(o, lv, do.to(o.dtype)) for o, lv in zip(outs, (ours, naive, gold), strict=True)]
    for a, n, e in zip(*g, strict=True):
        assert (a.double() - e).abs().max() <= 2 * (n.double() - e).abs().max() + 1e-4
