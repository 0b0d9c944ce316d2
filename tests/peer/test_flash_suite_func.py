"""flash-attn's output tests re-expressed (own code) in float32 and bfloat16, forward and backward.

Cases of flash-attn's ``tests/test_flash_attn.py`` (github.com/Dao-AILab/flash-attention, commit 0251105a):
``test_flash_attn_output`` / ``test_flash_attn_varlen_output`` / ``test_flash_attn_varlen_causal`` (paged
keys) / the packed variants — causal, ``window_size`` drawn as a tensor ``torch.randint(0, seqlen_k, (2,))``,
softcap 50, ALiBi slopes (batch, nheads), dropout 0.17 (the keep-mask read back from ``S_dmask``'s sign),
MHA/MQA/GQA, seqlen_q ≠ seqlen_k both ways, odd head dims. The adapted peer file
(tests/peer/test_flash_attn.py) runs fp16/bf16 only; these add float32 and the combinations it leaves to its
full run, at small sizes.

The check is flash-attn's: ``max|ours − ref64| ≤ 2 · max|naive − ref64| + 1e-5`` for the output and
``≤ mult · … + 2e-4`` (mult 2, 8 with ALiBi) for dq, dk, dv, where ref64 is float64 attention and naive
the same attention computed in the input dtype (:func:`tests.flash_oracle.fa_attention`).
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from selfattention.flash import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
)

from ..flash_oracle import fa_attention, fa_visible_fast

I32 = torch.int32
SHAPES = [(1, 147), (113, 203), (128, 117), (3, 99), (99, 3), (64, 64), (37, 80)]
DIMS = [32, 40, 59, 64, 111]
LAYOUTS = ["dense", "packed", "varlen", "varlen_paged"]

# every (dtype, causal, local, alibi, layout) combination; (softcap, dropout) drawn per case by a hash
_BASE = itertools.product(["float32", "bfloat16"], [False, True], [False, True], [False, True], LAYOUTS)
_SD = [(0.0, 0.0), (50.0, 0.0), (0.0, 0.17), (50.0, 0.17)]
CASES = [(*c[:4], *_SD[zlib.crc32(repr(c).encode()) % 4], c[4]) for c in _BASE]


def _draw(case) -> dict:
    h = zlib.crc32(repr(case).encode())
    shape = SHAPES[h % len(SHAPES)]
    layout = case[6]
    if layout == "packed":  # qkvpacked needs seqlen_q = seqlen_k (and the same heads)
        shape = (shape[0], shape[0])
    mha = "mha" if layout == "packed" and (h >> 4) & 1 else ("mha", "mqa", "gqa")[(h >> 8) % 3]
    return {"shape": shape, "d": DIMS[(h >> 12) % len(DIMS)], "mha": mha, "qkv": bool((h >> 16) & 1)}


def _lens(n: int, longest: int, gen: torch.Generator) -> list[int]:
    """n sequence lengths in [0, longest], one of them the longest (flash-attn's random padding masks)."""
    lens = torch.randint(0, longest + 1, (n,), generator=gen).tolist()
    lens[0] = longest
    return lens


@pytest.mark.parametrize("dtype, causal, local, alibi, softcap, dropout_p, layout", CASES, ids=str)
def test_against_float64(dtype, causal, local, alibi, softcap, dropout_p, layout):
    dtype = getattr(torch, dtype)
    ex = _draw((dtype, causal, local, alibi, softcap, dropout_p, layout))
    (sq, sk), d = ex["shape"], ex["d"]
    batch, nheads = 2, 4
    nheads_k = {"mha": 4, "mqa": 1, "gqa": 2}[ex["mha"]]
    gen = torch.Generator().manual_seed(zlib.crc32(repr((sq, sk, d, layout, causal, local)).encode()))
    window = torch.randint(0, sk, (2,), generator=gen) if local else (-1, -1)
    slopes = torch.rand(batch, nheads, generator=gen) * 0.3 if alibi else None

    def leaf(*s):
        return torch.randn(*s, generator=gen).to(dtype).requires_grad_()

    q, k, v = leaf(batch, sq, nheads, d), leaf(batch, sk, nheads_k, d), leaf(batch, sk, nheads_k, d)
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes, return_attn_probs=True)
    if layout in ("dense", "packed"):
        lq, lk = [sq] * batch, [sk] * batch
        if layout == "packed" and ex["mha"] == "mha":
            qkv = torch.stack([q, k, v], 2).detach().requires_grad_()
            out, lse, probs = flash_attn_qkvpacked_func(qkv, dropout_p, **kw)
            q, k, v = qkv.unbind(2)  # the gradients are read through the stack
            inputs = (qkv,)
        elif layout == "packed":
            kv = torch.stack([k, v], 2).detach().requires_grad_()
            out, lse, probs = flash_attn_kvpacked_func(q, kv, dropout_p, **kw)
            k, v = kv.unbind(2)
            inputs = (q, kv)
        else:
            out, lse, probs = flash_attn_func(q, k, v, dropout_p, **kw)
            inputs = (q, k, v)
        keep = None if dropout_p == 0 else probs >= 0
    else:  # packed sequences cut out of the padded batch
        lq, lk = _lens(batch, sq, gen), _lens(batch, sk, gen)
        cu_q = torch.tensor([0, *itertools.accumulate(lq)], dtype=I32)
        cu_k = torch.tensor([0, *itertools.accumulate(lk)], dtype=I32)
        q_p = torch.cat([q[b, : lq[b]] for b in range(batch)])
        k_p = torch.cat([k[b, : lk[b]] for b in range(batch)])
        v_p = torch.cat([v[b, : lk[b]] for b in range(batch)])
        args = [q_p, k_p, v_p]
        block_table = None
        if layout == "varlen_paged":  # every sequence's keys on shuffled pages of 16 (+ unused ones)
            page, per = 16, -(-sk // 16)
            perm = torch.randperm(batch * per + 2, generator=gen)
            pool_k = torch.zeros(batch * per + 2, page, nheads_k, d, dtype=dtype)
            pool_v = torch.zeros_like(pool_k)
            block_table = perm[: batch * per].reshape(batch, per).to(I32)
            pad = per * page - sk
            padk = torch.cat([k, k.new_zeros(batch, pad, nheads_k, d)], 1).unflatten(1, (per, page))
            padv = torch.cat([v, v.new_zeros(batch, pad, nheads_k, d)], 1).unflatten(1, (per, page))
            pool_k = pool_k.index_put((block_table.long(),), padk)
            pool_v = pool_v.index_put((block_table.long(),), padv)
            args = [q_p, pool_k, pool_v]
        out_p, lse_p, probs = flash_attn_varlen_func(
            *args, cu_q, cu_k, max(lq), max(lk), dropout_p, **kw, block_table=block_table
        )
        inputs = (q, k, v)
        out = torch.zeros(batch, sq, nheads, d, dtype=dtype)
        lse = torch.full((batch, nheads, sq), float("-inf"))
        for b in range(batch):
            out = out.index_put((torch.tensor([b]), torch.arange(lq[b])), out_p[cu_q[b] : cu_q[b + 1]])
            lse[b, :, : lq[b]] = lse_p[:, cu_q[b] : cu_q[b + 1]]
        keep = None
        if dropout_p > 0:
            keep = torch.ones(batch, nheads, sq, sk, dtype=torch.bool)
            keep[:, :, : probs.shape[2], : probs.shape[3]] = probs >= 0

    # the references: each sequence bottom-right on its own keys, padding rows / keys unseen
    ok = torch.zeros(batch, sq, sk, dtype=torch.bool)
    bias = torch.zeros(batch, nheads, sq, sk, dtype=torch.float64)
    for b in range(batch):
        ok[b, : lq[b], : lk[b]] = fa_visible_fast(lq[b], lk[b], causal, window, max(lk))
        if alibi:
            rel = torch.arange(lq[b])[:, None] + lk[b] - lq[b] - torch.arange(lk[b])[None]
            bias[b, :, : lq[b], : lk[b]] = -slopes[b].double()[:, None, None] * rel.abs()
    extra = dict(bias=bias, softcap=softcap, keep=keep, dropout_p=dropout_p)
    ref, ref_lse = fa_attention(q, k, v, ok, **extra)
    low, _ = fa_attention(q, k, v, ok, work=dtype, **extra)
    rows = torch.zeros(batch, sq, 1, 1, dtype=torch.bool)
    for b in range(batch):
        rows[b, : lq[b]] = True  # padding rows are not outputs
    err = ((out.double() - ref) * rows).abs().max().item()
    err_low = ((low.double() - ref) * rows).abs().max().item()
    assert out.dtype == dtype and err <= 2 * err_low + 1e-5, (err, err_low)
    seen = ok.any(-1)[:, None].expand_as(lse)
    real = rows[:, None, :, 0, 0].expand_as(lse)
    assert bool(torch.isneginf(lse[real & ~seen]).all())
    torch.testing.assert_close(lse[real & seen].double(), ref_lse[real & seen], atol=2e-4, rtol=1e-5)

    g = torch.randn(batch, sq, nheads, d, generator=gen).to(dtype) * rows
    grads = torch.autograd.grad(out, inputs, g)
    if layout == "packed":  # back to (dq, dk, dv)
        grads = tuple(grads[0].unbind(2)) if len(grads) == 1 else (grads[0], *grads[1].unbind(2))
    want = torch.autograd.grad(ref, inputs, g.double(), retain_graph=True)
    naive = torch.autograd.grad(low, inputs, g)
    if layout == "packed":
        want = tuple(want[0].unbind(2)) if len(want) == 1 else (want[0], *want[1].unbind(2))
        naive = tuple(naive[0].unbind(2)) if len(naive) == 1 else (naive[0], *naive[1].unbind(2))
    mult = 8 if alibi else 2
    for name, got, w, n in zip("qkv", grads, want, naive, strict=True):
        e, e_low = (got.double() - w).abs().max().item(), (n.double() - w).abs().max().item()
        assert e <= mult * e_low + 2e-4, (f"d{name}", e, e_low)
