"""selfattention.flash against a float64 per-sequence oracle (tests/flash_oracle.py): outputs, lse, gradients."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import selfattention.flash as flash_attn
from selfattention.flash import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    install_as_flash_attn,
)

from .flash_oracle import fa_sequence, fa_varlen

TOL64 = 1e-10


def _rand(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g, allow_unused=True)


def _close(a, b, tol=TOL64):
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, (a.shape, b.shape)
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin)
    assert torch.equal(a[~fin], b[~fin])
    err = (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= tol * (1 + b[fin].abs().max().item() if fin.any() else 1), err


CASES = [
    # (sq, sk, causal, window, softcap, alibi)
    (7, 7, False, (-1, -1), 0.0, False),
    (7, 13, True, (-1, -1), 0.0, False),
    (13, 7, True, (-1, -1), 0.0, False),  # rows above the diagonal see nothing
    (1, 9, True, (-1, -1), 0.0, False),
    (97, 97, True, (5, -1), 0.0, False),  # causal sliding window (engine)
    (11, 17, False, (2, 3), 0.0, False),  # two-sided, not causal
    (17, 11, False, (0, 0), 0.0, False),  # the diagonal only
    (9, 9, False, (3, -1), 0.0, False),  # left only, not causal: right = seqlen_k
    (9, 9, False, (-1, 2), 0.0, False),
    (10, 10, False, (-1, -1), 5.0, False),
    (10, 14, True, (-1, -1), 0.0, True),
    (14, 10, False, (4, 1), 2.0, True),
]


@pytest.mark.parametrize("sq,sk,causal,window,softcap,alibi", CASES)
@pytest.mark.parametrize("hk", [3, 1])
def test_func_matches_oracle(sq, sk, causal, window, softcap, alibi, hk):
    b, h, d = 2, 3, 13
    q, k, v = _rand(b, sq, h, d, seed=1), _rand(b, sk, hk, d, seed=2), _rand(b, sk, hk, d, seed=3)
    slopes = (
        torch.rand(b, h, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) if alibi else None
    )
    out, lse, s_dmask = flash_attn_func(
        q,
        k,
        v,
        causal=causal,
        window_size=window,
        softcap=softcap,
        alibi_slopes=slopes,
        return_attn_probs=True,
    )
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq) and s_dmask.numel() == 0
    g = _rand(*out.shape, seed=5).detach()
    got = _grads(out, (q, k, v), g)
    for bi in range(b):  # the loop over sequences lives here, in the test
        o_ref, l_ref = fa_sequence(
            q[bi], k[bi], v[bi], causal=causal, window=window, softcap=softcap,
            slopes=None if slopes is None else slopes[bi],
        )  # fmt: skip
        _close(out[bi], o_ref)
        _close(lse[bi], l_ref)
        want = _grads(o_ref, (q, k, v), g[bi])
        for gg, ww in zip(got, want, strict=True):
            _close(gg[bi], ww[bi] if ww is not None else torch.zeros_like(gg[bi]))


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


VARLEN = [
    # (query lengths, key lengths, causal, window, softcap, alibi)
    ([5, 0, 9, 1], [5, 0, 9, 1], True, (-1, -1), 0.0, False),  # the engine's documents path
    ([5, 3, 9], [5, 3, 9], False, (-1, -1), 0.0, False),
    ([3, 6, 2], [7, 6, 5], True, (-1, -1), 0.0, False),  # Tq != Tk per sequence
    ([4, 8, 0, 2], [2, 9, 3, 0], True, (2, -1), 0.0, False),  # empty sequences, windows
    ([6, 7], [6, 7], True, (2, -1), 0.0, False),
    ([6, 7, 3], [9, 4, 3], False, (1, 2), 0.0, False),
    ([6, 5], [8, 5], False, (-1, -1), 3.0, True),
    ([6, 5], [8, 5], True, (3, -1), 0.0, True),
    ([130, 0, 257], [200, 3, 257], True, (40, -1), 2.0, True),  # blocks of 128 that do not divide
    ([150, 260], [150, 300], False, (40, 7), 0.0, False),
]


@pytest.mark.parametrize("lq,lk,causal,window,softcap,alibi", VARLEN)
def test_varlen_matches_oracle(lq, lk, causal, window, softcap, alibi):
    h, hk, d = 4, 2, 11
    cq, ck = _cu(lq), _cu(lk)
    q, k, v = _rand(sum(lq), h, d, seed=1), _rand(sum(lk), hk, d, seed=2), _rand(sum(lk), hk, d, seed=3)
    slopes = torch.rand(len(lq), h, dtype=torch.float64) if alibi else None
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cq, ck, max(lq), max(lk), causal=causal, window_size=window, softcap=softcap,
        alibi_slopes=slopes, return_attn_probs=True,
    )  # fmt: skip
    o_ref, l_ref = fa_varlen(
        q, k, v, cq, ck, causal=causal, window=window, softcap=softcap, slopes=slopes, max_sk=max(lk)
    )
    _close(out, o_ref)
    _close(lse, l_ref)
    g = _rand(*out.shape, seed=7).detach()
    for a, b in zip(_grads(out, (q, k, v), g), _grads(o_ref, (q, k, v), g), strict=True):
        _close(a, b if b is not None else torch.zeros_like(a))


def test_paged_keys_equal_packed():
    lens, page = [5, 0, 9], 4
    cu = _cu(lens)
    q = _rand(sum(lens), 2, 8, seed=1)
    kp, vp = _rand(7, page, 1, 8, seed=2), _rand(7, page, 1, 8, seed=3)  # 7 pages of 4 keys
    table = torch.tensor([[3, 0, 6], [1, 1, 1], [5, 2, 4]], dtype=torch.int32)
    out = flash_attn_varlen_func(q, kp, vp, cu, cu, 9, 9, causal=True, block_table=table)
    k = torch.cat([kp[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lens)])  # loop in the test
    v = torch.cat([vp[table[b].long()].flatten(0, 1)[:n] for b, n in enumerate(lens)])
    _close(out, flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True))
    g = _rand(*out.shape, seed=4).detach()
    (dk,) = torch.autograd.grad(out, kp, g)
    (dk_ref,) = torch.autograd.grad(flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True), kp, g)
    _close(dk, dk_ref)
    with pytest.raises(ValueError, match="sequence 2 has 9 keys but block_table holds 8"):
        flash_attn_varlen_func(q, kp, vp, cu, cu, 9, 9, block_table=table[:, :2].contiguous())
    with pytest.raises(ValueError, match="block_table refers to blocks outside"):
        flash_attn_varlen_func(q, kp, vp, cu, cu, 9, 9, block_table=table + 5)


def test_varlen_empty_rows_are_zero_with_minus_inf_lse():
    cq, ck = _cu([3, 2]), _cu([0, 2])
    q, k = _rand(5, 2, 4), _rand(2, 2, 4)
    out, lse, _ = flash_attn_varlen_func(q, k, k, cq, ck, 3, 2, return_attn_probs=True)
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    assert torch.isinf(lse[:, :3]).all() and (lse[:, :3] < 0).all()
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(dq[:3], torch.zeros_like(dq[:3]))


def test_packed_variants_equal_unpacked():
    q, k, v = _rand(2, 9, 4, 8, seed=1), _rand(2, 9, 4, 8, seed=2), _rand(2, 9, 4, 8, seed=3)
    ref = flash_attn_func(q, k, v, causal=True)
    _close(flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), causal=True), ref)
    _close(flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True), ref)
    cu = _cu([9, 9])
    qf, kf, vf = (t.reshape(18, 4, 8) for t in (q, k, v))
    flat = ref.reshape(18, 4, 8)
    _close(flash_attn_varlen_qkvpacked_func(torch.stack([qf, kf, vf], 1), cu, 9, causal=True), flat)
    _close(flash_attn_varlen_kvpacked_func(qf, torch.stack([kf, vf], 1), cu, cu, 9, 9, causal=True), flat)
    qkv = torch.stack([q, k, v], 2).detach().requires_grad_()
    flash_attn_qkvpacked_func(qkv, causal=True).sum().backward()
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    _close(qkv.grad, torch.stack(want, 2))


def test_dropout_reproducible_and_backward_replays_the_mask():
    b, sq, sk, h, d, p = 2, 12, 17, 2, 8, 0.3
    q, k, v = _rand(b, sq, h, d, seed=1), _rand(b, sk, h, d, seed=2), _rand(b, sk, h, d, seed=3)
    torch.manual_seed(11)
    out1, lse1, sd = flash_attn_func(q, k, v, p, causal=True, return_attn_probs=True)
    torch.manual_seed(11)
    out2 = flash_attn_func(q, k, v, p, causal=True)
    assert torch.equal(out1, out2)
    out3 = flash_attn_func(q, k, v, p, causal=True)
    assert not torch.equal(out1, out3)  # the generator moved on: another mask
    assert sd.shape == (b, h, sq, sk)
    keep = sd >= 0
    g = _rand(*out1.shape, seed=9).detach()
    got = _grads(out1, (q, k, v), g)
    vis_frac = []
    for bi in range(b):
        o_ref, l_ref = fa_sequence(q[bi], k[bi], v[bi], causal=True, keep=keep[bi], dropout_p=p)
        _close(out1[bi], o_ref)
        _close(lse1[bi], l_ref)  # lse is before dropout
        want = _grads(o_ref, (q, k, v), g[bi])
        for gg, ww in zip(got, want, strict=True):
            _close(gg[bi], ww[bi])
        vis = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        vis_frac.append((~keep[bi][:, vis]).double().mean())
    assert abs(float(sum(vis_frac) / b) - p) < 0.08


def test_varlen_dropout_s_dmask_per_sequence():
    lq, lk, p = [3, 5], [4, 5], 0.25
    cq, ck = _cu(lq), _cu(lk)
    q, k, v = _rand(8, 2, 4, seed=1), _rand(9, 2, 4, seed=2), _rand(9, 2, 4, seed=3)
    torch.manual_seed(3)
    out, lse, sd = flash_attn_varlen_func(q, k, v, cq, ck, 5, 5, p, causal=True, return_attn_probs=True)
    assert sd.shape == (2, 2, 5, 5)
    assert torch.equal(sd[0, :, 3:], torch.zeros_like(sd[0, :, 3:]))  # outside sequence 0
    o_ref, _ = fa_varlen(q, k, v, cq, ck, causal=True, keep=sd >= 0, dropout_p=p)
    _close(out, o_ref)


def test_bfloat16_within_twice_naive_error():
    b, s, h, d = 2, 67, 4, 24
    q64, k64, v64 = (_rand(b, s, h, d, seed=i).detach() for i in (1, 2, 3))
    ref = torch.stack([fa_sequence(q64[i], k64[i], v64[i], causal=True)[0] for i in range(b)])
    qb, kb, vb = (t.bfloat16() for t in (q64, k64, v64))
    got = flash_attn_func(qb, kb, vb, causal=True)
    assert got.dtype == torch.bfloat16
    s_ = torch.einsum("bihd,bjhd->bhij", qb, kb) / math.sqrt(d)
    s_ = s_.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), -math.inf)
    naive = torch.einsum("bhij,bjhd->bihd", torch.softmax(s_, -1), vb)
    err = (got.double() - ref).abs().max().item()
    err_naive = (naive.double() - ref).abs().max().item()
    assert err <= 2 * err_naive, (err, err_naive)


def test_float32_engine_path_matches_oracle():
    lens = [100, 7, 250, 33]
    cu = _cu(lens)
    q, k, v = (_rand(sum(lens), 4, 16, dtype=torch.float32, seed=i) for i in (1, 2, 3))
    out = flash_attn_varlen_func(q, k, v, cu, cu, 250, 250, causal=True)
    o_ref, _ = fa_varlen(q, k, v, cu, cu, causal=True)
    _close(out, o_ref, 1e-5)


def test_one_line_switch_and_install():
    assert flash_attn.flash_attn_func is flash_attn_func
    saved = {
        n: sys.modules.pop(n) for n in ("flash_attn", "flash_attn.flash_attn_interface") if n in sys.modules
    }
    try:
        install_as_flash_attn()
        from flash_attn import flash_attn_varlen_func as f  # noqa: PLC0415
        from flash_attn.flash_attn_interface import flash_attn_func as g  # noqa: PLC0415

        assert f is flash_attn_varlen_func and g is flash_attn_func
    finally:
        for n in ("flash_attn", "flash_attn.flash_attn_interface"):
            sys.modules.pop(n, None)
        sys.modules.update(saved)


# ------------------------------------------------------------------------------------------------ errors

Q = torch.randn(4, 2, 8)
CU = torch.tensor([0, 1, 4], dtype=torch.int32)


@pytest.mark.parametrize(
    "kwargs,exc,words",
    [
        ({"cu_seqlens_q": CU.long()}, TypeError, "cu_seqlens_q must have dtype torch.int32"),
        ({"cu_seqlens_k": CU[None]}, ValueError, "cu_seqlens_k must be 1-D"),
        ({"cu_seqlens_q": torch.tensor([1, 2, 4], dtype=torch.int32)}, ValueError, "must start at 0"),
        ({"cu_seqlens_q": torch.tensor([0, 3, 2, 4], dtype=torch.int32)}, ValueError, "non-decreasing"),
        (
            {"cu_seqlens_k": torch.tensor([0, 1, 3], dtype=torch.int32)},
            ValueError,
            "must end at the number of tokens (4)",
        ),
        ({"max_seqlen_q": 2}, ValueError, "max_seqlen_q=2 is smaller than sequence 1's length 3"),
        ({"max_seqlen_k": 2.5}, TypeError, "max_seqlen_k must be an int"),
        ({"window_size": (-2, 0)}, ValueError, "window_size[0] must be >= -1"),
        ({"window_size": (1,)}, ValueError, "window_size must be a pair"),
        ({"softcap": -1.0}, ValueError, "softcap must be >= 0"),
        ({"alibi_slopes": torch.ones(3)}, ValueError, "alibi_slopes must have shape (2,) or (2, 2)"),
        ({"dropout_p": 1.0}, ValueError, "dropout_p"),
        ({"causal": 1}, TypeError, "causal must be a bool"),
        (
            {"k": torch.randn(4, 3, 8), "v": torch.randn(4, 3, 8)},
            ValueError,
            "nheads_k=3 must divide nheads=2",
        ),
        ({"k": torch.randn(4, 2, 7), "v": torch.randn(4, 2, 7)}, ValueError, "headdim mismatch"),
        ({"v": torch.randn(4, 2, 7)}, ValueError, "must have the same shape"),
        ({"v": torch.randn(4, 2, 8, dtype=torch.float64)}, TypeError, "v has dtype torch.float64"),
        ({"q": torch.randn(4, 2, 8, device="meta")}, ValueError, "is on"),
        (
            {"k": torch.randn(2, 4, 2, 8), "v": torch.randn(2, 4, 2, 8), "block_table": torch.zeros(2, 1)},
            TypeError,
            "block_table must be an int32 tensor",
        ),
        ({"block_table": torch.zeros(2, 1, dtype=torch.int32)}, ValueError, "k must have shape (num_blocks"),
    ],
)
def test_varlen_errors(kwargs, exc, words):
    args = {
        "q": Q,
        "k": Q,
        "v": Q,
        "cu_seqlens_q": CU,
        "cu_seqlens_k": CU,
        "max_seqlen_q": 3,
        "max_seqlen_k": 3,
    }
    args.update(kwargs)
    with pytest.raises(exc) as e:
        flash_attn_varlen_func(**args)
    assert words in str(e.value)


def test_func_errors():
    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(ValueError, match=r"q must have shape \(batch, seqlen_q, nheads, headdim\)"):
        flash_attn_func(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="batch size mismatch"):
        flash_attn_func(q, torch.cat([q, q]), torch.cat([q, q]))
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(2,\) or \(1, 2\)"):
        flash_attn_func(q, q, q, alibi_slopes=torch.ones(2, 2))
    with pytest.raises(ValueError, match="qkv must have shape"):
        flash_attn_qkvpacked_func(q)
    with pytest.raises(TypeError, match="softmax_scale"):
        flash_attn_func(q, q, q, softmax_scale="x")


@pytest.mark.parametrize(
    "kw", [{}, {"causal": True}, {"softcap": 5.0}, {"alibi_slopes": torch.tensor([0.7, 0.1])}]
)
def test_a_varlen_batch_where_no_query_sees_a_key_stays_in_the_graph(kw):
    """Sequence 0 has 3 queries and no key, sequence 1 keys and no query: output zeros, and a backward that
    gives zero gradients (flash-attn's output always has a grad_fn). With softcap or ALiBi the output came
    back detached and ``backward`` raised (a breaker run)."""
    cuq = torch.tensor([0, 3, 3], dtype=torch.int32)
    cuk = torch.tensor([0, 0, 3], dtype=torch.int32)
    q, k, v = (torch.randn(3, 2, 16, requires_grad=True) for _ in range(3))
    out = flash_attn_varlen_func(q, k, v, cuq, cuk, 3, 3, **kw)
    assert out.requires_grad and torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))


def test_flags_take_numpy_bools_and_name_other_types():
    """``causal=np.bool_(True)`` (a flag read from a numpy config) works as True; 1 or a tensor is refused
    with the type named by its module (the message said "must be a bool, got bool" for numpy's)."""
    np = pytest.importorskip("numpy")
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
    assert torch.equal(flash_attn_func(q, k, v, causal=np.bool_(True)), flash_attn_func(q, k, v, causal=True))
    with pytest.raises(TypeError, match=r"causal must be a bool, got torch\.Tensor$"):
        flash_attn_func(q, k, v, causal=torch.tensor(True))
    with pytest.raises(TypeError, match=r"causal must be a bool, got int \(1\)"):
        flash_attn_func(q, k, v, causal=1)
