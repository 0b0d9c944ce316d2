"""A user's score_mod goes to the fused kernel as a bias only when its code is score + bias: value-dependent
mods that agree with score + mod(0) on most sample scores (a clamp, a diagonal rescale) must see the real
scores. Oracle: float64 softmax written here. (The cases came from a new user's report.)"""

from __future__ import annotations

import math

import torch

from selfattention import flex_attention
from selfattention.flex import describe
from selfattention.mods.additive import is_additive


def _ref(q, k, v, scores_fn):
    s = scores_fn(q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]))
    return torch.softmax(s, -1) @ v.double()


def test_clamp_is_applied():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16) * 6 for _ in range(3))  # scores reach ±200: the clamp bites
    out = flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s.clamp(-50.0, 50.0))
    ref = _ref(q, k, v, lambda s: s.clamp(-50, 50))
    assert (flex_attention(q, k, v).double() - ref).abs().max() > 1.0  # the clamp matters here
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


def test_diagonal_rescale_is_applied():
    torch.manual_seed(1)
    t = 1031
    q, k, v = (torch.randn(1, 1, t, 16) for _ in range(3))
    mod = lambda s, b, h, q_idx, kv_idx: torch.where(q_idx == kv_idx, s * 3, s)  # noqa: E731
    out = flex_attention(q, k, v, score_mod=mod)
    i = torch.arange(t)

    def diag3(s):
        s = s.clone()
        s[..., i, i] *= 3
        return s

    torch.testing.assert_close(out.double(), _ref(q, k, v, diag3), atol=2e-5, rtol=1e-5)
    assert describe(q, k, v, score_mod=mod).kernel == "exact"


def test_a_plain_alibi_function_stays_on_the_fused_kernel():
    torch.manual_seed(2)
    h, t = 4, 300
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    mod = lambda s, b, hh, q_idx, kv_idx: s + slopes[hh] * (kv_idx - q_idx)  # noqa: E731
    q, k, v = (torch.randn(1, h, t, 16) for _ in range(3))
    out = flex_attention(q, k, v, score_mod=mod)
    d = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).double()
    ref = (
        torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4 + slopes.double()[:, None, None] * d, -1)
        @ v.double()
    )
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    assert describe(q, k, v, score_mod=mod).kernel == "vendor"


def test_is_additive_cases():
    table = torch.randn(4, 9)
    assert is_additive(lambda s, b, h, q, kv: table[h, q - kv + 4] + s)
    assert is_additive(lambda s, b, h, q, kv: s - table[h, q])
    assert is_additive(lambda s, b, h, q, kv: s)
    for mod in (
        lambda s, b, h, q, kv: s * 2,
        lambda s, b, h, q, kv: s + s,
        lambda s, b, h, q, kv: torch.add(s, q - kv, alpha=2),
        lambda s, b, h, q, kv: table[h, q] - s,
        lambda s, b, h, q, kv: torch.tanh(s / 30) * 30,
        lambda s, b, h, q, kv: torch.where(s > 60, -math.inf, s),
    ):
        assert not is_additive(mod)

    def branchy(s, b, h, q, kv):  # control flow on an index value: cannot be traced, so not additive
        return s if q > 3 else s + 1

    assert not is_additive(branchy)


def test_flex_argument_errors_name_the_argument():
    import pytest

    from selfattention import create_block_mask

    q = torch.randn(1, 1, 16, 8)
    with pytest.raises(
        TypeError, match=r"score_mod must take \(score, b, h, q_idx, kv_idx\), got a mask_mod"
    ):
        flex_attention(q, q, q, score_mod=lambda score, b, h, q_idx: score)
    with pytest.raises(TypeError, match="got a function of 6 positional arguments"):
        flex_attention(q, q, q, score_mod=lambda s, b, h, qi, kv, x: s)
    torch.testing.assert_close(flex_attention(q, q, q, score_mod=lambda *a: a[0]), flex_attention(q, q, q))
    with pytest.raises(TypeError, match="block_mask must be a BlockMask .* got Tensor .*attn_mask"):
        flex_attention(q, q, q, block_mask=torch.ones(16, 16, dtype=torch.bool))
    for bad in (128.0, (128,), (16, 0)):
        with pytest.raises(ValueError, match="BLOCK_SIZE must be a positive int or a pair"):
            create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, 16, 16, BLOCK_SIZE=bad)
    with pytest.raises(ValueError, match="Q_LEN must be a non-negative int, got -1"):
        create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, -1, 16)
