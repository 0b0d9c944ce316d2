"""torch's flex-decoding usage of a BlockMask, re-expressed (own code): the mask is made once, then sliced at
the current position and given a new ``mask_mod`` / ``seq_lengths`` by assignment (torch's
``test/inductor/test_flex_decoding.py``, ``test_decode_at_different_input_position``; gpt-fast does the
same). Our ``create_block_mask`` recognises its ready mods (``selfattention.mods``) and plans them as
structures; after such an assignment the BlockMask must mean what its tables and its new mask_mod say.

Bug this file guards: a BlockMask made from ``selfattention.mods.causal_mask`` whose ``mask_mod`` was
reassigned kept the causal plan (the new mod was ignored: max error 2.4 on a 256 × 256 call).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as tfa

from selfattention import create_block_mask, flex_attention, mods

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def _qkv(b, h, tq, tk, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, t, d, generator=g) for t in (tq, tk, tk))


def _gated(bm: tfa.BlockMask, mod, tq: int, tk: int) -> torch.Tensor:
    """(tq, tk) bool: what the BlockMask means in torch's kernels (and ours): the entry's block full, or
    partial and ``mod`` True — evaluated entry by entry with Python ints."""
    dense = bm.to_dense()[0, 0]
    full = torch.zeros_like(dense)
    n, idx = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
    for r in range(full.shape[0]):
        full[r, idx[r, : int(n[r])].long()] = 1
    rq, rk = bm.BLOCK_SIZE
    out = torch.zeros(tq, tk, dtype=torch.bool)
    zero = torch.tensor(0)
    for i in range(tq):
        for j in range(tk):
            if full[i // rq, j // rk]:
                out[i, j] = True
            elif dense[i // rq, j // rk]:
                out[i, j] = bool(mod(zero, zero, torch.tensor(i), torch.tensor(j)))
    return out


def _dense(q, k, v, keep):
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~keep, -math.inf)
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v.double()


@pytest.mark.parametrize(
    "ready", [mods.causal_mask, mods.sliding_window(40), mods.causal_at(16)], ids=["causal", "window", "at"]
)
def test_reassigned_mask_mod_is_honoured(ready):
    tq = tk = 96
    bm = create_block_mask(ready, 1, 1, tq, tk, device="cpu", BLOCK_SIZE=32)

    def every_other(b, h, q_idx, kv_idx):
        return ready(b, h, q_idx, kv_idx) & (kv_idx % 2 == 0)

    bm.mask_mod = every_other
    q, k, v = _qkv(2, 2, tq, tk)
    out = flex_attention(q, k, v, block_mask=bm)
    want = _dense(q, k, v, _gated(bm, every_other, tq, tk))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", [0, 31, 32, 150, 255])
@pytest.mark.parametrize("ready", [mods.causal_mask, mods.sliding_window(70)], ids=["causal", "window"])
def test_decode_at_a_position_like_torch(ready, pos):
    """A mask for (256, 256) sliced at the block of position ``pos``, its mask_mod shifted by ``pos`` and
    ``seq_lengths`` set to (1, 256): one query at ``pos``; ours equals torch's eager flex on torch's mask."""
    kv_len, block = 256, 32
    ours = create_block_mask(ready, 1, 1, kv_len, kv_len, device="cpu", BLOCK_SIZE=block)
    theirs = tfa.create_block_mask(ready, 1, 1, kv_len, kv_len, device="cpu", BLOCK_SIZE=block)

    def shifted(b, h, q_idx, kv_idx):
        return ready(b, h, q_idx + pos, kv_idx)

    sliced = []
    for bm in (ours, theirs):
        s = bm[:, :, pos // block]
        s.mask_mod, s.seq_lengths = shifted, (1, kv_len)
        sliced.append(s)
    q, k, v = _qkv(2, 4, 1, kv_len, seed=pos)
    out, lse = flex_attention(q, k, v, block_mask=sliced[0], return_lse=True)
    ref, aux = tfa.flex_attention(q, k, v, block_mask=sliced[1], return_aux=tfa.AuxRequest(lse=True))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, aux.lse, atol=1e-5, rtol=1e-5)
    keep = torch.tensor([bool(ready(0, 0, torch.tensor(pos), torch.tensor(j))) for j in range(kv_len)])
    torch.testing.assert_close(out.double(), _dense(q, k, v, keep[None]), atol=1e-5, rtol=1e-5)


def test_reassigned_seq_lengths_with_the_same_mod_still_plans_right():
    """seq_lengths reassigned to shorter queries (tables kept): the rows that remain mean the same."""
    bm = create_block_mask(mods.sliding_window(20), 1, 1, 128, 128, device="cpu", BLOCK_SIZE=32)
    bm.seq_lengths = (100, 128)
    q, k, v = _qkv(1, 2, 100, 128)
    out = flex_attention(q, k, v, block_mask=bm)
    want = _dense(q, k, v, _gated(bm, mods.sliding_window(20), 100, 128))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
