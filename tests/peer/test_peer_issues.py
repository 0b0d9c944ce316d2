"""Public bug reports of other attention libraries, turned into regression tests against ours.

Each test names the report it comes from (read for the facts; the code is ours). The oracle is the dense
float64 golden of tests/peer/test_torch_flex_peer.py or torch's SDPA math backend.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as tfa

import selfattention as sa
from selfattention.flex import AuxRequest, create_block_mask, flex_attention

from .test_torch_flex_peer import _grads, _make, golden, run_test

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
BACKENDS = ["reference", "torch", "tiled"]


def causal(b, h, q, kv):
    return q >= kv


def test_pytorch_153799_no_nan_in_backward_with_block_mask_score_mod_and_1025_tokens():
    # pytorch/pytorch#153799: NaN in the backward when both block_mask and score_mod are used and the length
    # is not a multiple of 128. Ours: finite, and within 1e-4 of the float64 golden relative to the
    # gradients' size (the bias q − kv reaches 1024, so the lse is ~1000 and float32 rounding is ~1e-4).
    S = 1025
    q, k, v = (_make((1, 1, S, 64), torch.float32, i) for i in range(3))

    def rel(score, b, h, qi, kv):
        return score + (qi - kv)

    bm = create_block_mask(causal, None, None, S, S, device="cpu")
    out, lse = flex_attention(q, k, v, rel, bm, return_lse=True)
    ours = _grads(out, lse, (q, k, v))
    g64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    go, gl = golden(*g64, rel, causal)
    gold = _grads(go, gl, g64)
    for a, e in zip((out, *ours), (go, *gold), strict=True):
        assert torch.isfinite(a).all()
        assert (a.double() - e).abs().max() <= 1e-4 * e.abs().max()


def test_pytorch_185991_score_mod_that_ignores_the_score_has_zero_query_key_gradient():
    # pytorch/pytorch#185991: a score_mod independent of the score broke flex's backward. torch's flex
    # gives query/key zero gradients; ours raised ("does not require grad" / "not used in the graph").
    q, k, v = (_make((1, 2, 40, 8), torch.float64, i) for i in range(3))

    def positional(score, b, h, qi, kv):
        return torch.zeros_like(score) - 0.1 * (qi - kv).abs()

    out = flex_attention(q, k, v, positional)
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert gq.abs().sum() == 0 and gk.abs().sum() == 0
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    ref = golden(qq, kk, vv, positional)[0]
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    (ev,) = torch.autograd.grad(ref.sum(), (vv,))
    torch.testing.assert_close(gv, ev, atol=1e-10, rtol=1e-10)
    q_only = flex_attention(q, k.detach(), v.detach(), positional)  # only query requires grad
    assert torch.autograd.grad(q_only.sum(), q)[0].abs().sum() == 0


def test_pytorch_145208_learned_scalar_multiplying_the_score():
    # pytorch/pytorch#145208: `score * result` with a 0-d tensor that requires grad failed to lower
    result = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)

    def score_mod(score, b, h, q, kv):
        return score * result

    run_test(score_mod, Q_B=1, Q_H=1, Q_S=300, QK_D=16, captured=(result,))


def test_pytorch_145460_chained_indexing_of_a_captured_tensor_with_grad():
    # pytorch/pytorch#145460: score_mod reading attn_mask[batch][head][0][kv_idx] of a learned tensor
    A = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    dt = torch.randn(1, 1, 33, dtype=torch.float64)
    q, k, v = (_make((1, 1, 33, 8), torch.float64, i) for i in range(3))

    def dynamic_mod_of(A, chained):
        dynamic = torch.exp(A * dt)[:, :, None, :]

        def dynamic_mod(score, batch, head, q_idx, kv_idx):
            if chained:  # as in the report (our flex falls back to vmap for it)
                return score + dynamic[batch][head][0][kv_idx]
            return score + dynamic[batch, head, 0, kv_idx]  # the golden's dense grids: one index

        return dynamic_mod

    out = flex_attention(q, k, v, dynamic_mod_of(A, True))
    A2 = A.detach().requires_grad_()
    ref = golden(q.detach(), k.detach(), v.detach(), dynamic_mod_of(A2, False))[0]
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), A)[0], torch.autograd.grad(ref.sum(), A2)[0])


def test_attention_gym_37_lse_with_gqa_is_the_real_logsumexp():
    # meta-pytorch/attention-gym#37: flex's lse came back all zeros with enable_gqa
    q, k = torch.randn(2, 8, 64, 16), torch.randn(2, 2, 64, 16)
    _, lse = flex_attention(q, k, k, enable_gqa=True, return_lse=True)
    ref = torch.logsumexp(q.double() @ k.double().repeat_interleave(4, 1).transpose(-1, -2) / 4, -1)
    torch.testing.assert_close(lse.double(), ref, atol=1e-5, rtol=1e-5)
    _, aux = flex_attention(q, k, k, enable_gqa=True, return_aux=AuxRequest(lse=True))
    torch.testing.assert_close(aux.lse, lse)


def test_pytorch_181645_lse_is_natural_log_not_log2():
    # pytorch/pytorch#181645: lse off by a factor ln 2 on one backend
    q = torch.randn(1, 2, 50, 8, dtype=torch.float64)
    bm = create_block_mask(causal, 1, 1, 50, 50, device="cpu", BLOCK_SIZE=16)
    for block_mask, score_mod in ((None, None), (bm, None), (bm, torch.nn.functional.softplus)):
        mod = None if score_mod is None else (lambda s, b, h, qi, kv, f=score_mod: f(s))
        _, lse = flex_attention(q, q, q, mod, block_mask, return_lse=True)
        s = q @ q.transpose(-1, -2) / math.sqrt(8)
        if mod is not None:
            s = score_mod(s)
        if block_mask is not None:
            s = s.masked_fill(~torch.ones(50, 50, dtype=torch.bool).tril(), -math.inf)
        torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-10, rtol=1e-10)


def test_pytorch_136232_block_mask_longer_than_the_sequence_is_refused_not_nan():
    # pytorch/pytorch#136232: a BlockMask made for a longer sequence gave NaN in the backward; torch now
    # raises, so do we (with a message naming both lengths); _adjust crops it.
    bm = create_block_mask(causal, None, None, 4096, 4096, device="cpu")
    q, k, v = (_make((1, 2, 1000, 8), torch.float32, i) for i in range(3))
    with pytest.raises(ValueError, match="4096"):
        flex_attention(q, k, v, block_mask=bm, return_lse=True)
    out, lse = flex_attention(q, k, v, block_mask=bm._adjust(1000, 1000), return_lse=True)
    (out * torch.exp(lse)[..., None]).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_attention_gym_71_q_len_kv_len_with_a_block_size_dividing_neither():
    # meta-pytorch/attention-gym#71: cross attention, Q_LEN ≠ KV_LEN, BLOCK_SIZE not a common divisor
    docs_q = torch.tensor([0] * 30 + [1] * 21)
    docs_k = torch.tensor([0] * 47 + [1] * 36)

    def doc(b, h, q, kv):
        return docs_q[q] == docs_k[kv]

    ours = create_block_mask(doc, 1, 1, 51, 83, device="cpu", BLOCK_SIZE=(16, 20))
    theirs = tfa.create_block_mask(doc, 1, 1, 51, 83, device="cpu", BLOCK_SIZE=(16, 20))
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    run_test(mask_mod=doc, Q_B=1, Q_H=2, Q_S=51, KV_S=83, block_size=(16, 20))


def test_bd3lms_23_block_size_changes_only_speed_never_the_mask():
    # kuleshov-group/bd3lms#23: a mask whose pattern has its own "block size" (block-diffusion) built with
    # the default BLOCK_SIZE=128: the attention must equal the dense mask whatever BLOCK_SIZE is.
    n, blk = 40, 6

    def block_causal(b, h, q, kv):
        return q // blk >= kv // blk

    q, k, v = (_make((1, 1, n, 8), torch.float64, i) for i in range(3))
    ref = golden(q, k, v, mask_mod=block_causal)[0]
    for size in (128, 16, (8, 5), 1):
        bm = create_block_mask(block_causal, None, None, n, n, device="cpu", BLOCK_SIZE=size)
        torch.testing.assert_close(flex_attention(q, k, v, block_mask=bm), ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_103963_bool_mask_with_empty_rows_gives_zeros(backend):
    # pytorch/pytorch#103963: a bool attn_mask with all-False rows gave NaN
    q, k, v = (torch.rand(1, 1, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    mask[..., :4, :4] = True
    out = sa.scaled_dot_product_attention(q, k, v, mask, backend=backend)
    assert out[..., 4:, :].abs().sum() == 0 and torch.isfinite(out).all()
    ref = torch.nn.functional.scaled_dot_product_attention(q[..., :4, :], k[..., :4, :], v[..., :4, :])
    torch.testing.assert_close(out[..., :4, :], ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_41508_fully_masked_row_does_not_poison_the_batch_gradients(backend):
    # pytorch/pytorch#41508 (and lucidrains/nGPT-pytorch#11, ml-explore/mlx#2608): one fully masked query
    # made every gradient of the batch NaN through 0 · NaN
    x = torch.randn(2, 1, 4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    keep = torch.tensor([[True, True, True, True], [True, True, False, False]]).view(2, 1, 1, 4)
    band = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    mask = keep & band  # query 3 of batch 1 sees nothing
    h = x @ w
    out = sa.scaled_dot_product_attention(h, h, h, mask, backend=backend)
    out[:, :, :3].sum().backward()
    assert torch.isfinite(w.grad).all() and torch.isfinite(x.grad).all()
    assert out[1, 0, 3].abs().sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_109517_finfo_min_float_mask_on_whole_key_blocks(backend):
    # pytorch/pytorch#109517: a float mask of finfo.min on the first 128 keys gave NaN on a fused kernel
    q, k, v = (torch.randn(2, 2, 141, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.zeros(2, 2, 141, 141)
    mask[..., :128] = torch.finfo(torch.float32).min
    out = sa.scaled_dot_product_attention(q, k, v, mask, backend=backend)
    ref = torch.nn.functional.scaled_dot_product_attention(q[..., :, :], k[..., 128:, :], v[..., 128:, :])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mlx_lm_1467_gqa_with_a_batched_padding_mask(backend):
    # ml-explore/mlx-lm#1467: GQA + a (B, 1, L, L) padding mask crashed for B ≥ 2 (the mask's B axis was
    # broadcast against the kv-head axis after the grouped reshape)
    q = torch.randn(2, 8, 6, 16, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(2, 2, 6, 16, dtype=torch.float64), torch.randn(2, 2, 6, 16, dtype=torch.float64)
    keep = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    keep[1, ..., :2] = False  # batch 1: two padding tokens on the left
    out = sa.scaled_dot_product_attention(q, k, v, keep, enable_gqa=True, backend=backend)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, keep, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(
        torch.autograd.grad(out.sum(), q)[0], torch.autograd.grad(ref.sum(), q)[0], atol=1e-10, rtol=1e-10
    )


def test_mlx_lm_1467_flex_gqa_with_a_per_batch_block_mask():
    lengths = torch.tensor([40, 23])

    def padding(b, h, q, kv):
        return kv < lengths[b]

    run_test(mask_mod=padding, Q_B=2, Q_H=8, KV_H=2, Q_S=40, QK_D=8, block_size=16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pytorch_120810_mask_broadcast_over_extra_batch_dims(backend):
    # pytorch/pytorch#120810: a (1, 1, S) mask broadcasts against (B, 2, 4, L, S) scores
    q = torch.rand(3, 2, 4, 7, 16, dtype=torch.float64)
    k, v = torch.rand(3, 2, 4, 5, 16, dtype=torch.float64), torch.rand(3, 2, 4, 5, 32, dtype=torch.float64)
    mask = torch.zeros(1, 1, 5, dtype=torch.bool)
    mask[..., 2:] = True
    out = sa.scaled_dot_product_attention(q, k, v, mask, backend=backend)
    assert out.shape == (3, 2, 4, 7, 32)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, mask))


@pytest.mark.parametrize("backend", BACKENDS)
def test_skainet_860_scale_none_is_one_over_sqrt_d_and_zero_is_zero(backend):
    # SKaiNET#860 (and the `scale or 1/sqrt(d)` family): the default and an explicit 0.0 must differ
    q, k, v = (torch.randn(1, 1, 3, 2, generator=torch.Generator().manual_seed(i)) for i in range(3))
    default = sa.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    explicit = sa.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=1 / math.sqrt(2), backend=backend
    )
    zero = sa.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.0, backend=backend)
    torch.testing.assert_close(default, explicit)
    means = torch.cumsum(v, 2) / torch.arange(1, 4).view(1, 1, 3, 1)
    torch.testing.assert_close(zero, means)
    assert not torch.allclose(default, zero)
