"""flex_attention under torch.compile(fullgraph=True): torch's own flex runs there (docs/flex.md)."""

import warnings

import pytest
import torch

from selfattention import create_block_mask, flex_attention

warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")

SLOPES = torch.tensor([0.5, 0.25])


def _sliding(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() < 5


def _alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * (q_idx - kv_idx).abs()


def _qkv():
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randn(1, 2, 37, 12, generator=g) for _ in range(3))  # T = 37: blocks do not divide


@pytest.mark.parametrize("which", ["mask_mod", "score_mod"])
def test_fullgraph_compile_equals_eager_without_breaks(which):
    q, k, v = _qkv()
    if which == "mask_mod":
        kw = {"block_mask": create_block_mask(_sliding, None, None, 37, 37, device="cpu")}
    else:
        kw = {"score_mod": _alibi}
    eager = flex_attention(q, k, v, **kw)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(flex_attention, fullgraph=True)(q, k, v, **kw)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        torch._dynamo.reset()
        assert torch._dynamo.explain(flex_attention)(q, k, v, **kw).graph_break_count == 0
    finally:
        torch._dynamo.reset()


def test_a_mask_made_for_the_key_value_heads_reads_the_tables_as_compiled_torch_does():
    """GQA, 4 query heads over 2 key/value heads, a BlockMask made for H = 2 whose mod reads h: eager
    (the engine) and compiled (torch's own CPU kernel) must pick the same tables for each query head —
    the eager path read them h % 2, torch's CPU kernel reads h // 2 (found by a breaker run: 1.04 apart)."""
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    g = torch.Generator().manual_seed(5)
    t = 300  # three 128-blocks, the last one short
    windows = torch.tensor([16, 200])
    q = torch.randn(1, 4, t, 16, generator=g)
    k, v = (torch.randn(1, 2, t, 16, generator=g) for _ in range(2))

    def per_head_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < windows[h % 2])

    bm = create_block_mask(per_head_window, 1, 2, t, t, device="cpu")
    eager = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(torch_flex)(q, k, v, block_mask=bm, enable_gqa=True)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(eager, compiled, rtol=1e-5, atol=1e-5)


def test_compiled_under_no_grad_takes_inputs_that_require_grad():
    """``torch.compile(flex_attention)`` under ``torch.no_grad()`` with parameters' outputs as inputs (they
    require grad): torch's compiled CPU flex raises "does not support backward on CPU" for them even
    though no graph is recorded (a new user's run); ours hands it the detached inputs. Oracle: the float64
    softmax over the sliding window."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    bm = create_block_mask(_sliding, None, None, 37, 37, device="cpu")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            out = torch.compile(flex_attention)(q, k, v, block_mask=bm)
    finally:
        torch._dynamo.reset()
    i = torch.arange(37)
    scores = (q.double() @ k.double().mT) / 12**0.5
    scores = scores.masked_fill((i[:, None] - i[None, :]).abs() >= 5, float("-inf"))
    want = torch.softmax(scores, -1) @ v.double()
    assert not out.requires_grad
    assert (out.double() - want).abs().max() < 1e-5
