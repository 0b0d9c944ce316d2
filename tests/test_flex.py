"""flex_attention / create_block_mask against a float64 oracle written here, and against torch's own flex.

The oracle materialises the scores in float64, applies the score_mod and the mask_mod densely on full
index grids, takes a softmax with zeros for rows that see nothing, and differentiates with autograd.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import selfattention as sa
from selfattention import flex, flex_masks, mods
from selfattention.flex import AuxRequest

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def grids(b, h, tq, tk):
    return (
        torch.arange(b).view(-1, 1, 1, 1).expand(b, h, tq, tk),
        torch.arange(h).view(1, -1, 1, 1).expand(b, h, tq, tk),
        torch.arange(tq).view(1, 1, -1, 1).expand(b, h, tq, tk),
        torch.arange(tk).view(1, 1, 1, -1).expand(b, h, tq, tk),
    )


def elementwise(fn, b, h, tq, tk, score=None):
    """fn on every (b, h, q, kv) one at a time (torch.vmap over the four index axes), (B, H, Tq, Tk)."""
    f = fn
    pre = () if score is None else (0,)
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        f = torch.vmap(f, in_dims=pre + dims)
    idx = (torch.arange(b), torch.arange(h), torch.arange(tq), torch.arange(tk))
    return f(*idx) if score is None else f(score, *idx)


def oracle(q, k, v, mask_mod=None, score_mod=None, scale=None):
    """(out, lse) in float64 with autograd; inputs are the float64 leaves."""
    b, h, tq, d = q.shape
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    tk = k.shape[2]
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(d) if scale is None else scale)
    if score_mod is not None:
        s = elementwise(score_mod, b, h, tq, tk, score=s)
    if mask_mod is not None:
        keep = elementwise(mask_mod, b, h, tq, tk)
        s = torch.where(keep, s, torch.full((), -math.inf, dtype=s.dtype))
    blind = torch.isneginf(s).all(-1, keepdim=True)
    s_safe = torch.where(blind, torch.zeros((), dtype=s.dtype), s)
    p = torch.softmax(s_safe, -1).masked_fill(blind, 0.0)
    lse = torch.logsumexp(s_safe, -1).masked_fill(blind.squeeze(-1), -math.inf)
    return p @ v, lse


def inputs(b, h, hk, tq, tk, d, dv, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=gen)
    k = torch.randn(b, hk, tk, d, generator=gen)
    v = torch.randn(b, hk, tk, dv, generator=gen)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def check(
    q, k, v, mask_mod=None, score_mod=None, score_mod64=None, block=128, captured=(), lse_grad=True, gqa=False
):
    b, h, tq, _ = q.shape
    tk = k.shape[2]
    bm = (
        None
        if mask_mod is None
        else sa.create_block_mask(mask_mod, b, h, tq, tk, device="cpu", BLOCK_SIZE=block)
    )
    out, lse = sa.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, return_lse=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    cap64 = [c.detach().double().requires_grad_() for c in captured]
    ref, ref_lse = oracle(q64, k64, v64, mask_mod, score_mod64(*cap64) if score_mod64 else score_mod)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    dl = (
        torch.randn(ref_lse.shape, generator=gen, dtype=torch.float64)
        if lse_grad
        else torch.zeros(ref_lse.shape)
    )
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    tol = 1e-5 if q.dtype == torch.float32 else 1e-10
    assert (out.double() - ref).abs().max() <= tol * (1 + ref.abs().max())
    err = torch.where(finite, lse.double() - ref_lse, 0).abs().max()
    assert err <= tol * (1 + torch.where(finite, ref_lse, 0).abs().max())
    loss = (out.double() * do).sum() + (torch.where(finite, lse.double(), 0) * dl).sum()
    ref_loss = (ref * do).sum() + (torch.where(finite, ref_lse, 0) * dl).sum()
    grads = torch.autograd.grad(loss, [q, k, v, *captured])
    ref_grads = torch.autograd.grad(ref_loss, [q64, k64, v64, *cap64])
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(got).all()
        assert (got.double() - want).abs().max() <= 20 * tol * (1 + want.abs().max()), (
            (got - want).abs().max()
        )
    return bm


T = 97
DOCS = torch.tensor([0] * 30 + [1] * 40 + [2] * 27)
MASKS = {
    "causal": mods.causal_mask,
    "causal_at": mods.causal_at(5),
    "window": mods.sliding_window(10),
    "two-sided window": mods.sliding_window(6, 3),
    "prefix_lm": mods.prefix_lm(20),
    "documents": mods.document_mask(DOCS),
    "documents-causal": mods.and_masks(mods.causal_mask, mods.document_mask(DOCS)),
    "packed": mods.packed_sequences(
        torch.tensor([0, 30, 70, 97]), torch.tensor([0, 30, 70, 97]), causal=True
    ),
    "dilated": mods.dilated_sliding_window(4, 3),
    "natten": mods.natten(8, 12, 3, 5),
    "sinks": mods.sink_tokens(2, 8),
    "or": mods.or_masks(mods.sliding_window(3), mods.prefix_lm(4)),
    "lambda": lambda b, h, q, kv: ((q - kv).abs() < 7) & (h == 0) | (kv % 5 == b),
    "not broadcastable": lambda b, h, q, kv: torch.stack([q >= kv, q <= kv + 3])[h % 2],
}


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("block", [128, 32])
def test_every_mask_pattern_matches_the_oracle_forward_lse_and_gradients(name, block):
    tq = 96 if name == "natten" else T
    q, k, v = inputs(2, 2, 2, tq, tq, 12, 10)
    check(q, k, v, MASKS[name], block=block)


@pytest.mark.parametrize("t", [1, 7, 97, 300])
def test_odd_sizes_with_a_block_that_does_not_divide(t):
    q, k, v = inputs(1, 2, 2, t, t, 8, 8)
    check(q, k, v, mods.causal_mask, block=128)
    check(q, k, v, mods.sliding_window(9), block=(64, 48))


def test_tq_differs_from_tk_and_grouped_heads():
    q, k, v = inputs(2, 4, 2, 37, 130, 8, 6)
    check(q, k, v, mods.causal_at(130 - 37), gqa=True, block=32)
    check(q, k, v, mods.causal_mask, gqa=True, block=32)  # top-left: rows beyond... all see something
    check(q, k, v, lambda b, h, qi, kv: kv < 3 * qi, gqa=True, block=32)
    check(q, k, v, lambda b, h, qi, kv: (kv + h < 3 * qi) & (kv % 4 != b), gqa=True, block=(16, 64))
    check(q, k, v, mods.causal_at(93), mods.softcap(2.0), gqa=True, block=32)  # the score-mod kernel, GQA
    check(q, k, v, mods.causal_at(93), mods.alibi(mods.alibi_slopes(4)), gqa=True, block=32)  # bias tiles


def test_fully_masked_rows_give_zeros_minus_inf_and_zero_gradient():
    q, k, v = inputs(1, 2, 2, 40, 40, 8, 8)
    mask = mods.and_masks(mods.causal_mask, lambda b, h, qi, kv: (qi < 10) | (qi > 25))
    bm = sa.create_block_mask(mask, 1, 2, 40, 40, device="cpu", BLOCK_SIZE=8)
    out, lse = sa.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert (out[:, :, 10:26] == 0).all() and torch.isneginf(lse[:, :, 10:26]).all()
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    assert (q.grad[:, :, 10:26] == 0).all() and torch.isfinite(k.grad).all()
    check(*inputs(1, 2, 2, 40, 40, 8, 8), mask, block=8)


def test_hidden_nan_keys_never_leak():
    q, k, v = inputs(1, 1, 1, 20, 20, 4, 4)
    with torch.no_grad():
        k[0, 0, 15] = math.nan
        v[0, 0, 15] = math.inf
    bm = sa.create_block_mask(mods.causal_mask, 1, 1, 20, 20, device="cpu", BLOCK_SIZE=8)
    out = sa.flex_attention(q, k, v, block_mask=bm)
    assert torch.isfinite(out[:, :, :15]).all()
    for sm in (mods.softcap(2.0), mods.alibi(torch.tensor([0.3]))):
        out = sa.flex_attention(q, k, v, score_mod=sm, block_mask=bm)
        assert torch.isfinite(out[:, :, :15]).all()
        (gq,) = torch.autograd.grad(out[:, :, :15].sum(), [q])
        assert torch.isfinite(gq[:, :, :15]).all()


def test_recognised_mods_keep_the_fast_plans():
    q = torch.randn(1, 2, 256, 16)

    def plan(m):
        return flex.describe(q, q, q, block_mask=sa.create_block_mask(m, 1, 2, 256, 256, device="cpu"))

    assert (plan(mods.causal_mask).strategy, plan(mods.causal_mask).calls) == ("causal", 1)
    assert plan(mods.sliding_window(63)).strategy == "window"
    packed = mods.packed_sequences(
        torch.tensor([0, 100, 150, 256]), torch.tensor([0, 100, 150, 256]), causal=True
    )
    p = plan(packed)
    assert p.strategy == "documents" and p.calls == 3  # one causal call per sequence
    p = plan(mods.and_masks(mods.causal_mask, mods.document_mask(torch.arange(256) // 64)))
    assert p.strategy == "documents" and p.calls == 1  # four equal documents stacked into one call
    assert (plan(mods.prefix_lm(64)).strategy, plan(mods.prefix_lm(64)).calls) == ("prefix-LM", 2)
    # a function equal to prefix-LM is planned as prefix-LM (mods/recognise.py); one with a gap is not
    assert plan(mods.or_masks(mods.causal_mask, lambda b, h, q, kv: kv < 64)).strategy == "prefix-LM"
    assert plan(mods.or_masks(mods.causal_mask, lambda b, h, q, kv: kv % 64 == 0)).strategy == "blocks"


@pytest.mark.parametrize(
    "prefix, t, tk", [(0, 37, 37), (13, 37, 37), (37, 37, 37), (50, 37, 37), (9, 30, 41)]
)
def test_prefix_lm_two_calls_match_float64(prefix, t, tk):
    """prefix-LM as the prefix rectangle plus the causal square after it (or the generic plan, Tq ≠ Tk):
    output, lse and gradients against the float64 oracle, odd sizes, GQA, blocks that do not divide T."""
    g = torch.Generator().manual_seed(prefix + t)
    q = torch.randn(2, 4, t, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, tk, 16, generator=g, requires_grad=True) for _ in range(2))
    check(q, k, v, mods.prefix_lm(prefix), block=16, gqa=True)


def test_packed_sequences_have_flash_varlen_semantics():
    # sequence 0: 3 queries on 5 keys (bottom-right: query i at key position 2 + i); sequence 1: 2 on 2
    cu_q, cu_k = torch.tensor([0, 3, 5]), torch.tensor([0, 5, 7])
    dense = sa.create_mask(mods.packed_sequences(cu_q, cu_k, causal=True), 1, 1, 5, 7, device="cpu")[0, 0]
    assert dense.int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 1, 1],
    ]
    win = mods.packed_sequences(cu_q, cu_k, window=(1, 1))
    assert sa.create_mask(win, 1, 1, 5, 7, device="cpu")[0, 0, 0].int().tolist() == [0, 1, 1, 1, 0, 0, 0]
    for m in (
        mods.packed_sequences(cu_q, cu_k, causal=True),
        win,
        mods.packed_sequences(cu_q, cu_k, window=(2, -1)),
    ):
        check(*inputs(1, 2, 2, 5, 7, 4, 4), m, block=2)


SCORE_MODS = {
    "alibi": (lambda: [mods.alibi_slopes(2)], lambda s: mods.alibi(s)),
    "alibi symmetric": (lambda: [mods.alibi_slopes(2)], lambda s: mods.alibi(s, symmetric=True)),
    "softcap": (lambda: [], lambda: mods.softcap(1.5)),
    "t5 bias": (lambda: [torch.randn(32, 2)], lambda t: mods.relative_position_bias(t, max_distance=20)),
    "lambda bias": (lambda: [], lambda: lambda s, b, h, q, kv: s - 0.05 * (q - kv).abs() + h),
    "closure": (lambda: [torch.tensor(0.7)], lambda w: lambda s, b, h, q, kv: s * w + (kv % 3) * w),
}


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
@pytest.mark.parametrize("learn", [False, True])
def test_score_mods_match_the_oracle_with_gradients_to_what_they_capture(name, learn):
    make_cap, make_mod = SCORE_MODS[name]
    caps = [c.requires_grad_(learn) for c in make_cap()]
    q, k, v = inputs(1, 2, 2, 70, 70, 8, 8)
    mod = make_mod(*caps)
    if learn:
        mod64, captured = (lambda *c: make_mod(*c)), caps
    else:
        mod64, captured = (lambda: make_mod(*(c.double() for c in caps))), ()
    check(q, k, v, mods.causal_mask, mod, mod64, block=32, captured=captured)
    check(q, k, v, None, mod, mod64, captured=captured)


def test_an_additive_score_mod_without_learned_tensors_runs_on_the_fused_kernel():
    q = torch.randn(1, 2, 64, 8)
    assert flex.describe(q, q, q, score_mod=mods.alibi(mods.alibi_slopes(2))).path == "engine"
    assert flex.describe(q, q, q, score_mod=mods.softcap(2.0)).path == "scored"
    learned = mods.alibi(mods.alibi_slopes(2).requires_grad_())
    assert flex.describe(q, q, q, score_mod=learned).path == "scored"


def test_torch_block_mask_accepted_and_forward_equals_torch_eager_flex():
    from torch.nn.attention.flex_attention import create_block_mask as torch_cbm
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    q, k, v = (t.detach() for t in inputs(2, 2, 2, 97, 97, 16, 16))
    for m in (mods.causal_mask, mods.sliding_window(20), mods.prefix_lm(30), MASKS["lambda"]):
        tb = torch_cbm(m, 2, 2, 97, 97, device="cpu", BLOCK_SIZE=32)
        assert torch.equal(
            tb.to_dense(), sa.create_block_mask(m, 2, 2, 97, 97, device="cpu", BLOCK_SIZE=32).to_dense()
        )
        ours, aux = sa.flex_attention(q, k, v, block_mask=tb, return_aux=AuxRequest(lse=True))
        theirs, taux = torch_flex(q, k, v, block_mask=tb, return_aux=AuxRequest(lse=True))
        assert (ours - theirs).abs().max() < 1e-5
        assert torch.allclose(aux.lse, taux.lse, atol=1e-5)
        assert isinstance(sa.create_block_mask(m, 1, 1, 97, 97, device="cpu"), sa.BlockMask)
    ours = sa.flex_attention(q, k, v, score_mod=mods.softcap(1.0))
    assert (ours - torch_flex(q, k, v, score_mod=mods.softcap(1.0))).abs().max() < 1e-5


def test_block_tables_are_respected_like_torch_kernels():
    # a hand-made BlockMask with noop mask_mod: only the listed blocks are visible
    num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[1, 1], [0, 1]]]], dtype=torch.int32)  # an unlisted entry repeats a listed block
    bm = sa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=4, seq_lengths=(8, 8))
    q, k, v = inputs(1, 1, 1, 8, 8, 4, 4)
    keep = bm.to_dense()[0, 0].repeat_interleave(4, 0).repeat_interleave(4, 1).bool()
    out = sa.flex_attention(q, k, v, block_mask=bm)
    ref, _ = oracle(*(t.detach().double() for t in (q, k, v)), lambda b, h, qi, kv: keep[qi, kv])
    assert (out.double() - ref).abs().max() < 1e-5


def test_a_ready_document_mask_with_per_batch_ids_obeys_batch_0s_tables_as_a_lambda_does():
    """B = None with ids that differ per batch entry: the tables are batch 0's (as torch's), and the ready
    mod obeys them like the same predicate wrapped in a lambda (it was planned from its ids instead: 0.5 off
    in batch 1, found by a breaker run). Oracle: the mod's dense mask AND batch 0's block table."""
    t = 256
    ids = torch.stack([torch.arange(t) // 128, torch.zeros(t, dtype=torch.long)])  # 2 documents / 1
    q, k, v = inputs(2, 1, 1, t, t, 8, 8)
    dm = mods.document_mask(ids)
    outs = [
        sa.flex_attention(q, k, v, block_mask=sa.create_block_mask(m, None, None, t, t, device="cpu"))
        for m in (dm, lambda b, h, qi, kv: dm(b, h, qi, kv))
    ]
    table = sa.create_block_mask(dm, None, None, t, t, device="cpu").to_dense()[0, 0].bool()
    keep = table.repeat_interleave(128, 0).repeat_interleave(128, 1)[:t, :t]
    ref, _ = oracle(
        *(x.detach().double() for x in (q, k, v)), lambda b, h, qi, kv: dm(b, h, qi, kv) & keep[qi, kv]
    )
    for out in outs:
        assert (out.double() - ref).abs().max() < 1e-5
    assert not table.all()  # batch 0's tables hide blocks batch 1's ids show
    same = sa.create_block_mask(mods.document_mask(ids[:1].expand(2, t)), None, None, t, t, device="cpu")
    assert same in flex_masks.STRUCTURE  # ids equal in every batch entry: still planned from the ids


def test_tables_for_fewer_heads_or_more_batches_are_read_as_torch_cpu_kernel_does():
    """A GQA call's block mask made for the key/value heads (H = 2 for 4 query heads), or for a larger batch:
    torch's CPU kernel gives query heads 0, 1 table 0 and heads 2, 3 table 1 (h // (4 / 2); its CUDA kernels
    read h % 2), a mask for a larger batch entry z at z. The mod depends on the head, so the tables matter:
    query head h uses its group's table while the mod sees h itself, and a full block is visible without
    the mod (as in the kernels). Oracle: full | (partial & mod), densely."""
    from selfattention.visibility import FULL, PARTIAL

    q, k, v = inputs(2, 4, 2, 70, 70, 8, 8)

    def mod(b, h, qi, kv):
        return (qi >= kv) | ((h < 2) & (kv < 40))

    for B, H in ((1, 2), (3, 4), (3, 2)):
        bm = sa.create_block_mask(mod, B, H, 70, 70, device="cpu", BLOCK_SIZE=16)
        out = sa.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
        groups = {1: [0, 0, 0, 0], 2: [0, 0, 1, 1], 4: [0, 1, 2, 3]}[H]  # torch 2.13, cpp_flex_attention
        kinds = flex_masks.block_kinds(bm)[[0, 0] if B == 1 else [0, 1]][:, groups]
        kinds = kinds.repeat_interleave(16, 2).repeat_interleave(16, 3)[..., :70, :70]
        full, part = kinds == FULL, kinds == PARTIAL

        def seen(b, h, qi, kv, full=full, part=part):
            return full[b, h, qi, kv] | (part[b, h, qi, kv] & mod(b, h, qi, kv))

        ref, _ = oracle(*(t.detach().double() for t in (q, k, v)), seen)
        assert (out.double() - ref).abs().max() < 1e-5, (B, H)
        if H == 2:  # heads 1, 3 get tables their own h would not make: the tables matter
            plain, _ = oracle(*(t.detach().double() for t in (q, k, v)), mod)
            assert (plain - ref).abs().max() > 1e-2


@pytest.mark.parametrize("mask_batch, query_batch", [(2, 1), (4, 2), (4, 3)])
def test_ready_document_masks_made_for_a_larger_batch(mask_batch, query_batch):
    """A ready document mod (alone and in and_masks) in a BlockMask made for more batch entries than the
    query has: its ids are read at z % B like the tables (it crashed with a reshape error; a lambda did
    not). Oracle: the same predicate as a lambda, and float64 math."""
    t = 64
    doc = torch.zeros(4, t, dtype=torch.long)
    for z, cut in enumerate((20, 40, 10, 50)):
        doc[z, cut:] = 1
    d = doc[:mask_batch]
    q, k, v = inputs(query_batch, 2, 2, t, t, 8, 8)
    for ready, lam in (
        (mods.document_mask(d), lambda b, h, i, j: d[b, i] == d[b, j]),
        (
            mods.and_masks(mods.document_mask(d), mods.causal_mask),
            lambda b, h, i, j: (d[b, i] == d[b, j]) & (i >= j),
        ),
    ):
        got = sa.flex_attention(
            q, k, v, block_mask=sa.create_block_mask(ready, mask_batch, 1, t, t, device="cpu")
        )
        plain = sa.flex_attention(
            q, k, v, block_mask=sa.create_block_mask(lam, mask_batch, 1, t, t, device="cpu")
        )
        ref, _ = oracle(*(x.detach().double() for x in (q, k, v)), lam)
        assert (got.double() - ref).abs().max() < 1e-5 and (plain.double() - ref).abs().max() < 1e-5


def test_bfloat16_within_twice_the_naive_error():
    q, k, v = inputs(1, 2, 2, 97, 97, 16, 16)
    bm = sa.create_block_mask(mods.sliding_window(30), 1, 2, 97, 97, device="cpu", BLOCK_SIZE=32)
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    ref, _ = oracle(q64, k64, v64, mods.sliding_window(30), mods.softcap(3.0))
    naive, _ = oracle(
        *(t.bfloat16().float().double() for t in (q64, k64, v64)), mods.sliding_window(30), mods.softcap(3.0)
    )
    naive = naive.bfloat16().double()
    for sm in (None, mods.softcap(3.0)):
        qb, kb, vb = (t.detach().bfloat16() for t in (q, k, v))
        out = sa.flex_attention(qb, kb, vb, score_mod=sm, block_mask=bm)
        assert out.dtype == torch.bfloat16
        want = ref if sm is not None else oracle(q64, k64, v64, mods.sliding_window(30))[0]
        base = (
            (naive - ref).abs().max()
            if sm is not None
            else (
                oracle(*(t.bfloat16().double() for t in (q64, k64, v64)), mods.sliding_window(30))[0]
                .bfloat16()
                .double()
                - want
            )
            .abs()
            .max()
        )
        assert (out.double() - want).abs().max() <= 2 * base


def test_max_scores_and_aux_output():
    q, k, v = (t.detach() for t in inputs(1, 1, 1, 9, 9, 4, 4))
    bm = sa.create_block_mask(mods.causal_mask, 1, 1, 9, 9, device="cpu", BLOCK_SIZE=4)
    out, aux = sa.flex_attention(q, k, v, block_mask=bm, return_aux=AuxRequest(lse=True, max_scores=True))
    s = (q @ k.transpose(-1, -2)) / 2
    s = s.masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), -math.inf)
    assert torch.allclose(aux.max_scores, s.amax(-1), atol=1e-6) and torch.allclose(
        aux.lse, s.logsumexp(-1), atol=1e-5
    )
    out2, aux2 = sa.flex_attention(q, k, v, block_mask=bm, return_aux=AuxRequest())
    assert aux2.lse is None and aux2.max_scores is None and torch.allclose(out, out2, atol=1e-6)


def test_attention_sink_rescaling_equals_an_extra_logit_with_its_gradient():
    q, k, v = inputs(1, 2, 2, 20, 20, 4, 4)
    sinks = torch.tensor([0.5, -1.0], requires_grad=True)
    bm = sa.create_block_mask(mods.sliding_window(5), 1, 2, 20, 20, device="cpu", BLOCK_SIZE=8)
    out, lse = sa.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    got = mods.attention_sink(out, lse, sinks)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s64 = sinks.detach().double().requires_grad_()
    s = (q64 @ k64.transpose(-1, -2)) / 2
    keep = elementwise(mods.sliding_window(5), 1, 2, 20, 20)
    s = torch.where(keep, s, -math.inf)
    full = torch.cat([s, s64.view(1, 2, 1, 1).expand(1, 2, 20, 1)], -1)
    ref = torch.softmax(full, -1)[..., :20] @ v64
    assert (got.double() - ref).abs().max() < 1e-5
    do = torch.randn(ref.shape, dtype=torch.float64)
    g = torch.autograd.grad((got.double() * do).sum(), [q, sinks])
    r = torch.autograd.grad((ref * do).sum(), [q64, s64])
    assert all((a.double() - b).abs().max() < 1e-4 for a, b in zip(g, r, strict=True))


def test_bad_arguments_raise_clear_errors():
    q = torch.randn(1, 2, 8, 4)
    with pytest.warns(UserWarning, match=r"\['BLOCK_Z'\] are not torch's FlexKernelOptions"):
        out = sa.flex_attention(q, q, q, kernel_options={"BLOCK_Z": 1})  # torch accepts any key
    assert torch.equal(out, sa.flex_attention(q, q, q))
    sa.flex_attention(q, q, q, kernel_options={"BLOCK_M": 64, "fwd_num_warps": 4, "BACKEND": "AUTO"})
    with pytest.raises(ValueError, match="not both"):
        sa.flex_attention(q, q, q, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(ValueError, match="enable_gqa"):
        sa.flex_attention(q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match="Q_LEN"):
        sa.flex_attention(
            q, q, q, block_mask=sa.create_block_mask(mods.causal_mask, 1, 1, 16, 16, device="cpu")
        )
    with pytest.raises(ValueError, match="4-D"):
        sa.flex_attention(q[0], q[0], q[0])
    with pytest.raises(TypeError, match="mask_mod"):
        sa.create_block_mask(lambda s, b, h, qi, kv: s, 1, 1, 8, 8, device="cpu")
    with pytest.raises(RuntimeError, match="sliced"):
        sa.flex_attention(
            q, q, q, block_mask=sa.create_block_mask(mods.causal_mask, 2, 2, 8, 8, device="cpu")[0]
        )
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        mods.packed_sequences(torch.tensor([1, 3]), torch.tensor([0, 3]))


def test_scale_zero_and_float64():
    q, k, v = inputs(1, 2, 2, 33, 33, 5, 3, dtype=torch.float64)
    bm = sa.create_block_mask(mods.causal_mask, 1, 2, 33, 33, device="cpu", BLOCK_SIZE=16)
    out = sa.flex_attention(q, k, v, block_mask=bm, scale=0.0)
    ref, _ = oracle(q.detach(), k.detach(), v.detach(), mods.causal_mask, scale=0.0)
    assert (out - ref).abs().max() < 1e-10
    check(q, k, v, mods.prefix_lm(9), mods.softcap(2.0), block=16)


def test_double_backward_through_a_predicate_goes_through_the_spec():
    q, k, v = inputs(1, 2, 2, 24, 24, 4, 4, dtype=torch.float64)
    bm = sa.create_block_mask(mods.prefix_lm(5), 1, 2, 24, 24, device="cpu", BLOCK_SIZE=8)
    sm = mods.alibi(torch.tensor([0.2, 0.4], dtype=torch.float64))
    (g,) = torch.autograd.grad(
        sa.flex_attention(q, k, v, score_mod=sm, block_mask=bm).square().sum(), [q], create_graph=True
    )
    (gg,) = torch.autograd.grad(g.sum(), [k])
    q64, k64, v64 = (t.detach().requires_grad_() for t in (q, k, v))
    ref, _ = oracle(q64, k64, v64, mods.prefix_lm(5), sm)
    (rg,) = torch.autograd.grad(ref.square().sum(), [q64], create_graph=True)
    (rgg,) = torch.autograd.grad(rg.sum(), [k64])
    assert (g - rg).abs().max() < 1e-10 and (gg - rgg).abs().max() < 1e-10


@pytest.mark.parametrize(
    "mod, drawing",
    [
        (mods.dilated_sliding_window(2, 2), ["10000", "01000", "10100", "01010", "00101"]),
        (mods.sink_tokens(1, 2), ["10000", "11000", "11100", "10110", "10011"]),
        (mods.prefix_lm(2), ["11000", "11000", "11100", "11110", "11111"]),
        (mods.sliding_window(1), ["10000", "11000", "01100", "00110", "00011"]),
        (mods.sliding_window(1, 1), ["11000", "11100", "01110", "00111", "00011"]),
    ],
)
def test_the_documented_drawings(mod, drawing):
    dense = sa.create_mask(mod, 1, 1, 5, 5, device="cpu")[0, 0]
    assert ["".join(str(int(x)) for x in row) for row in dense] == drawing


def test_a_visibility_with_a_predicate_works_in_every_backend():
    from selfattention.visibility import Predicate, Visibility

    q, k, v = (t.detach() for t in inputs(1, 2, 2, 30, 30, 8, 8))
    mod = MASKS["lambda"]
    vis = Visibility(30, 30, mod=Predicate(mod, 1, 2))
    ref, _ = oracle(q.double(), k.double(), v.double(), mod)
    for backend in ("reference", "torch", "tiled"):
        out = sa.scaled_dot_product_attention(q, k, v, attn_mask=vis, backend=backend)
        assert (out.double() - ref).abs().max() < 1e-5, backend
    packed = mods.packed_sequences(torch.tensor([0, 10, 30]), torch.tensor([0, 10, 30]), causal=True)
    vis = Visibility(30, 30, **packed.structure(30, 30))
    ref, _ = oracle(q.double(), k.double(), v.double(), packed)
    for backend in ("reference", "torch", "tiled"):
        out = sa.scaled_dot_product_attention(q, k, v, attn_mask=vis, backend=backend)
        assert (out.double() - ref).abs().max() < 1e-5, backend


def test_key_value_batch_of_one_broadcasts_over_the_queries():
    q = inputs(3, 2, 2, 20, 20, 4, 4)[0]
    _, k, v = inputs(1, 2, 2, 20, 20, 4, 4, seed=1)
    check(q, k, v, mods.sliding_window(4), block=8)
    check(q, k, v, mods.causal_mask, mods.softcap(1.0), block=8)


def test_per_document_alignment_drawing_and_plan():
    from selfattention.kernels.plan import make_plan
    from selfattention.visibility import Visibility

    vis = Visibility(
        3,
        5,
        is_causal=True,
        q_doc=torch.tensor([[0, 1, 1]]),
        k_doc=torch.tensor([[0, 0, 1, 1, 1]]),
        doc_offset=0,
    )
    assert vis.to_mask()[0, 0].int().tolist() == [[1, 1, 0, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert make_plan(vis, 128, 128).strategy == "documents"
    q, k, v = (t.detach() for t in inputs(1, 1, 1, 3, 5, 4, 4))
    out = sa.scaled_dot_product_attention(q, k, v, attn_mask=vis, backend="tiled")
    ref, _ = oracle(q.double(), k.double(), v.double(), lambda b, h, qi, kv: vis.to_mask()[0, 0][qi, kv])
    assert (out.double() - ref).abs().max() < 1e-6


def test_lengths_and_batch_as_numpy_ints_or_zero_dim_tensors():
    """torch's create_block_mask takes np.int64 / 0-d integer tensors for B, H, Q_LEN, KV_LEN (lengths read
    from numpy arrays); so does ours, with tables equal to the int call's. Floats and bools still raise."""
    import numpy as np

    from selfattention.mods import causal_mask

    want = sa.create_block_mask(causal_mask, 2, None, 300, 300, device="cpu")
    for b, q_len, kv_len in (
        (np.int64(2), np.int64(300), np.int32(300)),
        (torch.tensor(2), torch.tensor(300), 300),
    ):
        got = sa.create_block_mask(causal_mask, b, None, q_len, kv_len, device="cpu")
        assert torch.equal(got.to_dense(), want.to_dense()) and tuple(got.seq_lengths) == (300, 300)
        assert all(type(n) is int for n in got.seq_lengths)
    for bad in (300.0, True, torch.tensor(300.0), torch.tensor([300])):
        with pytest.raises(ValueError, match="Q_LEN"):
            sa.create_block_mask(causal_mask, None, None, bad, 300, device="cpu")
