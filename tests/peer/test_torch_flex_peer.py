# Adapted from PyTorch's test/inductor/test_flex_attention.py and test/inductor/test_flex_decoding.py
# (https://github.com/pytorch/pytorch). The test ideas (the score_mod and mask_mod families, the shapes,
# the checks) come from there; the code is written anew for this library.
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
"""PyTorch's flex attention tests, adapted to ``selfattention.flex_attention`` / ``create_block_mask``.

Like PyTorch's ``run_test``, every comparison is against a float64 "golden" computed densely here (the
scores materialised, the score_mod and mask_mod applied on full index grids, torch's own ``create_mask``
for the mask), forward, log-sum-exp and gradients of query, key, value and of tensors the mods capture.
In float32 the check is PyTorch's: our error against the golden ≤ a fudge factor × the error of the
float32 eager computation; in float64 the tolerance is 1e-10.

Left out of PyTorch's files (no meaning without their compiler or GPU):
* everything ``torch.compile``-specific: the inductor/Triton kernels, ``max_autotune``, codegen counters,
  recompilation counts, dynamic shapes, the printed FX graphs (``test_fw_bw_graph_correctness``),
  ``aot_eager`` gradchecks of the compiled HOP, cudagraphs, ``kernel_options`` values other than
  accepted-and-ignored (``PRESCALE_QK``, ``BLOCK_M``..., which tune Triton tiles);
* CUDA-only cases: bf16/fp16 on CUDA, paged attention (``PagedAttention``, ``test_paged_*``), TMA, the
  FLASH backend and ``compute_dq_write_order`` (we raise ``NotImplementedError``), multiple devices,
  memory-use tests (``test_max_memory``), nested/jagged tensors (``test_nested_tensor*``);
* the flex-decoding kernel's split-KV tuning (``test_flex_decoding``'s ``SPLIT_KV``): only its semantics
  (one query against a long KV, GQA, decode at an offset) are kept;
* ``BlockMask.to_string``/``__repr__`` pretty-printing (torch's own code, not ours) and
  ``test_block_mask_viz``.

Default sizes keep this file at a few seconds; ``SA_PEER_FULL=1`` adds the long sequences (1025, 2048).
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as tfa

import selfattention as sa
from selfattention import flex_attention
from selfattention.flex import AuxRequest, and_masks, create_block_mask, create_mask, noop_mask, or_masks

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
warnings.filterwarnings("ignore", message=".*return_lse is deprecated.*")

FULL = os.environ.get("SA_PEER_FULL") == "1"
B, H, S, D = 2, 4, 97, 24  # PyTorch uses (4, 8, 2048, 64); T and D chosen here not to divide anything
Hq, Hkv = 4, 2
LONG = [1025, 2048] if FULL else []


# ---------------------------------------------------------------------------------------------------------
# The golden: dense float64 math
# ---------------------------------------------------------------------------------------------------------


def _grids(b, h, tq, tk):
    return (
        torch.arange(b).view(-1, 1, 1, 1).expand(b, h, tq, tk),
        torch.arange(h).view(1, -1, 1, 1).expand(b, h, tq, tk),
        torch.arange(tq).view(1, 1, -1, 1).expand(b, h, tq, tk),
        torch.arange(tk).view(1, 1, 1, -1).expand(b, h, tq, tk),
    )


def golden(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """(out, lse) with autograd, in the inputs' dtype; fully masked rows: out 0, lse −inf (flex's rule)."""
    b, h, tq, d = q.shape
    g = h // k.shape[1]
    k, v = k.expand(b, *k.shape[1:]), v.expand(b, *v.shape[1:])
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    tk = k.shape[2]
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(d) if scale is None else scale)
    if score_mod is not None:
        s = score_mod(s, *_grids(b, h, tq, tk))
    if mask_mod is not None:
        keep = tfa.create_mask(mask_mod, b, h, tq, tk, device="cpu")  # torch's own, not ours
        s = torch.where(keep, s, torch.full((), -math.inf, dtype=s.dtype))
    blind = torch.isneginf(s).all(-1, keepdim=True)
    s = torch.where(blind, torch.zeros((), dtype=s.dtype), s)
    lse = torch.logsumexp(s, -1).masked_fill(blind.squeeze(-1), -math.inf)
    p = torch.softmax(s, -1).masked_fill(blind, 0.0)
    return p @ v, lse


def _make(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()


def _grads(out, lse, leaves, seed=1):
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    dl = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    fin = torch.isfinite(lse)
    loss = (out * do).sum() + (torch.where(fin, lse, 0) * dl).sum()
    return torch.autograd.grad(loss, leaves, allow_unused=True)


def run_test(
    score_mod=None, mask_mod=None, dtype=torch.float64, *, Q_B=B, Q_H=H, Q_S=S, QK_D=D, KV_B=None,
    KV_H=None, KV_S=None, V_D=None, block_size=128, captured=(), scale=None,
):  # fmt: skip
    """PyTorch's run_test: ours vs the golden, forward, lse and every gradient (captured tensors too)."""
    KV_B, KV_H, KV_S, V_D = KV_B or Q_B, KV_H or Q_H, KV_S or Q_S, V_D or QK_D
    q = _make((Q_B, Q_H, Q_S, QK_D), dtype, 0)
    k = _make((KV_B, KV_H, KV_S, QK_D), dtype, 1)
    v = _make((KV_B, KV_H, KV_S, V_D), dtype, 2)
    bm = None
    if mask_mod is not None:
        bm = create_block_mask(mask_mod, Q_B, Q_H, Q_S, KV_S, device="cpu", BLOCK_SIZE=block_size)
    gqa = Q_H != KV_H
    out, lse = flex_attention(q, k, v, score_mod, bm, scale=scale, enable_gqa=gqa, return_lse=True)
    assert out.shape == (Q_B, Q_H, Q_S, V_D) and out.dtype == dtype
    assert lse.shape == (Q_B, Q_H, Q_S)
    leaves = (q, k, v, *captured)
    ours = _grads(out, lse, leaves)
    gold_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    cap64 = list(captured)
    go, gl = golden(*gold_in, score_mod, mask_mod, scale)
    gold = _grads(go, gl, (*gold_in, *cap64))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    if dtype == torch.float64:
        tol = dict(atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(out, go, **tol)
        torch.testing.assert_close(lse, gl, **tol)
        for name, a, e in zip(("dq", "dk", "dv", *("captured",) * len(captured)), ours, gold, strict=True):
            assert a is not None, name
            torch.testing.assert_close(a, e, **tol, msg=lambda m, n=name: f"{n}: {m}")
        return
    # float32: PyTorch's criterion, error vs golden within fudge × the naive float32 error
    ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
    ro, rl = golden(*ref_in, score_mod, mask_mod, scale)
    ref = _grads(ro, rl, (*ref_in, *captured))
    for name, a, r, e in zip(
        ("out", "lse", "dq", "dk", "dv"),
        (out, lse, *ours[:3]),
        (ro, rl, *ref[:3]),
        (go, gl, *gold[:3]),
        strict=True,
    ):
        fin = torch.isfinite(e)
        err = (a.double() - e)[fin].abs().max()
        ref_err = (r.double() - e)[fin].abs().max()
        assert err <= 3 * ref_err + 1e-6, f"{name}: error {err:.3g} vs float32 eager {ref_err:.3g}"


# ---------------------------------------------------------------------------------------------------------
# PyTorch's score_mod and mask_mod families
# ---------------------------------------------------------------------------------------------------------


def _identity(score, b, h, m, n):
    return score


def _causal(score, b, h, q, kv):
    return torch.where(q >= kv, score, -float("inf"))


def _rel_bias(score, b, h, m, n):
    return score + (m - n)


def _rel_causal(score, b, h, m, n):
    return torch.where(m >= n, score + (m - n), -float("inf"))


def _generate_alibi_bias(num_heads):
    def _alibi_bias(score, b, h, m, n):
        return score + (m - n) * torch.exp2(-8 * (h + 1) / num_heads)

    return _alibi_bias


def _times_two(score, b, h, m, n):
    return score * 2


def _squared(score, b, h, m, n):
    return score * score


def _head_offset(dtype):
    head_offset = torch.rand(H, dtype=dtype)

    def score_mod(score, b, h, m, n):
        return score * head_offset[h]

    return score_mod


def _trig(score, b, h, m, n):
    return torch.sin(torch.cos(score)) + torch.tan(b)


def _trig2(score, b, h, m, n):
    return torch.cos(score) * torch.sin(score) * torch.tan(b)


def _softcap(score, b, h, m, n):
    return 20 * torch.tanh(score / 20)


TEST_SCORE_MODS = [
    _identity, _times_two, _squared, _causal, _rel_bias, _rel_causal, _generate_alibi_bias(8), _trig, _trig2,
    _softcap,
]  # fmt: skip


def causal_mask(b, h, q, kv):
    return q >= kv


def sliding_window(w):
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv <= w)

    return mask


def prefix_lm(n):
    def mask(b, h, q, kv):
        return (kv < n) | (q >= kv)

    return mask


def document_mask(lengths, total):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    doc = torch.cat([doc, torch.full((total - doc.numel(),), len(lengths))])

    def mask(b, h, q, kv):
        return doc[q] == doc[kv]

    return mask


def head_dependent_mask(b, h, q, kv):
    return (q >= kv) | (h % 2 == 0)


def batch_dependent_mask(b, h, q, kv):
    return (q + 16 * b) >= kv


def checkerboard(b, h, q, kv):
    return (q // 16 + kv // 16) % 2 == 0  # hides whole blocks of 16 and leaves others full


TEST_MASK_MODS = {
    "causal": causal_mask,
    "sliding_window_20": sliding_window(20),
    "prefix_lm_30": prefix_lm(30),
    "document": document_mask([13, 40, 1, 30], S),
    "head_dependent": head_dependent_mask,
    "batch_dependent": batch_dependent_mask,
    "checkerboard": checkerboard,
}


@pytest.mark.parametrize("score_mod", TEST_SCORE_MODS, ids=lambda f: f.__name__)
def test_builtin_score_mods(score_mod):
    run_test(score_mod)


@pytest.mark.parametrize("score_mod", [_identity, _rel_causal, _trig, _softcap], ids=lambda f: f.__name__)
def test_builtin_score_mods_float32(score_mod):
    run_test(score_mod, dtype=torch.float32)


@pytest.mark.parametrize("name", list(TEST_MASK_MODS))
@pytest.mark.parametrize("block_size", [128, 16, (16, 32), 7])
def test_mask_mods_with_block_sizes(name, block_size):
    run_test(mask_mod=TEST_MASK_MODS[name], block_size=block_size)


@pytest.mark.parametrize("name", ["causal", "document", "checkerboard"])
def test_mask_mods_float32(name):
    run_test(mask_mod=TEST_MASK_MODS[name], dtype=torch.float32, block_size=16)


@pytest.mark.parametrize(
    "score_mod", [_rel_bias, _trig, _head_offset(torch.float64)], ids=lambda f: f.__name__
)
def test_score_mod_and_mask_mod_together(score_mod):
    run_test(score_mod, sliding_window(10), block_size=(16, 8))


@pytest.mark.parametrize("score_mod", [_identity, _rel_causal, _squared], ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    ("q_s", "kv_s"), [(1, 97), (7, 130), (97, 33), (64, 1)] + [(s // 2, s) for s in LONG]
)
def test_builtin_score_mods_different_seqlen(score_mod, q_s, kv_s):
    run_test(score_mod, Q_S=q_s, KV_S=kv_s)


@pytest.mark.parametrize(("q_s", "kv_s"), [(7, 130), (97, 33), (1, 200)])
def test_mask_mod_different_seqlen(q_s, kv_s):
    def offset_causal(b, h, q, kv):  # torch's convention: no implicit alignment, q_idx is the row index
        return q + (kv_s - q_s) >= kv

    run_test(mask_mod=offset_causal, Q_S=q_s, KV_S=kv_s, block_size=(8, 16))


@pytest.mark.parametrize("seq", [1, 7, 63, 129] + LONG)
def test_non_divisible_seq_len(seq):
    run_test(_rel_bias, causal_mask, Q_S=seq, KV_S=seq, block_size=(32, 64))


@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize("mask", [None, "causal", "head_dependent"])
def test_gqa(hq, hkv, mask):
    def head_rel(score, b, h, m, n):  # depends on the query head: GQA must pass h, not h // group
        return score + h * 0.25 * (m - n) / 97

    run_test(head_rel, TEST_MASK_MODS.get(mask), Q_H=hq, KV_H=hkv, block_size=16)


def test_kv_batch_broadcast():
    run_test(_rel_bias, batch_dependent_mask, Q_B=3, KV_B=1, block_size=32)


@pytest.mark.parametrize(("qk_d", "v_d"), [(16, 7), (24, 40), (1, 5)])
def test_non_equal_head_dims(qk_d, v_d):
    run_test(_rel_causal, QK_D=qk_d, V_D=v_d)


@pytest.mark.parametrize("scale", [0.0, 0.5, 3.0])
def test_explicit_scale(scale):
    run_test(_rel_bias, causal_mask, scale=scale, block_size=16)


# ---------------------------------------------------------------------------------------------------------
# Captured tensors (PyTorch: test_captured_buffers*, test_captured_score_mod_aot_eager_gradcheck)
# ---------------------------------------------------------------------------------------------------------


def test_captured_buffers_all_dims():
    head_scale = torch.randn(H, dtype=torch.float64)
    batch_scale = torch.randn(B, dtype=torch.float64)
    tok_scale = torch.randn(S, dtype=torch.float64)

    def all_bias(score, batch, head, token_q, token_kv):
        return score + tok_scale[token_q] + batch_scale[batch] + head_scale[head]

    run_test(all_bias)


def test_captured_buffers_require_grad():
    bias = torch.randn(B, H, S, S, dtype=torch.float64, requires_grad=True)
    head = torch.rand(H, dtype=torch.float64, requires_grad=True)

    def score_mod(score, b, h, q, kv):
        return score * head[h] + bias[b, h, q, kv]

    run_test(score_mod, causal_mask, captured=(bias, head), block_size=16)


def test_captured_buffer_gradient_through_a_nonadditive_mod():
    temp = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)

    def score_mod(score, b, h, q, kv):
        return 10 * torch.tanh(score / 10) * temp

    run_test(score_mod, sliding_window(15), captured=(temp,), block_size=(16, 32))


def test_multiple_score_mod_calls():
    query = _make((1, 4, 64, 16), torch.float64, 0)
    keys = [_make((1, 4, 1024, 16), torch.float64, i) for i in (1, 2)]
    values = [_make((1, 4, 1024, 16), torch.float64, i) for i in (3, 4)]

    def scoremod_1(qk, b, h, q, kv):
        return qk + (q - kv)

    def scoremod_2(qk, b, h, q, kv):
        return torch.where(q >= kv, qk, -float("inf"))

    def f(q, k1, k2, v1, v2, fn):
        q2 = fn(q, k1, v1, score_mod=scoremod_1)
        return fn(q2, k2, v2, score_mod=scoremod_2)

    def dense(q, k, v, score_mod):
        return golden(q, k, v, score_mod)[0]

    out = f(query, *keys, *values, flex_attention)
    ref = f(query, *keys, *values, dense)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    g = torch.autograd.grad(out.sum(), (query, *keys, *values))
    gr = torch.autograd.grad(ref.sum(), (query, *keys, *values))
    for a, e in zip(g, gr, strict=True):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-10)


# ---------------------------------------------------------------------------------------------------------
# Log-sum-exp, aux outputs, fully masked rows (test_logsumexp_*, test_fully_masked_out_rows*, test_aux_*)
# ---------------------------------------------------------------------------------------------------------


def test_logsumexp_correctness_natural_log():
    q, k, v = (_make((B, H, S, D), torch.float32, i) for i in range(3))
    _, lse = flex_attention(q, k, v, _causal, return_lse=True)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -math.inf)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


def test_logsumexp_only_return_and_gradient():
    q, k, v = (_make((B, H, S, D), torch.float64, i) for i in range(3))
    bm = create_block_mask(causal_mask, None, None, S, S, device="cpu", BLOCK_SIZE=32)
    _, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    (gq, gk) = torch.autograd.grad(lse.sum(), (q, k))
    g_in = [t.detach().requires_grad_() for t in (q, k, v)]
    _, gl = golden(*g_in, mask_mod=causal_mask)
    eq, ek = torch.autograd.grad(gl.sum(), g_in[:2])
    torch.testing.assert_close(gq, eq, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(gk, ek, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("block_b", [1, B])
def test_fully_masked_out_rows_0_check(gqa, block_b):
    hkv = Hkv if gqa else Hq
    q = _make((B, Hq, S, D), torch.float32, 0)
    k, v = _make((B, hkv, S, D), torch.float32, 1), _make((B, hkv, S, D), torch.float32, 2)
    M = S // 2

    def mask_mod(b, h, q, kv):
        return q < M

    bm = create_block_mask(mask_mod, block_b, 1, S, S, device="cpu")
    out, lse = flex_attention(q, k, v, block_mask=bm, enable_gqa=gqa, return_lse=True)
    assert out[:, :, M:, :].abs().sum() == 0
    assert (lse[:, :, M:] == -float("inf")).all()
    loss = out.sum() + lse[:, :, :M].sum()
    gq, gk, gv = torch.autograd.grad(loss, (q, k, v))
    assert gq[:, :, M:, :].abs().sum() == 0
    for g in (gq, gk, gv):
        assert torch.isfinite(g).all()


def test_fully_masked_out_rows_by_score_mod():
    # a row made all −inf by the score_mod rather than the mask: flex gives 0 and lse −inf there too
    q, k, v = (_make((1, 2, 33, 8), torch.float64, i) for i in range(3))

    def hide_odd_rows(score, b, h, m, n):
        return torch.where(m % 2 == 1, -float("inf"), score)

    out, lse = flex_attention(q, k, v, hide_odd_rows, return_lse=True)
    assert out[:, :, 1::2].abs().sum() == 0 and torch.isneginf(lse[:, :, 1::2]).all()
    go, gl = golden(q, k, v, hide_odd_rows)
    torch.testing.assert_close(out, go, atol=1e-10, rtol=1e-10)
    (gq,) = torch.autograd.grad(out.sum(), (q,))
    assert torch.isfinite(gq).all() and gq[:, :, 1::2].abs().sum() == 0


@pytest.mark.parametrize("lse", [True, False])
@pytest.mark.parametrize("max_scores", [True, False])
def test_return_aux(lse, max_scores):
    q, k, v = (_make((B, H, S, D), torch.float64, i) for i in range(3))
    bm = create_block_mask(sliding_window(9), B, 1, S, S, device="cpu", BLOCK_SIZE=16)
    out, aux = flex_attention(q, k, v, _rel_bias, bm, return_aux=AuxRequest(lse=lse, max_scores=max_scores))
    go, gl = golden(q, k, v, _rel_bias, sliding_window(9))
    torch.testing.assert_close(out, go, atol=1e-10, rtol=1e-10)
    assert (aux.lse is not None) == lse and (aux.max_scores is not None) == max_scores
    if lse:
        torch.testing.assert_close(aux.lse, gl, atol=1e-10, rtol=1e-10)
    if max_scores:
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        s = _rel_bias(s, *_grids(B, H, S, S))
        keep = tfa.create_mask(sliding_window(9), B, H, S, S, device="cpu")
        torch.testing.assert_close(aux.max_scores, s.masked_fill(~keep, -math.inf).amax(-1))


def test_return_lse_and_return_aux_together_raises():
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="return_lse"):
        flex_attention(q, q, q, return_lse=True, return_aux=AuxRequest(lse=True))


# ---------------------------------------------------------------------------------------------------------
# BlockMask (TestBlockMask): attributes, indexing, to_dense, sparsity, combiners, create_mask, _adjust
# ---------------------------------------------------------------------------------------------------------


def test_block_mask_attributes():
    offset = torch.zeros(8)

    def causal(b, h, q, kv):
        return (q + (offset[b] * 128)) >= kv

    bm = create_block_mask(causal, 4, 2, 2048, 2048, device="cpu")
    assert bm.shape == (4, 2, 2048, 2048)
    # torch 2.13's BlockMask.__getitem__ keeps an int-indexed dim (older torch dropped it, as the test says)
    assert bm[0].shape == (1, 2, 2048, 2048)
    assert bm[0, 0].shape == (1, 1, 2048, 2048)
    assert bm.numel() == 4 * 2 * 2048 * 2048
    assert bm.sparsity() == 46.875
    assert bm[0].sparsity() == 46.875 and bm[1, 0].sparsity() == 46.875
    offset = torch.arange(8)
    bm = create_block_mask(causal, 8, 1, 2048, 2048, device="cpu")
    assert bm.sparsity() == 29.1015625
    assert bm.sparsity() < bm[0].sparsity()
    assert bm[0].sparsity() > bm[1].sparsity()


@pytest.mark.parametrize("name", list(TEST_MASK_MODS))
@pytest.mark.parametrize("block_size", [128, (16, 32), 7])
def test_block_tables_equal_torchs(name, block_size):
    mod = TEST_MASK_MODS[name]
    ours = create_block_mask(mod, B, H, S, S, device="cpu", BLOCK_SIZE=block_size)
    theirs = tfa.create_block_mask(mod, B, H, S, S, device="cpu", BLOCK_SIZE=block_size)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert torch.equal(ours.kv_num_blocks, theirs.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)
    for n, a, b_ in (
        (ours.kv_num_blocks, ours.kv_indices, theirs.kv_indices),
        (ours.full_kv_num_blocks, ours.full_kv_indices, theirs.full_kv_indices),
    ):
        listed = torch.arange(a.shape[-1]) < n[..., None]  # the order within a row is free; the set is not
        assert torch.equal(
            torch.where(listed, a, -1).sort(-1).values, torch.where(listed, b_, -1).sort(-1).values
        )
    assert ours.sparsity() == theirs.sparsity()
    assert torch.equal(ours.q_num_blocks, theirs.q_num_blocks)


def test_getitem():
    offset = torch.zeros(8)

    def causal(b, h, q, kv):
        return (q + (offset[b] * 128)) >= kv

    bm = create_block_mask(causal, 4, 2, 512, 512, device="cpu")
    assert bm.kv_num_blocks.shape == (4, 2, 4) and bm.kv_indices.shape == (4, 2, 4, 4)
    # torch 2.13 keeps int-indexed dims as size 1 (its docstring still shows them dropped)
    assert bm[0].kv_num_blocks.shape == (1, 2, 4) and bm[0].kv_indices.shape == (1, 2, 4, 4)
    assert bm[0, 1].kv_num_blocks.shape == (1, 1, 4)
    assert bm[0:2, 1:2].kv_indices.shape == (2, 1, 4, 4)
    assert bm[0:2, 1:2, torch.tensor([1], dtype=torch.int32)].kv_indices.shape == (2, 1, 1, 4)
    assert torch.equal(bm[0:2, 1:2].to_dense(), bm.to_dense()[0:2, 1:2])


def test_sliced_block_mask_cannot_be_used():
    bm = create_block_mask(causal_mask, 2, 1, 256, 256, device="cpu")
    q = torch.randn(1, 1, 256, 8)
    with pytest.raises((RuntimeError, ValueError)):
        flex_attention(q, q, q, block_mask=bm[0:1])


def test_block_mask_adjust():
    # torch: _adjust crops the block tables to the upper-left corner (valid for causal masks)
    bm = create_block_mask(causal_mask, 1, 1, 512, 512, device="cpu", BLOCK_SIZE=64)
    small = bm._adjust(200, 200)
    q, k, v = (_make((1, 2, 200, 8), torch.float64, i) for i in range(3))
    out = flex_attention(q, k, v, block_mask=small)
    torch.testing.assert_close(out, golden(q, k, v, mask_mod=causal_mask)[0], atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="block_mask|Q_LEN|q_len"):
        flex_attention(q, k, v, block_mask=bm)  # made for 512, used for 200 (torch raises ValueError too)


def test_block_mask_for_a_shorter_sequence_raises():
    bm = create_block_mask(causal_mask, 1, 1, 128, 128, device="cpu")
    q = torch.randn(1, 1, 200, 8)
    with pytest.raises(ValueError, match="block_mask"):
        flex_attention(q, q, q, block_mask=bm)


def _mask_tensors(fn, b=2, h=3, tq=37, tk=53):
    return create_mask(fn, b, h, tq, tk, device="cpu"), tfa.create_mask(fn, b, h, tq, tk, device="cpu")


@pytest.mark.parametrize("name", list(TEST_MASK_MODS))
def test_create_mask_equals_torchs(name):
    fn = TEST_MASK_MODS[name]
    ours = create_mask(fn, B, H, S, S, device="cpu")
    theirs = tfa.create_mask(fn, B, H, S, S, device="cpu")
    assert ours.dtype == torch.bool and torch.equal(ours, theirs)


def test_create_mask_of_a_score_mod_and_none_dims():
    ours, theirs = _mask_tensors(_rel_causal)
    assert torch.equal(ours, theirs)
    a = create_mask(causal_mask, None, None, 9, 11, device="cpu")
    assert a.shape == (1, 1, 9, 11) and torch.equal(a, tfa.create_mask(causal_mask, None, None, 9, 11, "cpu"))


def test_mask_mod_combiners():
    def causal(b, h, q, kv):
        return q >= kv

    def neg_causal(b, h, q, kv):
        return q < kv

    def window(b, h, q, kv):
        return (q - kv).abs() <= 5

    combos = {
        "and_empty": (and_masks(causal, neg_causal), tfa.and_masks(causal, neg_causal)),
        "or_full": (or_masks(causal, neg_causal), tfa.or_masks(causal, neg_causal)),
        "and3": (and_masks(causal, window, noop_mask), tfa.and_masks(causal, window, tfa.noop_mask)),
        "or_and": (
            or_masks(and_masks(causal, window), neg_causal),
            tfa.or_masks(tfa.and_masks(causal, window), neg_causal),
        ),  # fmt: skip
        "and_none": (and_masks(), tfa.and_masks()),
        "or_none": (or_masks(), tfa.or_masks()),
    }
    for name, (ours, theirs) in combos.items():
        a, b_ = _mask_tensors(ours)[0], _mask_tensors(theirs)[1]
        assert torch.equal(a, b_), name
    bm = create_block_mask(and_masks(causal, neg_causal), 1, 1, 256, 256, device="cpu")
    assert bm.kv_num_blocks.sum() == 0 and bm.full_kv_num_blocks.sum() == 0
    bm = create_block_mask(or_masks(causal, neg_causal), 1, 1, 256, 256, device="cpu")
    assert bm.kv_num_blocks.sum() == 0 and bm.full_kv_num_blocks.sum() == 4


def test_combined_masks_attention_matches_golden():
    mod = or_masks(and_masks(causal_mask, sliding_window(6)), prefix_lm(5))
    run_test(_rel_bias, mod, block_size=(8, 16))


def test_empty_block_mask_means_no_output():
    # every block empty: a BlockMask with zero blocks → output 0 (flex skips every block)
    q, k, v = (_make((1, 2, 64, 8), torch.float64, i) for i in range(3))
    bm = create_block_mask(lambda b, h, q, kv: q < 0, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=16)
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert out.abs().sum() == 0 and torch.isneginf(lse).all()
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert gq.abs().sum() == gk.abs().sum() == gv.abs().sum() == 0


def test_torch_block_mask_is_accepted():
    # a BlockMask from torch's create_block_mask works unchanged (same tables, same results)
    bm = tfa.create_block_mask(document_mask([10, 50, 37], S), B, 1, S, S, device="cpu", BLOCK_SIZE=32)
    q, k, v = (_make((B, H, S, D), torch.float64, i) for i in range(3))
    out = flex_attention(q, k, v, _rel_bias, bm)
    go, _ = golden(q, k, v, _rel_bias, document_mask([10, 50, 37], S))
    torch.testing.assert_close(out, go, atol=1e-10, rtol=1e-10)


def test_block_mask_from_kv_blocks_only_listed_blocks_are_computed():
    # torch semantics: keys outside the listed blocks are hidden even where mask_mod says True
    num = torch.tensor([[[1, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1], [0, 1]]]], dtype=torch.int32)
    bm = tfa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, mask_mod=noop_mask, seq_lengths=(32, 32))
    q, k, v = (_make((1, 1, 32, 4), torch.float64, i) for i in range(3))
    out = flex_attention(q, k, v, block_mask=bm)

    def first_block(b, h, q, kv):
        return kv < 16

    torch.testing.assert_close(out, golden(q, k, v, mask_mod=first_block)[0], atol=1e-10, rtol=1e-10)
    # (torch's *eager* CPU flex evaluates mask_mod densely and ignores the tables, so it attends to block 1
    # here; its compiled kernels skip unlisted blocks, as we do. Left out: the eager comparison.)


# ---------------------------------------------------------------------------------------------------------
# Flex decoding (test_flex_decoding.py): one query, a long KV, GQA, decode at an offset
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_s", [1, 65, 513] + LONG)
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 1), (8, 2)])
def test_decoding_single_query(kv_s, hq, hkv):
    run_test(_rel_bias, Q_S=1, KV_S=kv_s, Q_H=hq, KV_H=hkv, QK_D=16)


def test_decode_at_different_input_positions():
    # PyTorch: a causal mask shifted by the current decode position (captured offset tensor)
    kv_s, q_s = 300, 4
    offset = torch.tensor(kv_s - q_s)

    def causal_offset(b, h, q, kv):
        return q + offset >= kv

    run_test(_rel_bias, causal_offset, Q_S=q_s, KV_S=kv_s, Q_H=Hq, KV_H=Hkv, block_size=(4, 64))


# ---------------------------------------------------------------------------------------------------------
# Errors (test_input_*, test_qkv_and_block_mask_on_the_same_device, test_different_dtypes_fails ...)
# ---------------------------------------------------------------------------------------------------------


def test_different_dtypes_fails():
    q = torch.randn(1, 1, 8, 4, dtype=torch.float32)
    k = torch.randn(1, 1, 8, 4, dtype=torch.float64)
    with pytest.raises((TypeError, ValueError), match="dtype"):
        flex_attention(q, k, k)


def test_head_dims_and_heads_fail():
    q = torch.randn(1, 4, 8, 4)
    with pytest.raises(ValueError, match="head_dim"):
        flex_attention(q, torch.randn(1, 4, 8, 5), torch.randn(1, 4, 8, 5))
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_attention(q, torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4))
    with pytest.raises(ValueError, match="multiple"):
        flex_attention(q, torch.randn(1, 3, 8, 4), torch.randn(1, 3, 8, 4), enable_gqa=True)


def test_wrong_rank_and_batch_fail():
    with pytest.raises(ValueError, match="4-D"):
        flex_attention(torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4))
    q = torch.randn(3, 1, 8, 4)
    with pytest.raises(ValueError, match="batch"):
        flex_attention(q, torch.randn(2, 1, 8, 4), torch.randn(2, 1, 8, 4))


def test_qkv_and_block_mask_on_the_same_device():
    bm = create_block_mask(causal_mask, 1, 1, 8, 8, device="cpu").to("meta")
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(RuntimeError, match="device|meta"):
        flex_attention(q, q, q, block_mask=bm)


def test_block_mask_for_a_larger_batch_is_read_modulo():
    # PyTorch's kernels read batch z's tables at z % B (a mask made for 3 serves a batch of 2)
    bm = create_block_mask(batch_dependent_mask, 3, 1, 32, 32, device="cpu", BLOCK_SIZE=8)
    q, k, v = (_make((2, 1, 32, 4), torch.float64, i) for i in range(3))
    out = flex_attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(out, golden(q, k, v, mask_mod=batch_dependent_mask)[0], atol=1e-10, rtol=1e-10)


def test_block_mask_broadcast_over_batch_and_heads():
    # PyTorch: a block mask with B=1/H=1 broadcasts over query batch and heads
    q, k, v = (_make((3, 4, 40, 8), torch.float64, i) for i in range(3))
    bm = create_block_mask(causal_mask, 1, 1, 40, 40, device="cpu", BLOCK_SIZE=16)
    out = flex_attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(out, golden(q, k, v, mask_mod=causal_mask)[0], atol=1e-10, rtol=1e-10)


def test_create_block_mask_rejects_a_score_mod_and_bad_sizes():
    with pytest.raises(TypeError):
        create_block_mask(_rel_bias, 1, 1, 8, 8, device="cpu")
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        create_block_mask(causal_mask, 1, 1, 8, 8, device="cpu", BLOCK_SIZE=0)


def test_kernel_options_tuning_keys_are_accepted_and_do_not_change_results():
    q, k, v = (_make((1, 2, 50, 8), torch.float64, i) for i in range(3))
    bm = create_block_mask(causal_mask, 1, 1, 50, 50, device="cpu", BLOCK_SIZE=16)
    a = flex_attention(q, k, v, block_mask=bm)
    b = flex_attention(
        q, k, v, block_mask=bm, kernel_options={"BLOCK_M": 32, "num_warps": 4, "BACKEND": "AUTO"}
    )
    assert torch.equal(a, b)
    with pytest.warns(UserWarning, match="kernel_options"):  # PyTorch passes any key on to its kernels
        c = flex_attention(q, k, v, block_mask=bm, kernel_options={"NOT_A_KNOB": 1})
    assert torch.equal(a, c)


def test_does_not_mutate_inputs_and_matches_torch_eager_forward():
    q, k, v = (torch.randn(2, 2, 45, 12) for _ in range(3))
    saved = [t.clone() for t in (q, k, v)]
    bm = tfa.create_block_mask(sliding_window(7), 2, 2, 45, 45, device="cpu", BLOCK_SIZE=16)
    out = flex_attention(q, k, v, _trig, bm)
    for t, s in zip((q, k, v), saved, strict=True):
        assert torch.equal(t, s)
    ref = tfa.flex_attention(q, k, v, _trig, bm)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@functools.cache
def _sa_exports():
    return {n for n in ("flex_attention", "create_block_mask", "create_mask", "and_masks", "or_masks")
            if hasattr(sa, n)}  # fmt: skip


def test_top_level_exports():
    assert _sa_exports() == {"flex_attention", "create_block_mask", "create_mask", "and_masks", "or_masks"}


def test_score_mod_closing_over_a_float64_tensor_with_float32_inputs():
    # found here: the additive-bias probe compared float32 with float64 and raised "Double did not match Float"
    bias = torch.randn(S, dtype=torch.float64)

    def score_mod(score, b, h, q, kv):
        return score + bias[kv]

    q, k, v = (_make((1, 2, S, 8), torch.float32, i) for i in range(3))
    out = flex_attention(q, k, v, score_mod)
    assert out.dtype == torch.float32
    ref = golden(*(t.detach().double() for t in (q, k, v)), score_mod)[0]
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# More of PyTorch's score_mod cases: biases loaded from tensors, gates, poison values, strides, tiny sizes
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dims", ["seq", "seq_batch", "head_seq_batch", "rel"])
def test_load_from_bias(dims):
    g = torch.Generator().manual_seed(7)
    if dims == "seq":
        bias = torch.randn(S, S, generator=g, dtype=torch.float64)

        def bias_mod(score, b, h, q, kv):
            return score + bias[q, kv]
    elif dims == "seq_batch":
        bias = torch.randn(B, S, S, generator=g, dtype=torch.float64)

        def bias_mod(score, b, h, q, kv):
            return score + bias[b, q, kv]
    elif dims == "head_seq_batch":
        bias = torch.randn(B, H, S, S, generator=g, dtype=torch.float64)

        def bias_mod(score, b, h, q, kv):
            return score + bias[b, h, q, kv]
    else:
        bias = torch.randn(2 * S, generator=g, dtype=torch.float64)

        def bias_mod(score, b, h, q, kv):
            return score + bias[q - kv + S]

    run_test(bias_mod, causal_mask, block_size=(16, 32))


def test_head_specific_gate_and_silu():
    gate = torch.rand(H, dtype=torch.float64, requires_grad=True)

    def gated(score, b, h, q, kv):
        return torch.nn.functional.silu(score) * torch.sigmoid(gate[h])

    run_test(gated, sliding_window(12), captured=(gate,), block_size=16)


def test_poison_values_in_masked_positions_do_not_reach_gradients():
    # PyTorch's poison-mod idea: the score_mod yields NaN exactly where the mask hides the key
    def poison(score, b, h, q, kv):
        return score * torch.sqrt((q - kv).to(score.dtype))  # NaN for kv > q

    q, k, v = (_make((1, 2, 40, 8), torch.float64, i) for i in range(3))
    for bs in (128, 8):
        bm = create_block_mask(causal_mask, None, None, 40, 40, device="cpu", BLOCK_SIZE=bs)
        out = flex_attention(q, k, v, poison, bm)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert torch.isfinite(out).all() and all(torch.isfinite(t).all() for t in grads)


@pytest.mark.parametrize(("q_s", "kv_s"), [(1, 1), (1, 2), (2, 1), (3, 5)])
def test_small_q_kv_len(q_s, kv_s):
    run_test(_rel_bias, Q_S=q_s, KV_S=kv_s, QK_D=4)


def test_strided_inputs():
    # (B, T, H, D) storage viewed as (B, H, T, D), and a value with a transposed last two dims
    q = _make((2, 45, 4, 16), torch.float64, 0).detach().transpose(1, 2).requires_grad_()
    k = _make((2, 45, 4, 16), torch.float64, 1).detach().transpose(1, 2).requires_grad_()
    v = _make((2, 4, 16, 45), torch.float64, 2).detach().transpose(-1, -2).requires_grad_()
    bm = create_block_mask(causal_mask, None, None, 45, 45, device="cpu", BLOCK_SIZE=16)
    out = flex_attention(q, k, v, _trig, bm)
    ref = golden(*(t.detach().requires_grad_() for t in (q, k, v)), _trig, causal_mask)[0]
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def _naive_in_dtype(q, k, v, score_mod, mask_mod):
    """Eager math in the inputs' dtype (the softmax in float32, as torch's eager flex): the 'ref' of
    PyTorch's bf16/fp16 checks."""
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    idx = _grids(*s.shape)
    if score_mod is not None:
        s = score_mod(s, *idx).to(q.dtype)
    s = s.masked_fill(~mask_mod(*idx), -math.inf)
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "score_mod", [_identity, _rel_bias, _softcap], ids=lambda f: getattr(f, "__name__", "")
)
def test_half_precision_within_twice_the_naive_error_forward_and_backward(dtype, score_mod):
    # PyTorch's bf16/fp16 criterion: |ours − golden| ≤ fudge × |eager in that dtype − golden|, with
    # golden the same math in float64 on the same (rounded) inputs
    def mod(s, b, h, q, kv):
        return score_mod(s, b, h, q, kv) if score_mod is not _rel_bias else s + (q - kv) * 0.05

    g = torch.Generator().manual_seed(0)
    base = [torch.randn(2, 2, 97, 40, generator=g).to(dtype) for _ in range(3)]
    do = torch.randn(2, 2, 97, 40, generator=g).to(dtype)
    bm = create_block_mask(causal_mask, None, None, 97, 97, device="cpu", BLOCK_SIZE=32)
    results = []
    for fn, cast in ((None, dtype), ("naive", dtype), ("golden", torch.float64)):
        leaves = [t.to(cast).requires_grad_() for t in base]
        if fn is None:
            out = flex_attention(*leaves, mod, bm)
        else:
            out = _naive_in_dtype(*leaves, mod, causal_mask)
        results.append((out, *torch.autograd.grad(out, leaves, do.to(cast))))
    for ours, naive, gold in zip(*results, strict=True):
        assert ours.dtype == dtype
        assert (ours.double() - gold).abs().max() <= 2 * (naive.double() - gold).abs().max()
