"""Public bug reports of SDPA implementations (torch's fused kernels, flash-attn, ports to other
devices), turned into regression tests of ours: layouts (non-contiguous, stride-0, last-dim strides),
lengths just past a tile, and the fully-masked-row class in the nn modules.

Each test names the report it comes from; the facts were read there, the code is ours. The oracle is
torch's SDPA math backend in float64 (or torch.nn.MultiheadAttention with copied weights).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import selfattention as sa
from selfattention.mha import MultiHeadAttention

from .test_torch_sdpa_peer import BACKENDS, _make, compare, torch_math

MODULE_BACKENDS = [None, "torch", "tiled"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_112577_value_as_a_transposed_view_of_b_l_hd(backend):
    # pytorch/pytorch#112577, ROCm/pytorch#3230, flagos-ai/FlagGems#5896: v = x.view(B, L, H, D).transpose(1, 2)
    # (a non-contiguous view) gave garbage on fused kernels that assumed a contiguous (B, H, L, D)
    b, length, h, d = 2, 62, 4, 16
    x = _make((b, length, h * d), seed=3, grad=False)
    v = x.view(b, length, h, d).transpose(1, 2).requires_grad_()
    q, k = _make((b, h, length, d)), _make((b, h, length, d), seed=1)
    compare(backend, q, k, v, {"is_causal": True})


@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_187506_last_dim_not_contiguous(backend):
    # pytorch/pytorch#187506: CPU flash SDPA was wrong when the innermost dim of q/k/v had a stride ≠ 1
    wide = [_make((2, 3, 9, 16), seed=i, grad=False) for i in range(3)]
    q, k, v = (w[..., ::2].requires_grad_() for w in wide)  # (2, 3, 9, 8), stride(-1) == 2
    assert q.stride(-1) == 2
    keep = torch.rand(9, 9, generator=torch.Generator().manual_seed(0)) > 0.3
    compare(backend, q, k, v, {"attn_mask": keep})


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_355_non_contiguous_output_gradient(backend):
    # Dao-AILab/flash-attention#355: the backward was wrong for a non-contiguous dout
    q, k, v = _make((2, 4, 5, 8)), _make((2, 4, 7, 8), seed=1), _make((2, 4, 7, 8), seed=2)
    out = sa.scaled_dot_product_attention(q, k, v, backend=backend)
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = torch_math(*ref_in)
    dout = _make((2, 5, 4, 8), seed=9, grad=False).transpose(1, 2)  # (2, 4, 5, 8), not contiguous
    assert not dout.is_contiguous()
    for a, e in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, ref_in, dout),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tk", [33, 65])
def test_pytorch_191937_stride_zero_gqa_kv_with_kv_length_one_past_a_tile(backend, tk):
    # pytorch/pytorch#191937: broadcast (stride-0) k/v, GQA, a 4-D bool mask and kv length ≡ 1 mod 32 in
    # bfloat16 gave errors of ~20 on one fused kernel. Ours: within twice the naive bfloat16 error of the
    # float64 golden, and equal to the same call on contiguous copies.
    q = _make((1, 8, 5, 32), dtype=torch.bfloat16, grad=False)
    k = _make((1, 1, tk, 32), seed=1, dtype=torch.bfloat16, grad=False).expand(1, 2, tk, 32)
    v = _make((1, 1, tk, 32), seed=2, dtype=torch.bfloat16, grad=False).expand(1, 2, tk, 32)
    assert k.stride(1) == 0 and v.stride(1) == 0
    keep = torch.rand(1, 1, 5, tk, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[..., -1] = True
    out = sa.scaled_dot_product_attention(q, k, v, keep, enable_gqa=True, backend=backend)
    same = sa.scaled_dot_product_attention(q, k.contiguous(), v.contiguous(), keep, enable_gqa=True,
                                           backend=backend)  # fmt: skip
    torch.testing.assert_close(out, same, atol=0, rtol=0)
    gold = torch_math(q.double(), k.double(), v.double(), attn_mask=keep, enable_gqa=True)
    naive = torch_math(q, k, v, attn_mask=keep, enable_gqa=True)
    assert (out.double() - gold).abs().max() <= 2 * (naive.double() - gold).abs().max() + 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_162588_float_mask_at_a_length_past_1024(backend):
    # pytorch/pytorch#162588 (wrong results with attn_mask at long lengths) and test_transformers.py's
    # seq_len 1030: a float mask with -inf holes over 1030 queries × 1030 keys, float32 vs float64 math
    t = 1030
    q, k, v = (_make((1, 1, t, 16), seed=i, dtype=torch.float32, grad=False) for i in range(3))
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(t, t, generator=g).masked_fill(torch.rand(t, t, generator=g) > 0.7, float("-inf"))
    out = sa.scaled_dot_product_attention(q, k, v, bias, backend=backend)
    gold = torch_math(q.double(), k.double(), v.double(), attn_mask=bias.double())
    torch.testing.assert_close(out.double(), gold, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("tq", "tk"), [(4, 4), (3, 7)])
def test_onnx_8068_is_causal_and_a_mask_that_together_hide_whole_rows(backend, tq, tk):
    # onnx/onnx#8068 (and pytorch/pytorch#144858 for the alignment): is_causal composed with an attn_mask
    # gave NaN where the two together hide every key of a query. Ours: bottom-right causal AND the mask,
    # zeros and zero gradient for those queries, torch's math elsewhere (given the combined mask).
    q, k, v = _make((1, 2, tq, 8)), _make((1, 2, tk, 8), seed=1), _make((1, 2, tk, 8), seed=2)
    causal = torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=tk - tq)
    keep = torch.ones(tq, tk, dtype=torch.bool)
    keep[:, : tk - tq + 1] = False  # query 0 (bottom-right: keys 0 .. tk - tq) sees nothing
    both = causal & keep
    assert not both[0].any() and both[1:].any(-1).all()
    compare(backend, q, k, v, {"attn_mask": both}, {"attn_mask": keep, "is_causal": True})
    out = sa.scaled_dot_product_attention(q, k, v, keep, is_causal=True, backend=backend)
    assert out[:, :, 0].abs().sum() == 0
    (gq,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(gq).all() and gq[:, :, 0].abs().sum() == 0


# ---------------------------------------------------------------------------------------------------------
# nn modules: the fully-masked-row class (pytorch/pytorch#41508, #160064)
# ---------------------------------------------------------------------------------------------------------


def _mha(h: int = 3, e: int = 12, seed: int = 0) -> MultiHeadAttention:
    torch.manual_seed(seed)
    m = MultiHeadAttention(e, h).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("backend", MODULE_BACKENDS)
@pytest.mark.parametrize("need_weights", [False, True])
def test_pytorch_41508_mha_fully_masked_rows_do_not_poison_the_gradients(backend, need_weights):
    # pytorch/pytorch#41508 (PR #196170): with a band attn_mask and a padded key, one query sees nothing;
    # torch MHA's need_weights path made every projection gradient NaN. Ours: that row's context is zero
    # (its output is out_proj.bias), every gradient is finite, and the projections' gradients equal those
    # of the loss without that row (the row depends on out_proj.bias alone).
    mha = _mha()
    mha.backend = backend
    x = torch.randn(2, 4, 12, dtype=torch.float64)
    band = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    pad = torch.tensor([[True, True, True, True], [True, True, False, False]])  # True = real token
    out, w = mha(x, attn_mask=band, key_padding_mask=pad, need_weights=need_weights)
    torch.testing.assert_close(out[1, 3], mha.out_proj.bias.detach())  # batch 1, query 3 sees nothing
    if need_weights:
        assert torch.isfinite(w).all() and w[1, :, 3].abs().sum() == 0
    params = [mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight, mha.out_proj.weight]
    full = torch.autograd.grad(out.sum(), params, retain_graph=True)
    keep = torch.ones(2, 4, 1, dtype=torch.float64)
    keep[1, 3] = 0
    without = torch.autograd.grad((out * keep).sum(), params[:3])
    assert all(torch.isfinite(g).all() for g in full)
    for a, e in zip(full[:3], without, strict=True):
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", MODULE_BACKENDS)
def test_pytorch_160064_mha_head_masked_whole_with_need_weights(backend):
    # pytorch/pytorch#160064: masking one head entirely (a per-head mask) returned NaN with need_weights=True
    # and numbers without. Ours: the same output both ways, zero weights for that head, and the other heads
    # as torch MHA computes them.
    mha = _mha()
    mha.backend = backend
    x = torch.randn(1, 5, 12, dtype=torch.float64)
    keep = torch.tensor([True, True, False]).view(1, 3, 1, 1).expand(1, 3, 5, 5)
    out_w, w = mha(x, attn_mask=keep, need_weights=True)
    out, _ = mha(x, attn_mask=keep)
    torch.testing.assert_close(out_w, out, atol=1e-12, rtol=1e-12)
    assert torch.isfinite(w).all() and w[:, 2].abs().sum() == 0
    torch.testing.assert_close(w[:, :2].sum(-1), torch.ones(1, 2, 5, dtype=w.dtype))
    # the context of heads 0 and 1 from torch's math, head 2 zeros
    q = mha.q_proj(x).view(1, 5, 3, 4).transpose(1, 2)
    k = mha.k_proj(x).view(1, 5, 3, 4).transpose(1, 2)
    v = mha.v_proj(x).view(1, 5, 3, 4).transpose(1, 2)
    ctx = torch_math(q, k, v)
    ctx[:, 2] = 0
    want = mha.out_proj(ctx.transpose(1, 2).reshape(1, 5, 12))
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "tiled"])
def test_mha_finfo_min_padding_rows_train_like_torch_math(backend):
    # transformers-style float padding (finfo.min, pytorch/pytorch#109517) in a module that trains: the
    # gradients of the projections equal those of the same module with the reference path
    x = torch.randn(2, 6, 12, dtype=torch.float64)
    pad = torch.zeros(2, 6, dtype=torch.float64)
    pad[1, :] = torch.finfo(torch.float64).min  # batch 1: every key "padding" (each of its rows)
    pad[0, 4:] = torch.finfo(torch.float64).min
    grads = []
    for b in (None, backend):
        mha = _mha(seed=1)
        mha.backend = b
        out, _ = mha(x, key_padding_mask=pad)
        grads.append(torch.autograd.grad(out.square().sum(), list(mha.parameters())))
    for a, e in zip(*grads, strict=True):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", MODULE_BACKENDS)
def test_mha_takes_torch_causal_bias_objects(backend):
    # TestAttnBias's CausalBias in the module: self-attention with causal_lower_right is our is_causal;
    # cross-attention with causal_upper_left equals its materialised mask; with is_causal=True: ValueError
    mha = _mha()
    mha.backend = backend
    x, mem = torch.randn(2, 6, 12, dtype=torch.float64), torch.randn(2, 9, 12, dtype=torch.float64)
    torch.testing.assert_close(mha(x, attn_mask=causal_lower_right(6, 6))[0], mha(x, is_causal=True)[0])
    want = mha(x, mem, attn_mask=causal_upper_left(6, 9)._materialize())[0]
    torch.testing.assert_close(mha(x, mem, attn_mask=causal_upper_left(6, 9))[0], want)
    torch.testing.assert_close(mha(x, mem, attn_mask=causal_upper_left(6, 9), need_weights=True)[0], want)
    with pytest.raises(ValueError, match="CausalBias"):
        mha(x, attn_mask=causal_lower_right(6, 6), is_causal=True)
