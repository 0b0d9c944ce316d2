"""Attention states in public: return_lse on every backend, merge_states (exact, associative, −inf-safe)."""

from __future__ import annotations

import math

import pytest
import torch

from selfattention import merge_states, scaled_dot_product_attention
from selfattention.kernels.merge import merge_into

BACKENDS = ["reference", "torch", "tiled"]


def _rand(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()


def _lse_oracle(q, k, visible, scale):
    """log Σ_j exp(scale q_i·k_j) over visible keys, by loops over rows (float64); −inf when none."""
    q, k = q.detach().double(), k.detach().double()
    out = torch.empty(q.shape[:-1], dtype=torch.float64)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in q.shape[:-1]]).tolist():
        *lead, i = idx
        row = [scale * float(q[(*lead, i)] @ k[(*lead, j)]) for j in range(k.shape[-2]) if visible[i, j]]
        out[tuple(idx)] = math.log(sum(math.exp(x) for x in row)) if row else -math.inf
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tq,tk", [(7, 7), (5, 11), (11, 5)])
def test_return_lse_matches_oracle(backend, tq, tk):
    q, k, v = _rand(2, 3, tq, 6, seed=1), _rand(2, 3, tk, 6, seed=2), _rand(2, 3, tk, 5, seed=3)
    out, lse = scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend, return_lse=True)
    visible = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
    want = _lse_oracle(q, k, visible, 6**-0.5)
    assert lse.shape == (2, 3, tq)
    assert torch.equal(torch.isinf(lse), torch.isinf(want))
    fin = torch.isfinite(want)
    assert (lse[fin].double() - want[fin]).abs().max() < 1e-10
    assert torch.equal(out, scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_return_lse_blind_rows_and_gqa(backend):
    q, k, v = _rand(1, 4, 6, 8, seed=1), _rand(1, 2, 9, 8, seed=2), _rand(1, 2, 9, 8, seed=3)
    mask = torch.rand(6, 9, generator=torch.Generator().manual_seed(5)) > 0.4
    mask[2] = False
    out, lse = scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, backend=backend, return_lse=True)
    want = _lse_oracle(q, k.repeat_interleave(2, 1), mask, 8**-0.5)
    assert torch.isneginf(lse[..., 2]).all() and torch.isneginf(want[..., 2]).all()
    fin = torch.isfinite(want)
    assert (lse[fin].double() - want[fin]).abs().max() < 1e-10


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_gradient(backend):
    q, k, v = _rand(1, 2, 9, 5, seed=1), _rand(1, 2, 13, 5, seed=2), _rand(1, 2, 13, 5, seed=3)
    mask = torch.ones(9, 13, dtype=torch.bool)
    mask[4] = False  # a blind row: zero gradient, no NaN
    out, lse = scaled_dot_product_attention(q, k, v, mask, backend=backend, return_lse=True)
    w = torch.randn(9, dtype=torch.float64)
    loss = out.sum() + (torch.where(torch.isinf(lse), 0.0, lse) * w).sum()
    got = torch.autograd.grad(loss, (q, k, v))
    s = (q @ k.transpose(-1, -2)) * 5**-0.5
    s = s.masked_fill(~mask, -math.inf)
    w_ = torch.softmax(s, -1).nan_to_num(0.0)
    ref_out = w_ @ v
    ref_lse = torch.logsumexp(s.masked_fill(~mask, -1e300), -1)
    ref_loss = ref_out.sum() + (torch.where(mask.any(-1), ref_lse, 0.0) * w).sum()
    want = torch.autograd.grad(ref_loss, (q, k, v))
    for a, b in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        assert (a - b).abs().max() < 1e-10


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_gradient_reaches_a_learned_mask(backend):
    q, k = _rand(1, 1, 5, 4, seed=1), _rand(1, 1, 7, 4, seed=2)
    bias = _rand(5, 7, seed=3)
    _, lse = scaled_dot_product_attention(q, k, k, bias, backend=backend, return_lse=True)
    (got,) = torch.autograd.grad(lse.sum(), bias)
    want = torch.softmax(q @ k.transpose(-1, -2) * 0.5 + bias, -1)[0, 0]  # d lse_i / d bias_ij = P_ij
    assert (got - want).abs().max() < 1e-10


def test_return_lse_must_be_bool():
    q = torch.randn(2, 4)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        scaled_dot_product_attention(q, q, q, return_lse=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_halves_merged_equal_the_whole_with_gradients(backend):
    q, k, v = _rand(2, 2, 5, 8, seed=1), _rand(2, 2, 37, 8, seed=2), _rand(2, 2, 37, 4, seed=3)
    whole, whole_lse = scaled_dot_product_attention(q, k, v, backend=backend, return_lse=True)
    a = scaled_dot_product_attention(q, k[:, :, :20], v[:, :, :20], backend=backend, return_lse=True)
    b = scaled_dot_product_attention(q, k[:, :, 20:], v[:, :, 20:], backend=backend, return_lse=True)
    out, lse = merge_states(*a, *b)
    assert (out - whole).abs().max() < 1e-12 and (lse - whole_lse).abs().max() < 1e-12
    g = torch.randn_like(out)
    for x, y in zip(
        torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(whole, (q, k, v), g), strict=True
    ):
        assert (x - y).abs().max() < 1e-12


def test_merge_is_associative_and_commutative():
    parts = [(_rand(3, 4, 6, seed=i).detach(), _rand(3, 4, seed=10 + i).detach()) for i in range(3)]
    parts[1][1][0, 2] = -math.inf  # a row that saw nothing in one part
    (a, la), (b, lb), (c, lc) = parts
    left = merge_states(*merge_states(a, la, b, lb), c, lc)
    right = merge_states(a, la, *merge_states(b, lb, c, lc))
    swapped = merge_states(*merge_states(c, lc, a, la), b, lb)
    for x, y in zip(left, right, strict=True):
        assert (x - y).abs().max() < 1e-12
    for x, y in zip(left, swapped, strict=True):
        assert (x - y).abs().max() < 1e-12


def test_merge_minus_inf_is_safe_with_gradients():
    oa = torch.tensor([[1.0, 2.0], [float("nan"), 3.0]], dtype=torch.float64, requires_grad=True)
    la = torch.tensor([-math.inf, -math.inf], dtype=torch.float64, requires_grad=True)
    ob = torch.tensor([[0.0, 0.0], [5.0, 6.0]], dtype=torch.float64, requires_grad=True)
    lb = torch.tensor([-math.inf, 0.5], dtype=torch.float64, requires_grad=True)
    out, lse = merge_states(oa, la, ob, lb)
    assert out.tolist() == [
        [0.0, 0.0],
        [5.0, 6.0],
    ]  # row 0 saw nothing anywhere; row 1: b alone (a's NaN unused)
    assert lse[0] == -math.inf and lse[1] == 0.5
    grads = torch.autograd.grad(out.sum() + torch.where(torch.isinf(lse), 0.0, lse).sum(), (oa, la, ob, lb))
    for gr in grads:
        assert torch.isfinite(gr).all()
    assert grads[0].abs().sum() == 0 and grads[1].abs().sum() == 0  # a contributed nothing
    assert grads[3][1] == 1.0  # d lse / d lse_b where b is everything


def test_merge_gradients_against_the_formula():
    oa, ob = _rand(4, 3, seed=1), _rand(4, 3, seed=2)
    la, lb = _rand(4, seed=3), _rand(4, seed=4)
    out, lse = merge_states(oa, la, ob, lb)
    ref_lse = torch.logaddexp(la, lb)
    ref = torch.exp(la - ref_lse)[:, None] * oa + torch.exp(lb - ref_lse)[:, None] * ob
    g = torch.randn(4, 3, dtype=torch.float64)
    got = torch.autograd.grad((out * g).sum() + lse.sum(), (oa, la, ob, lb))
    want = torch.autograd.grad((ref * g).sum() + ref_lse.sum(), (oa, la, ob, lb))
    for x, y in zip(got, want, strict=True):
        assert (x - y).abs().max() < 1e-12


def test_merge_into_uses_the_same_formula():
    oa, ob = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
    la, lb = torch.randn(2, 5), torch.randn(2, 5)
    la[0, 1] = lb[0, 1] = -math.inf
    want = merge_states(oa, la, ob, lb)
    acc, acc_lse = oa.clone(), la.clone()
    merge_into(acc, acc_lse, ob, lb)
    assert torch.equal(acc, want[0]) and torch.equal(acc_lse, want[1])


def test_merge_errors():
    o, l = torch.zeros(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="lse must have the shape of out without its last dim"):
        merge_states(o, torch.zeros(3), o, l)
    with pytest.raises(ValueError, match="out_a .* and out_b .* differ"):
        merge_states(o, l, torch.zeros(3, 3), torch.zeros(3))
    with pytest.raises(TypeError, match="floating"):
        merge_states(o.long(), l, o, l)


@pytest.mark.parametrize("backend", BACKENDS)
def test_document_pairs_align_causal_per_document(backend):
    """SDPA-shaped packed problems: (query ids, key ids) with causal, each document bottom-right on its own
    keys — the same as flash-attn's varlen with those lengths (chunked prefill in a packed batch)."""
    from selfattention.tiled import tiled_attention

    from .flash_oracle import fa_varlen

    lq, lk = [1, 2, 3], [3, 3, 5]
    q_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lq))
    k_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lk))
    q, k, v = _rand(1, 2, 6, 4, seed=1), _rand(1, 2, 11, 4, seed=2), _rand(1, 2, 11, 4, seed=3)
    cu_q = torch.tensor([0, 1, 3, 6])
    cu_k = torch.tensor([0, 3, 6, 11])
    want, _ = fa_varlen(
        q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_q, cu_k, causal=True
    )
    if backend == "tiled":
        got = tiled_attention(q, k, v, is_causal=True, document_ids=(q_ids, k_ids), block_q=2, block_k=3)
    else:
        from selfattention import Visibility

        vis = Visibility(6, 11, is_causal=True, q_doc=q_ids[None], k_doc=k_ids[None], doc_offset=0)
        got = scaled_dot_product_attention(q, k, v, vis, backend=backend)
    assert (got[0].transpose(0, 1) - want).abs().max() < 1e-10
