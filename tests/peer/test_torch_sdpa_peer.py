# Adapted from PyTorch's test/test_transformers.py (https://github.com/pytorch/pytorch): the ideas of its
# SDPA tests (math-reference comparisons, mask / is_causal combinations, enable_gqa, scale, dropout,
# errors on bad inputs); the code is written anew for this library.
#
# PyTorch is distributed under the BSD-3-Clause licence:
#   Copyright (c) 2016-     Facebook, Inc (Adam Paszke) and the PyTorch contributors. All rights reserved.
#   Redistribution and use in source and binary forms, with or without modification, are permitted
#   provided that the following conditions are met: (1) redistributions of source code must retain the
#   above copyright notice, this list of conditions and the following disclaimer; (2) redistributions in
#   binary form must reproduce the above copyright notice, this list of conditions and the following
#   disclaimer in the documentation and/or other materials provided with the distribution; (3) neither the
#   names of Facebook, Deepmind Technologies, NYU, NEC Laboratories America and IDIAP Research Institute
#   nor the names of its contributors may be used to endorse or promote products derived from this
#   software without specific prior written permission. THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT
#   HOLDERS AND CONTRIBUTORS "AS IS" AND ANY EXPRESS OR IMPLIED WARRANTIES ARE DISCLAIMED.
"""PyTorch's SDPA tests against ``selfattention.scaled_dot_product_attention`` on every backend.

The oracle is torch's own SDPA *math* backend in float64 (``sdpa_kernel(SDPBackend.MATH)``), forward and
gradients; bottom-right causal masks come from torch's ``causal_lower_right``.

Where our documented semantics differ from torch's on purpose (docs/api.md "What bottom-right causal
means", docs/edge-cases.md), the test encodes ours and says so:
* ``is_causal=True`` with Tq ≠ Tk is bottom-right (torch: top-left) — compared with torch's
  ``causal_lower_right`` bias instead;
* a query that sees no key gets zeros (torch 2.13's math backend too, via _safe_softmax; its fused CPU
  kernel and older versions: NaN; Tk = 0: torch NaN);
* ``attn_mask`` and ``is_causal=True`` together are ANDed (functional.py docstring); torch raises;
* ``dropout_p`` must be in [0, 1) (docs/edge-cases.md; torch accepts 1.0 and returns zeros), and applies
  only when ``training=True`` (the default, so torch-style calls drop out as torch does).

Left out of test_transformers.py: the fused CUDA kernels (flash, memory-efficient, cuDNN) and their
dispatch rules (``sdpa_kernel`` backend selection, ``can_use_flash_attention`` warnings, alignment and
head_dim limits), fp16/bf16 on CUDA, nested tensors, ``torch.compile``/export tests (tests/test_compile.py
covers ours), the ``nn.Transformer*`` module tests, and the dropout tests that read the CUDA kernels' RNG
mask (``_fill_mem_eff_dropout_mask_``): dropout is checked here statistically and by reproducibility.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import selfattention as sa

BACKENDS = ["reference", "torch", "tiled"]


def torch_math(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )


def _make(shape, dtype=torch.float64, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return t.requires_grad_(grad)


def _qkv(b, h, tq, tk, d, dv=None, hkv=None, dtype=torch.float64):
    hkv = hkv or h
    return (
        _make((b, h, tq, d), dtype, 0),
        _make((b, hkv, tk, d), dtype, 1),
        _make((b, hkv, tk, dv or d), dtype, 2),
    )


def compare(backend, q, k, v, ref_kwargs, our_kwargs=None, extra=(), tol=1e-10):
    """Ours (backend) vs torch math in float64: output and the gradients of q, k, v (and ``extra``)."""
    our_kwargs = ref_kwargs if our_kwargs is None else our_kwargs
    out = sa.scaled_dot_product_attention(q, k, v, backend=backend, **our_kwargs)
    leaves = (q, k, v, *extra)
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    rk = dict(ref_kwargs)
    if extra:
        rk["attn_mask"] = ref_leaves[3]
    ref = torch_math(*ref_leaves[:3], **rk)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    do = _make(out.shape, out.dtype, 9, grad=False)
    g = torch.autograd.grad(out, leaves, do)
    gr = torch.autograd.grad(ref, ref_leaves, do)
    for name, a, e in zip(("dq", "dk", "dv", "dmask"), g, gr, strict=False):
        torch.testing.assert_close(a, e, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
    return out


SHAPES = [  # (B, H, Tq, Tk, D, Dv): PyTorch's sizes shrunk; T and D that divide nothing
    (1, 1, 1, 1, 8, 8),
    (2, 3, 7, 7, 59, 59),
    (2, 2, 97, 33, 16, 24),
    (1, 2, 5, 130, 40, 3),
    (3, 1, 64, 64, 1, 1),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_scaled_dot_product_attention_math_reference(backend, shape):
    b, h, tq, tk, d, dv = shape
    compare(backend, *_qkv(b, h, tq, tk, d, dv), {})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES[1:4], ids=str)
def test_float32_within_twice_the_naive_error(backend, shape):
    # PyTorch's criterion: error vs the float64 golden within a fudge factor of the float32 math error
    b, h, tq, tk, d, dv = shape
    q, k, v = _qkv(b, h, tq, tk, d, dv, dtype=torch.float32)
    mask = torch.rand(tq, tk, generator=torch.Generator().manual_seed(3)) > 0.3
    out = sa.scaled_dot_product_attention(q, k, v, mask, backend=backend)
    naive = torch_math(q, k, v, mask)
    gold = torch_math(q.double(), k.double(), v.double(), mask)
    err, ref_err = (out.double() - gold).abs().max(), (naive.double() - gold).abs().max()
    assert err <= 2 * ref_err + 1e-6, (err, ref_err)
    gq, gk = torch.autograd.grad(out.sum(), (q, k))
    eq, ek = (t.double() for t in torch.autograd.grad(naive.sum(), (q, k)))
    g64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    goldq, goldk = torch.autograd.grad(torch_math(*g64, mask).sum(), g64[:2])
    for a, n, e in ((gq, eq, goldq), (gk, ek, goldk)):
        assert (a.double() - e).abs().max() <= 2 * (n - e).abs().max() + 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "mask_shape",
    [(7, 11), (2, 1, 7, 11), (1, 3, 1, 11), (2, 3, 7, 11), (11,)],
    ids=["2d", "batch", "key_padding_per_head", "full", "1d"],
)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attn_mask_broadcast_bool_and_float(backend, mask_shape, kind):
    q, k, v = _qkv(2, 3, 7, 11, 8)
    g = torch.Generator().manual_seed(5)
    keep = torch.rand(mask_shape, generator=g) > 0.4
    keep[..., 0] = True  # every row sees a key here (fully masked rows: their own test)
    if kind == "bool":
        compare(backend, q, k, v, {"attn_mask": keep})
    else:
        mask = torch.randn(mask_shape, generator=g, dtype=torch.float64).masked_fill(~keep, -math.inf)
        compare(backend, q, k, v, {"attn_mask": mask})


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_mask_gets_its_gradient(backend):
    # torch's math backend differentiates an additive float mask (learned relative bias)
    q, k, v = _qkv(2, 2, 9, 13, 8)
    bias = _make((1, 2, 9, 13), seed=4)
    compare(backend, q, k, v, {"attn_mask": None}, {"attn_mask": bias}, extra=(bias,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("t", [1, 7, 97])
def test_is_causal_square_equals_torch(backend, t):
    compare(backend, *_qkv(2, 2, t, t, 12), {"is_causal": True})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("tq", "tk"), [(1, 9), (3, 40), (33, 97)])
def test_is_causal_tq_lt_tk_is_bottom_right(backend, tq, tk):
    # OUR documented semantics (docs/api.md): bottom-right. torch's is_causal is top-left, so the oracle
    # is torch's causal_lower_right bias; and torch's own top-left result must differ from ours.
    q, k, v = _qkv(2, 2, tq, tk, 12)
    out = compare(backend, q, k, v, {"attn_mask": causal_lower_right(tq, tk)}, {"is_causal": True})
    if tk > 1:
        assert not torch.allclose(out, torch_math(q, k, v, is_causal=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_causal_tq_gt_tk_first_rows_are_zeros(backend):
    # bottom-right with Tq > Tk: the first Tq - Tk queries see no key. OUR documented behaviour: zeros
    # and zero gradient (torch's causal_lower_right gives NaN rows there).
    tq, tk = 10, 4
    q, k, v = _qkv(1, 2, tq, tk, 8)
    out = sa.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    assert out[:, :, : tq - tk].abs().sum() == 0
    ref = torch_math(q, k, v, attn_mask=causal_lower_right(tq, tk))
    torch.testing.assert_close(out[:, :, tq - tk :], ref[:, :, tq - tk :], atol=1e-10, rtol=1e-10)
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert gq[:, :, : tq - tk].abs().sum() == 0 and torch.isfinite(gk).all() and torch.isfinite(gv).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_attn_mask_and_is_causal_together_are_anded(backend):
    # torch's fused kernels raise ("Explicit attn_mask should not be set when is_causal=True"); OUR rule
    # (functional.py) is the AND of the two, compared with torch given the combined bool mask.
    q, k, v = _qkv(2, 2, 6, 6, 8)
    keep = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[..., 0] = True
    both = keep & torch.ones(6, 6, dtype=torch.bool).tril()
    compare(backend, q, k, v, {"attn_mask": both}, {"attn_mask": keep, "is_causal": True})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (6, 1), (8, 8)])
def test_enable_gqa_equals_torch(backend, hq, hkv):
    q, k, v = _qkv(2, hq, 9, 17, 16, hkv=hkv)
    compare(backend, q, k, v, {"enable_gqa": True, "is_causal": False})
    mask = torch.rand(9, 17, generator=torch.Generator().manual_seed(2)) > 0.5
    mask[:, 0] = True
    compare(backend, q, k, v, {"enable_gqa": True, "attn_mask": mask})


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_errors(backend):
    q = torch.randn(1, 4, 5, 8)
    kv = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="enable_gqa"):
        sa.scaled_dot_product_attention(q, kv, kv, backend=backend)
    kv3 = torch.randn(1, 3, 5, 8)
    with pytest.raises(ValueError, match="head"):
        sa.scaled_dot_product_attention(q, kv3, kv3, enable_gqa=True, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [None, 0.0, 0.125, 3.5])
def test_scale_is_respected(backend, scale):
    compare(backend, *_qkv(2, 2, 7, 9, 10), {"scale": scale, "is_causal": False})


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_out_rows(backend):
    # test_transformers.py's test_fully_masked_out_rows: every 4th row masked whole, a pattern elsewhere;
    # zeros there (torch's math backend too, for bool masks: _safe_softmax) and finite gradients
    t = 33
    q, k, v = _qkv(1, 1, t, t, 16)
    mask = torch.ones(1, 1, t, t, dtype=torch.bool)
    mask[0, 0, ::4, :] = False
    mask &= (torch.arange(t)[:, None] % 5 == torch.arange(t) % 5) | (torch.arange(t)[:, None] % 4 != 0)
    compare(backend, q, k, v, {"attn_mask": mask})
    out = sa.scaled_dot_product_attention(q, k, v, mask, backend=backend)
    assert out[:, :, ::4].abs().sum() == 0
    g = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(x).all() for x in g) and g[0][:, :, ::4].abs().sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_neg_inf_float_row_gives_zeros_not_nan(backend):
    # OUR documented behaviour (docs/edge-cases.md): a float row of only −inf → zeros (torch 2.13's math
    # backend agrees, _safe_softmax; its fused CPU kernel and older torch give NaN)
    q, k, v = _qkv(1, 2, 5, 6, 8)
    mask = torch.zeros(5, 6, dtype=torch.float64)
    mask[2] = -math.inf
    out = sa.scaled_dot_product_attention(q, k, v, mask, backend=backend)
    assert out[:, :, 2].abs().sum() == 0 and not torch.isnan(out).any()
    torch.testing.assert_close(out, torch_math(q, k, v, mask), atol=1e-10, rtol=1e-10)
    keep = torch.ones(5, 6, dtype=torch.bool)
    keep[2] = False
    torch.testing.assert_close(out, torch_math(q, k, v, keep), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_out_nan_and_inf_do_not_leak(backend):
    # PyTorch issue #101967: NaN in masked-out key/value positions must not reach the output
    q, k, v = (t.detach().clone() for t in _qkv(1, 1, 4, 5, 4))
    keep = torch.ones(4, 5, dtype=torch.bool)
    keep[:, 3] = False
    clean = sa.scaled_dot_product_attention(q, k, v, keep, backend=backend)
    k[0, 0, 3], v[0, 0, 3] = math.nan, math.inf
    dirty = sa.scaled_dot_product_attention(q, k, v, keep, backend=backend)
    torch.testing.assert_close(dirty, clean, atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unbatched_and_many_batch_dims(backend):
    q, k, v = _qkv(1, 3, 7, 9, 8)
    compare(backend, q[0].detach().requires_grad_(), k[0].detach().requires_grad_(),
            v[0].detach().requires_grad_(), {"is_causal": False})  # fmt: skip
    q5 = _make((2, 2, 3, 7, 8))
    k5, v5 = _make((2, 2, 3, 9, 8), seed=1), _make((2, 2, 3, 9, 8), seed=2)
    compare(backend, q5, k5, v5, {"is_causal": False})


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_and_singleton_head_dim_stride(backend):
    # test_singelton_head_dim_stride_ne_1 and transposed (B, T, H, D) inputs
    base = _make((2, 9, 3, 16), grad=False)
    q = base.transpose(1, 2).requires_grad_()
    k = _make((2, 11, 3, 16), seed=1, grad=False).transpose(1, 2).requires_grad_()
    v = _make((2, 3, 16, 11), seed=2, grad=False).transpose(-1, -2).requires_grad_()
    saved = [t.detach().clone() for t in (q, k, v)]
    compare(backend, q, k, v, {"is_causal": False})
    for t, s in zip((q, k, v), saved, strict=True):
        assert torch.equal(t.detach(), s)  # inputs never mutated


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sizes(backend):
    for shape_q, shape_k in [((2, 2, 0, 8), (2, 2, 5, 8)), ((0, 2, 3, 8), (0, 2, 5, 8))]:
        q, k = torch.randn(shape_q), torch.randn(shape_k)
        out = sa.scaled_dot_product_attention(q, k, k, backend=backend)
        assert out.shape == torch.nn.functional.scaled_dot_product_attention(q, k, k).shape
    q, k = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 0, 4)
    out = sa.scaled_dot_product_attention(q, k, k, backend=backend)  # Tk = 0: ours zeros (torch NaN)
    assert out.shape == (1, 1, 3, 4) and out.abs().sum() == 0


# ---------------------------------------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_shapes_training_flag_and_reproducibility(backend):
    q, k, v = (t.detach() for t in _qkv(2, 3, 17, 23, 8, dv=5, dtype=torch.float32))
    torch.manual_seed(0)
    a = sa.scaled_dot_product_attention(q, k, v, dropout_p=0.3, backend=backend)
    torch.manual_seed(0)
    b = sa.scaled_dot_product_attention(q, k, v, dropout_p=0.3, backend=backend)
    assert a.shape == (2, 3, 17, 5) and torch.equal(a, b)
    plain = sa.scaled_dot_product_attention(q, k, v, backend=backend)
    assert not torch.allclose(a, plain)
    off = sa.scaled_dot_product_attention(q, k, v, dropout_p=0.3, training=False, backend=backend)
    torch.testing.assert_close(off, plain)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_is_unbiased_and_drops_about_p(backend):
    # all-ones values: each output entry is the sum of the kept weights / (1 - p); mean 1, and the
    # fraction of dropped weights shows in the variance (checked loosely: a statistical test)
    p, t = 0.4, 64
    q, k = torch.randn(4, 4, t, 8), torch.randn(4, 4, t, 8)
    v = torch.ones(4, 4, t, 1)
    torch.manual_seed(1)
    out = sa.scaled_dot_product_attention(q, k, v, dropout_p=p, backend=backend)
    assert abs(out.mean().item() - 1.0) < 0.03
    assert 0.0 < out.std().item() < 1.0
    zero_rows = sa.scaled_dot_product_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], dropout_p=p,
                                                backend=backend)  # fmt: skip
    values = torch.unique(zero_rows)  # one key: the weight is 1, kept (→ 1/(1-p)) or dropped (→ 0)
    assert all(min(abs(x), abs(x - 1 / (1 - p))) < 1e-6 for x in values.tolist())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_p_out_of_range_raises(backend, p):
    # OUR documented rule: [0, 1) (torch also accepts 1.0 and gives zeros)
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="dropout_p"):
        sa.scaled_dot_product_attention(q, q, q, dropout_p=p, backend=backend)


# ---------------------------------------------------------------------------------------------------------
# Errors (test_invalid_inputs_*, test_invalid_fused_inputs_dim, test_scaled_dot_product_attention_*)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_inputs_different_dtypes(backend):
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(TypeError, match="dtype"):
        sa.scaled_dot_product_attention(q, q.double(), q, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_inputs_integer_and_non_tensor(backend):
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(TypeError):
        sa.scaled_dot_product_attention(q.long(), q.long(), q.long(), backend=backend)
    with pytest.raises(TypeError):
        sa.scaled_dot_product_attention(q.tolist(), q, q, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_inputs_different_devices(backend):
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="device"):
        sa.scaled_dot_product_attention(q, q.to("meta"), q, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_inputs_shapes(backend):
    q = torch.randn(2, 2, 3, 4)
    with pytest.raises(ValueError, match="head_dim|dim"):
        sa.scaled_dot_product_attention(q, torch.randn(2, 2, 5, 6), torch.randn(2, 2, 5, 6), backend=backend)
    with pytest.raises(ValueError, match="key and value"):
        sa.scaled_dot_product_attention(q, torch.randn(2, 2, 5, 4), torch.randn(2, 2, 6, 4), backend=backend)
    with pytest.raises(ValueError):
        sa.scaled_dot_product_attention(q, torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4), backend=backend)
    with pytest.raises(ValueError):
        sa.scaled_dot_product_attention(q, torch.randn(4), torch.randn(4), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_masks(backend):
    q = torch.randn(2, 2, 3, 4)
    with pytest.raises(ValueError, match="mask"):
        sa.scaled_dot_product_attention(q, q, q, torch.ones(4, 3, dtype=torch.bool), backend=backend)
    with pytest.raises(TypeError, match="bool"):
        sa.scaled_dot_product_attention(q, q, q, torch.ones(3, 3, dtype=torch.int64), backend=backend)
    with pytest.raises(ValueError, match="NaN"):
        sa.scaled_dot_product_attention(q, q, q, torch.full((3, 3), math.nan), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_scale_and_flags(backend):
    q = torch.randn(1, 1, 3, 4)
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="scale"):
            sa.scaled_dot_product_attention(q, q, q, scale=bad, backend=backend)
    with pytest.raises(TypeError, match="is_causal"):
        sa.scaled_dot_product_attention(q, q, q, is_causal="yes", backend=backend)


def test_unknown_backend_names_the_choices():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="reference"):
        sa.scaled_dot_product_attention(q, q, q, backend="nope")


# ---------------------------------------------------------------------------------------------------------
# Combinations (test_transformers.py's parametrized math comparisons, with our bottom-right causal)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_causal_and_learned_float_mask_with_tq_lt_tk(backend):
    q, k, v = _qkv(2, 4, 5, 19, 12, dv=7, hkv=2)
    bias = _make((1, 1, 5, 19), seed=3)
    keep = causal_lower_right(5, 19)._materialize()
    out = sa.scaled_dot_product_attention(q, k, v, bias, is_causal=True, enable_gqa=True, backend=backend)
    b2 = bias.detach().requires_grad_()
    ref = torch_math(q, k, v, attn_mask=b2.masked_fill(~keep, -math.inf), enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for a, e in zip(torch.autograd.grad(out.sum(), (q, k, v, bias)),
                    torch.autograd.grad(ref.sum(), (q, k, v, b2)), strict=True):  # fmt: skip
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_gradcheck_with_a_fixed_seed(backend):
    # the backward must use the forward's dropout mask: gradcheck of the seeded function in float64
    q, k, v = _qkv(1, 2, 6, 7, 4, dv=3)

    def f(q, k, v):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return sa.scaled_dot_product_attention(q, k, v, dropout_p=0.3, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_within_twice_the_naive_error(backend):
    q, k, v = (t.detach().bfloat16() for t in _qkv(2, 2, 97, 97, 40))
    mask = torch.rand(97, 97, generator=torch.Generator().manual_seed(4)) > 0.2
    out = sa.scaled_dot_product_attention(q, k, v, mask, backend=backend)
    assert out.dtype == torch.bfloat16
    gold = torch_math(q.double(), k.double(), v.double(), attn_mask=mask)
    naive = torch_math(q, k, v, attn_mask=mask)
    assert (out.double() - gold).abs().max() <= 2 * (naive.double() - gold).abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_padding_mask_b_1_1_tk_and_long_causal(backend):
    q, k, v = _qkv(3, 2, 8, 10, 4)
    keep = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    keep[0, ..., 7:] = False
    keep[2, ..., :3] = False
    compare(backend, q, k, v, {"attn_mask": keep})
    compare(backend, *_qkv(1, 1, 1025, 1025, 59), {"is_causal": True})


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_zero_with_a_mask_is_the_mean_of_the_visible_values(backend):
    q, k, v = _qkv(1, 1, 5, 6, 4)
    keep = torch.tensor([[1, 1, 0, 0, 1, 0]], dtype=torch.bool).expand(5, 6)
    out = compare(backend, q, k, v, {"attn_mask": keep, "scale": 0.0})
    torch.testing.assert_close(out, v[:, :, [0, 1, 4]].mean(2, keepdim=True).expand_as(out))
