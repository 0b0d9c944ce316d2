"""attention-gym's mask_mods and score_mods, and torch's indexing score_mods, on ``selfattention.flex_attention``.

The mods are re-expressed here (own code) from attention-gym (github.com/meta-pytorch/attention-gym:
``attn_gym/masks/{causal,sliding_window,prefix_lm,document_mask,dilated_sliding_window,
global_sliding_window,natten,flamingo,block_diffusion,shared_prefix,batchify}.py`` and
``attn_gym/mods/{alibi,softcapping,sandwich,graphormer,activation}.py``) and from torch's
``test/inductor/test_flex_attention.py`` (``test_index_multiple``, ``test_index_weird1/2``,
``test_load_from_bias_*``, ``test_captured_reduction``, ``test_dependent_causal_bidirectional``). As in
attention-gym, the combined masks are built with **torch's** ``or_masks`` (code written against torch).

Checks, for every mod: our ``create_block_mask`` gives torch's block tables, ``to_dense``, ``to_string``,
``repr``, ``sparsity`` and ``shape``; our forward (out and lse, float32) equals torch's eager
``flex_attention`` on torch's own BlockMask; our gradients (float64, also of tensors the score_mod
captures) equal dense float64 math whose mods run element by element under ``torch.vmap`` (as torch's
``create_mask`` does), so no broadcasting shortcut is shared with the library.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as tfa

from selfattention import create_block_mask, flex_attention
from selfattention.flex import AuxRequest, and_masks, or_masks

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
B, H, D = 2, 4, 16
GEN = torch.Generator().manual_seed(0)


# ---------------------------------------------------------------------------------------------------------
# attention-gym's mask mods (re-expressed)
# ---------------------------------------------------------------------------------------------------------


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(n):
    def mod(b, h, q, kv):
        return (q >= kv) & (q - kv <= n)

    return mod


def prefix_lm(n):
    return tfa.or_masks(lambda b, h, q, kv: kv < n, causal)


def documents(inner, lengths):
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))

    def mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & inner(b, h, q - offsets[doc[q]], kv - offsets[doc[kv]])

    return mod


def packed_causal(lengths):
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    doc = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
    return lambda b, h, q, kv: (kv >= offsets[doc[q]]) & (q >= kv)


def dilated(window, step):
    def mod(b, h, q, kv):
        gap = (q - kv).abs()
        return (gap <= window) & (gap % step == 0)

    return mod


def global_window(window, marked):
    return tfa.or_masks(
        lambda b, h, q, kv: (q - kv).abs() <= window, lambda b, h, q, kv: marked[q] | marked[kv]
    )


def natten(w, hgt, kw, kh):
    def mod(b, h, q, kv):
        qx, qy, kx, ky = q // w, q % w, kv // w, kv % w
        cx, cy = qx.clamp(kw // 2, (w - 1) - kw // 2), qy.clamp(kh // 2, (hgt - 1) - kh // 2)
        return ((cx - kx).abs() <= kw // 2) & ((cy - ky).abs() <= kh // 2)

    return mod


def tiled_natten(w, hgt, kw, kh, tw, th):
    def xy(i):
        t = i // (th * tw)
        ty, tx = t // (w // tw), t % (w // tw)
        r = i % (th * tw)
        return tx * tw + r % tw, ty * th + r // tw

    def mod(b, h, q, kv):
        (qx, qy), (kx, ky) = xy(q), xy(kv)
        cx, cy = qx.clamp(kw // 2, (w - 1) - kw // 2), qy.clamp(kh // 2, (hgt - 1) - kh // 2)
        return ((cx - kx).abs() <= kw // 2) & ((cy - ky).abs() <= kh // 2)

    return mod


def flamingo(intervals, image_tokens):
    """Text queries see the image tokens of the images whose interval holds them (cross attention)."""
    owner = torch.repeat_interleave(torch.arange(intervals.shape[0]), image_tokens)

    def mod(b, h, q, kv):
        span = intervals[owner[kv]]  # not broadcast-friendly: span[0] is a row, not the start
        return (q >= span[0]) & (q < span[1])

    return mod


def block_diffusion(n, size):
    def mod(b, h, q, kv):
        qn, kn = q < n, kv < n
        qb, kb = (q % n) // size, (kv % n) // size
        return ((qb == kb) & (qn == kn)) | ((qb > kb) & qn & ~kn) | ((qb >= kb) & ~qn & ~kn)

    return mod


def shared_prefix(lengths, prefix_of):
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pre = torch.tensor(prefix_of)

    def mod(b, h, q, kv):
        d, p = doc[q], pre[doc[q]]
        own = (kv >= offsets[d]) & (q >= kv)
        return own | ((d != p) & (kv >= offsets[p]) & (kv < offsets[p + 1]))

    return mod


def batchify(inner, size):
    return lambda b, h, q, kv: (q // size == kv // size) & inner(b, h, q % size, kv % size)


def head_dependent(b, h, q, kv):  # torch's test_dependent_causal_bidirectional
    return torch.where((b % 2 == 0) & (h % 2 == 0), q >= kv, (q + b + h) % 3 != 0)


MASKS = {  # name: (mask_mod, Q_LEN, KV_LEN)
    "causal": (causal, 130, 130),
    "causal_q_lt_kv": (causal, 70, 200),
    "sliding_window": (sliding_window(24), 257, 257),
    "prefix_lm": (prefix_lm(37), 150, 150),
    "documents": (documents(causal, [50, 1, 139, 110]), 300, 300),
    "documents_bidirectional": (documents(tfa.noop_mask, [7, 120, 73]), 200, 200),
    "packed_causal": (packed_causal([40, 90, 70]), 200, 200),
    "dilated": (dilated(30, 3), 199, 199),
    "global_window": (global_window(5, torch.rand(260, generator=GEN) < 0.05), 260, 260),
    "natten": (natten(16, 16, 5, 3), 256, 256),
    "tiled_natten": (tiled_natten(16, 16, 5, 5, 4, 4), 256, 256),
    "flamingo": (flamingo(torch.tensor([[0, 40], [30, 150], [100, 170]]), 64), 170, 192),
    "block_diffusion": (block_diffusion(100, 16), 200, 200),
    "shared_prefix": (shared_prefix([30, 50, 40, 60], [0, 0, 0, 3]), 180, 180),
    "batchify": (batchify(causal, 24), 130, 130),
    "head_dependent": (head_dependent, 130, 140),
}


# ---------------------------------------------------------------------------------------------------------
# The float64 golden: every mod element by element under torch.vmap
# ---------------------------------------------------------------------------------------------------------


def _vmapped(fn, with_score: bool):
    f = fn
    lead = (0,) if with_score else ()
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        f = torch.vmap(f, in_dims=lead + dims)
    return f


def golden(q, k, v, score_mod=None, mask_mod=None):
    """Dense attention (B, H, L, E) in q's dtype: out and lse, blind rows 0 / −inf, differentiable."""
    b, h, tq, d = q.shape
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    idx = (torch.arange(b), torch.arange(h), torch.arange(tq), torch.arange(k.shape[2]))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    if score_mod is not None:
        s = _vmapped(score_mod, True)(s, *idx)
    if mask_mod is not None:
        s = s.masked_fill(~_vmapped(mask_mod, False)(*idx), -math.inf)
    blind = torch.isneginf(s).all(-1, keepdim=True)
    lse = torch.logsumexp(s, -1)
    w = torch.softmax(s.masked_fill(blind, 0.0), -1).masked_fill(blind, 0.0)
    return w @ v, lse


def _qkv(tq, tk, dtype, hkv=H, grad=False):
    g = torch.Generator().manual_seed(tq * 1000 + tk)
    return [torch.randn(B, n, t, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
            for n, t in ((H, tq), (hkv, tk), (hkv, tk))]  # fmt: skip


def _same_block_mask(ours, theirs):
    assert ours.shape == theirs.shape and ours.seq_lengths == theirs.seq_lengths
    assert ours.BLOCK_SIZE == theirs.BLOCK_SIZE
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        n, a, t = getattr(ours, num), getattr(ours, idx), getattr(theirs, idx)
        listed = torch.arange(a.shape[-1]) < n[..., None]
        assert torch.equal(a[listed], t[listed]), idx  # the listed blocks, in the same order
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert ours.sparsity() == theirs.sparsity()
    assert ours.to_string() == theirs.to_string() and repr(ours) == repr(theirs)


@pytest.mark.parametrize("block", [128, (64, 32)], ids=str)
@pytest.mark.parametrize("bh", [(None, None), (B, H)], ids=str)
@pytest.mark.parametrize("name", list(MASKS))
def test_gym_mask_mods_against_torch(name, bh, block):
    mod, tq, tk = MASKS[name]
    ours = create_block_mask(mod, *bh, tq, tk, device="cpu", BLOCK_SIZE=block)
    theirs = tfa.create_block_mask(mod, *bh, tq, tk, device="cpu", BLOCK_SIZE=block)
    _same_block_mask(ours, theirs)
    q, k, v = _qkv(tq, tk, torch.float32)
    out, aux = flex_attention(q, k, v, block_mask=ours, return_aux=AuxRequest(lse=True))
    if name == "head_dependent" and bh == (None, None):
        # tables made for b = h = 0 only: torch's eager flex ignores a BlockMask's tables (it applies the
        # mask_mod densely), torch's kernels and ours skip the blocks the tables leave out
        ref, lse_ref = golden(*(t.double() for t in (q, k, v)), mask_mod=_table_gated(ours, mod))
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(aux.lse.double(), lse_ref, atol=2e-5, rtol=1e-5)
        return
    ref, aux_ref = tfa.flex_attention(q, k, v, block_mask=theirs, return_aux=tfa.AuxRequest(lse=True))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(aux.lse, aux_ref.lse, atol=2e-5, rtol=1e-5)  # −inf rows included


def _table_gated(bm, mod):
    """The mask a BlockMask means in torch's kernels: visible iff the entry's block is full, or partial
    and ``mod`` says so (tables (1, 1, …) broadcast over b and h)."""

    def dense(num, idx):
        return tfa.BlockMask.from_kv_blocks(
            num, idx, BLOCK_SIZE=bm.BLOCK_SIZE, seq_lengths=bm.seq_lengths
        ).to_dense()

    part, full = dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)
    rq, rk = bm.BLOCK_SIZE

    def gated(b, h, q, kv):
        p, f = part[0, 0][q // rq, kv // rk].bool(), full[0, 0][q // rq, kv // rk].bool()
        return f | (p & mod(b, h, q, kv))

    return gated


@pytest.mark.parametrize("name", list(MASKS))
def test_gym_mask_mods_backward_float64(name):
    mod, tq, tk = MASKS[name]
    bm = create_block_mask(mod, B, H, tq, tk, device="cpu", BLOCK_SIZE=(32, 64))
    q, k, v = _qkv(tq, tk, torch.float64, hkv=2, grad=True)  # GQA too
    out, lse = flex_attention(q, k, v, block_mask=bm, enable_gqa=True, return_lse=True)
    ref, ref_lse = golden(q, k, v, mask_mod=mod)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    loss = (out * g).sum() + lse[fin].sum()
    loss_ref = (ref * g).sum() + ref_lse[fin].sum()
    got, want = torch.autograd.grad(loss, (q, k, v)), torch.autograd.grad(loss_ref, (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, atol=1e-9, rtol=1e-9)


# ---------------------------------------------------------------------------------------------------------
# score mods: attention-gym's and torch's indexing patterns
# ---------------------------------------------------------------------------------------------------------

L = 100
_bias_bs, _bias4 = torch.randn(B, L, generator=GEN), torch.randn(4, B, H, L, generator=GEN)
_bias_bh4, _which = torch.randn(B, H, 4, L, generator=GEN), torch.tensor(0)
_bias_ss, _bias_bss = torch.randn(L, L, generator=GEN), torch.randn(B, L, L, generator=GEN)
_bias_bhss, _rel = torch.randn(B, H, L, L, generator=GEN), torch.randn(2 * L, generator=GEN)
_per_b = torch.randn(B, 8, generator=GEN)
_freqs = 1.0 / 10000 ** (2 * torch.arange(8) / 16.0)
_table = torch.cos((torch.arange(-(-(2 * L - 1) // 8) * 8) - (L - 1)).abs()[:, None] * _freqs).sum(-1)
_head_scale = H / (8.0 * torch.arange(1, H + 1))
_dist = torch.randint(0, 6, (B, L, L), generator=GEN, dtype=torch.int32)

SCORE_MODS = {  # name: score_mod(score, b, h, q_idx, kv_idx, *captured) and the captured tensors
    "gym_alibi": (lambda s, b, h, q, kv: s + (kv - q) * torch.exp2(-((h + 1) * 8.0 / H)), ()),
    "gym_softcap": (lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0), ()),
    "gym_sandwich": (lambda s, b, h, q, kv: s + _table[q - kv + L - 1] * _head_scale[h], ()),
    "gym_graphormer": (lambda s, b, h, q, kv, t: s + t[h, _dist[b, q, kv]], (torch.randn(H, 6, generator=GEN),)),
    "index_multiple": (lambda s, b, h, q, kv: s + _bias_bs[b][q], ()),
    "index_weird1": (lambda s, b, h, q, kv: s + _bias4[0][b, h][q], ()),
    "index_weird2": (lambda s, b, h, q, kv: s + _bias_bh4[b][h][_which, q], ()),
    "bias_seq_only": (lambda s, b, h, q, kv: s + _bias_ss[q, kv], ()),
    "bias_seq_batch": (lambda s, b, h, q, kv: s + _bias_bss[b, q, kv], ()),
    "bias_head_seq_batch": (lambda s, b, h, q, kv: s + _bias_bhss[b, h, q, kv], ()),
    "rel_bias_table": (lambda s, b, h, q, kv: s + _rel[q - kv + L], ()),
    "captured_reduction": (lambda s, b, h, q, kv: s + _per_b[b].sum(dim=-1), ()),
    "learned_head_gate": (lambda s, b, h, q, kv, gate: F.silu(s) * torch.sigmoid(gate[h]), (torch.randn(H, generator=GEN),)),
}  # fmt: skip


@pytest.mark.parametrize("lens", [(L, L), (1, L), (37, 70)], ids=str)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_score_mods_against_torch_and_float64(name, masked, lens):
    fn, captured = SCORE_MODS[name]
    tq, tk = lens
    bm = create_block_mask(causal, None, None, tq, tk, device="cpu", BLOCK_SIZE=32) if masked else None
    theirs = (
        tfa.create_block_mask(causal, None, None, tq, tk, device="cpu", BLOCK_SIZE=32) if masked else None
    )
    q, k, v = _qkv(tq, tk, torch.float32)
    c32 = [c.float() for c in captured]
    out, aux = flex_attention(q, k, v, lambda *a: fn(*a, *c32), bm, return_aux=AuxRequest(lse=True))
    ref, aux_ref = tfa.flex_attention(
        q, k, v, lambda *a: fn(*a, *c32), theirs, return_aux=tfa.AuxRequest(lse=True)
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(aux.lse, aux_ref.lse, atol=2e-5, rtol=1e-5)

    q, k, v = _qkv(tq, tk, torch.float64, grad=True)
    c64 = [c.double().requires_grad_() for c in captured]
    out, lse = flex_attention(q, k, v, lambda *a: fn(*a, *c64), bm, return_lse=True)
    ref, ref_lse = golden(q, k, v, lambda *a: fn(*a, *c64), causal if masked else None)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    leaves = (q, k, v, *c64)
    got = torch.autograd.grad((out * g).sum() + lse.sum(), leaves)
    want = torch.autograd.grad((ref * g).sum() + ref_lse.sum(), leaves)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, atol=1e-9, rtol=1e-9)


def test_gym_activation_attention_undone_from_the_lse():
    """attention-gym's activation trick: score_mod log(gelu(s) + 1), then out · exp(lse) − Σ v = gelu(S) V
    (needs the lse through ``return_aux``); against gelu(q kᵀ/√D) v in float64, with a causal mask."""
    q, k, v = _qkv(64, 64, torch.float64)
    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    out, aux = flex_attention(q, k, v, lambda s, b, h, i, j: torch.log(F.gelu(s) + 1.0), bm,
                              return_aux=AuxRequest(lse=True))  # fmt: skip
    recovered = out * aux.lse.exp()[..., None] - v.cumsum(dim=-2)
    s = F.gelu(q @ k.transpose(-1, -2) / math.sqrt(D)).tril()
    torch.testing.assert_close(recovered, s @ v, atol=1e-9, rtol=1e-9)


def test_combiners_raise_what_torch_raises():
    """torch's and_masks/or_masks raise RuntimeError for a non-callable; ours also (a TypeError too)."""
    for combine in (and_masks, or_masks):
        for err in (RuntimeError, TypeError):
            with pytest.raises(err, match="callable mask_mod"):
                combine(causal, 3)
    b, h, q, kv = (torch.arange(n).view(*s) for n, s in ((2, (-1, 1, 1, 1)), (3, (1, -1, 1, 1)), (5, (1, 1, -1, 1)), (7, (1, 1, 1, -1))))  # fmt: skip
    assert bool(and_masks()(b, h, q, kv).all()) and not bool(or_masks()(b, h, q, kv).any())  # as torch's
