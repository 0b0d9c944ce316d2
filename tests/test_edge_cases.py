"""One table of the edge cases that break other attention libraries, run against EVERY path.

Every backend that :func:`selfattention.backends.available_backends` returns is tested automatically
(a new backend, e.g. ``"tiled"``, cannot ship without passing this table). Each case builds its input,
the expected result comes from the independent float64 oracle (``tests/oracle.py``), never from the code
under test, and every case also checks that nothing the caller passed was modified in place.

The modules (``SelfAttention``, and ``MultiHeadAttention`` / ``KVCache`` when they exist) get the
same treatment further down; tests for paths that do not exist yet are skipped, not failed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import selfattention as sa
from selfattention import masks
from selfattention.backends import available_backends, get_backend
from tests.oracle import attention_ref

BACKENDS = available_backends()
NAN, INF = float("nan"), float("inf")


@dataclass
class Case:
    """An input and what every path must return for it.

    ``make(g)`` returns (kwargs for the backend, expected float64 context, bool (..., Tq) rows that must
    be NaN, or None). ``grad``: also run backward and check the gradients are finite where they should be,
    and zero for queries that see no key.
    """

    name: str
    make: Callable[[torch.Generator], tuple[dict, torch.Tensor, torch.Tensor | None]]
    grad: bool = True


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _oracle(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    return attention_ref(q, k, v, attn_mask, is_causal, scale)[0]


def _plain(q, k, v, **kw):
    return dict(query=q, key=k, value=v, **kw), _oracle(q, k, v, **kw), None


# ---------------------------------------------------------------------------------------------- the cases


def c_fully_masked_row_bool(g):
    q, k, v = _randn(g, 2, 3, 5, 6), _randn(g, 2, 3, 7, 6), _randn(g, 2, 3, 7, 4)
    mask = torch.rand(5, 7, generator=g) > 0.5
    mask[:, 0] = True
    mask[2] = False  # query 2 sees nothing
    return _plain(q, k, v, attn_mask=mask)


def c_fully_masked_row_float(g):
    q, k, v = _randn(g, 2, 5, 6), _randn(g, 2, 7, 6), _randn(g, 2, 7, 6)
    mask = _randn(g, 2, 5, 7)
    mask[:, 1] = -INF  # query 1 sees nothing (float mask of -inf)
    mask[0, 3, :4] = -INF
    return _plain(q, k, v, attn_mask=mask)


def c_every_row_masked(g):
    q, k, v = _randn(g, 1, 2, 4, 8), _randn(g, 1, 2, 6, 8), _randn(g, 1, 2, 6, 8)
    return _plain(q, k, v, attn_mask=torch.zeros(4, 6, dtype=torch.bool))


def c_first_key_block_fully_masked(g):
    # keys 0..79 hidden from every query: a tiled path's first block(s) see nothing (exp(-inf - -inf))
    q, k, v = _randn(g, 1, 1, 9, 59), _randn(g, 1, 1, 97, 59), _randn(g, 1, 1, 97, 31)
    mask = torch.ones(9, 97, dtype=torch.bool)
    mask[:, :80] = False
    mask[4, 80:] = False  # and one query sees nothing at all
    return _plain(q, k, v, attn_mask=mask)


def c_first_block_masked_for_some_queries(g):
    q, k, v = _randn(g, 2, 13, 7), _randn(g, 2, 97, 7), _randn(g, 2, 97, 5)
    mask = torch.rand(2, 13, 97, generator=g) > 0.3
    mask[:, :6, :70] = False  # some rows start with many hidden keys, others do not
    return _plain(q, k, v, attn_mask=mask)


def c_causal_q_shorter(g):  # a chunk of queries after cached keys: bottom-right
    q, k, v = _randn(g, 2, 3, 5, 59), _randn(g, 2, 3, 12, 59), _randn(g, 2, 3, 12, 59)
    return _plain(q, k, v, is_causal=True)


def c_causal_q_longer(g):  # Tq > Tk: the first Tq - Tk queries see no key -> zeros
    q, k, v = _randn(g, 2, 12, 8), _randn(g, 2, 5, 8), _randn(g, 2, 5, 3)
    return _plain(q, k, v, is_causal=True)


def c_causal_and_mask(g):
    q, k, v = _randn(g, 2, 2, 7, 8), _randn(g, 2, 2, 11, 8), _randn(g, 2, 2, 11, 8)
    mask = torch.rand(2, 1, 1, 11, generator=g) > 0.3  # key padding (B, 1, 1, Tk)
    return _plain(q, k, v, attn_mask=mask, is_causal=True)


def c_causal_and_float_mask(g):
    q, k, v = _randn(g, 2, 7, 8), _randn(g, 2, 9, 8), _randn(g, 2, 9, 8)
    mask = _randn(g, 7, 9)
    mask[:, 2] = -INF
    return _plain(q, k, v, attn_mask=mask, is_causal=True)


def c_scale_zero(g):  # 0.0 honoured (uniform weights), not treated as "default"
    q, k, v = _randn(g, 2, 5, 8), _randn(g, 2, 7, 8), _randn(g, 2, 7, 8)
    kw, expected, nan_rows = _plain(q, k, v, scale=0.0)
    assert torch.allclose(expected, v.double().mean(-2, keepdim=True).expand_as(expected))
    return kw, expected, nan_rows


def c_scale_negative(g):
    q, k, v = _randn(g, 4, 5), _randn(g, 6, 5), _randn(g, 6, 5)
    return _plain(q, k, v, scale=-2.5)


def c_scale_zero_causal(g):  # scale 0 with a plain causal square: each query averages its visible values
    q, k, v = _randn(g, 2, 6, 4), _randn(g, 2, 6, 4), _randn(g, 2, 6, 3)
    return _plain(q, k, v, is_causal=True, scale=0.0)


def c_scale_negative_causal(g):  # once NaN on the torch backend (SDPA's is_causal scales the −inf too)
    q, k, v = _randn(g, 2, 6, 4), _randn(g, 2, 6, 4), _randn(g, 2, 6, 3)
    return _plain(q, k, v, is_causal=True, scale=-1.5)


def c_single_token(g):  # T = 1: the output is the value itself
    q, k, v = _randn(g, 3, 1, 5), _randn(g, 3, 1, 5), _randn(g, 3, 1, 4)
    return _plain(q, k, v)


def c_one_visible_key(g):  # a row with exactly one visible key returns that value exactly
    q, k, v = _randn(g, 4, 6), _randn(g, 5, 6), _randn(g, 5, 6)
    mask = torch.zeros(4, 5, dtype=torch.bool)
    mask[torch.arange(4), torch.tensor([0, 4, 2, 2])] = True
    return _plain(q, k, v, attn_mask=mask)


def c_polarity_true_means_attend(g):  # hidden keys carry huge values: any leak is visible
    q, k, v = _randn(g, 2, 4, 8), _randn(g, 2, 6, 8), _randn(g, 2, 6, 8)
    mask = torch.tensor([True, False, True, False, True, True])
    v[:, ~mask] = 1e6
    k[:, ~mask] = 50.0
    return _plain(q, k, v, attn_mask=mask)


def c_key_padding_1d_on_4d(g):  # a (Tk,) mask on (B, H, T, D) inputs (torch's fused kernel needs 2-D)
    q, k, v = _randn(g, 2, 3, 4, 5), _randn(g, 2, 3, 6, 5), _randn(g, 2, 3, 6, 5)
    return _plain(q, k, v, attn_mask=torch.tensor([True, True, False, True, False, True]))


def c_scalar_float_mask(g):  # a 0-d float mask: a constant added to every score changes nothing
    q, k, v = _randn(g, 1, 2, 4, 5), _randn(g, 1, 2, 6, 5), _randn(g, 1, 2, 6, 5)
    kw, expected, nan_rows = _plain(q, k, v, attn_mask=torch.tensor(3.5))
    assert torch.allclose(expected, _oracle(q, k, v))
    return kw, expected, nan_rows


def c_gqa(g):
    q, k, v = _randn(g, 2, 6, 7, 10), _randn(g, 2, 2, 9, 10), _randn(g, 2, 2, 9, 10)
    return _plain(q, k, v, enable_gqa=True, is_causal=True)


def c_broadcast_batch(g):  # key/value shared across the batch (1, H, Tk, D)
    q, k, v = _randn(g, 3, 2, 5, 6), _randn(g, 1, 2, 8, 6), _randn(g, 1, 2, 8, 6)
    return _plain(q, k, v, attn_mask=torch.rand(5, 8, generator=g) > 0.2)


def c_unbatched_2d(g):
    q, k, v = _randn(g, 7, 59), _randn(g, 7, 59), _randn(g, 7, 59)
    return _plain(q, k, v, is_causal=True)


def c_non_contiguous(g):
    q = _randn(g, 2, 5, 3, 6).transpose(1, 2)  # (2, 3, 5, 6), strided
    k = _randn(g, 2, 9, 3, 6).transpose(1, 2)
    v = _randn(g, 2, 3, 6, 9).transpose(-1, -2)
    return _plain(q, k, v, is_causal=True)


def c_float64_exact(g):
    q, k, v = (_randn(g, 2, 7, 59, dtype=torch.float64) for _ in range(3))
    return _plain(q, k, v, attn_mask=torch.rand(7, 7, generator=g) > 0.4)


def c_empty_queries(g):  # Tq = 0 -> empty output
    q, k, v = _randn(g, 2, 3, 0, 6), _randn(g, 2, 3, 4, 6), _randn(g, 2, 3, 4, 5)
    return dict(query=q, key=k, value=v), torch.zeros(2, 3, 0, 5, dtype=torch.float64), None


def c_empty_keys(g):  # Tk = 0 -> zeros, even for a query holding NaN
    q, k, v = _randn(g, 2, 3, 6), _randn(g, 2, 0, 6), _randn(g, 2, 0, 5)
    q[0, 1, 2] = NAN
    return dict(query=q, key=k, value=v), torch.zeros(2, 3, 5, dtype=torch.float64), None


def c_empty_both_causal(g):
    q, k, v = _randn(g, 2, 0, 6), _randn(g, 2, 0, 6), _randn(g, 2, 0, 5)
    return dict(query=q, key=k, value=v, is_causal=True), torch.zeros(2, 0, 5, dtype=torch.float64), None


def c_empty_batch(g):
    q, k, v = _randn(g, 0, 2, 3, 4), _randn(g, 0, 2, 5, 4), _randn(g, 0, 2, 5, 4)
    return dict(query=q, key=k, value=v), torch.zeros(0, 2, 3, 4, dtype=torch.float64), None


def c_empty_batch_broadcast(g):  # B = 0 broadcast against B = 1 is an empty batch (found by the fuzzer)
    q, k, v = _randn(g, 1, 1, 3, 4), _randn(g, 0, 1, 3, 4), _randn(g, 0, 1, 3, 4)
    return dict(query=q, key=k, value=v), torch.zeros(0, 1, 3, 4, dtype=torch.float64), None


def c_zero_heads(g):  # H = 0 once crashed the fused CPU kernel (SIGFPE, found by the fuzzer)
    q, k, v = _randn(g, 1, 0, 4, 2), _randn(g, 1, 0, 3, 2), _randn(g, 1, 0, 3, 2)
    return dict(query=q, key=k, value=v, is_causal=True), torch.zeros(1, 0, 4, 2, dtype=torch.float64), None


def _dirty(q, k, v, mask, is_causal=False, bad_keys=(), bad_values=()):
    """Expected from clean inputs, then NaN/inf written into keys/values the mask hides."""
    kw, expected, _ = _plain(q, k, v, attn_mask=mask, is_causal=is_causal)
    k, v = k.clone(), v.clone()
    for idx, val in bad_keys:
        k[idx] = val
    for idx, val in bad_values:
        v[idx] = val
    kw.update(key=k, value=v)
    return kw, expected, None


def c_nan_in_key_hidden_from_all(g):
    q, k, v = _randn(g, 2, 5, 6), _randn(g, 2, 7, 6), _randn(g, 2, 7, 6)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[:, 3] = False
    return _dirty(q, k, v, mask, bad_keys=[((..., 3, slice(None)), NAN)], bad_values=[((..., 3, 0), INF)])


def c_inf_in_hidden_key_and_value_some_rows(g):
    q, k, v = _randn(g, 2, 6, 5), _randn(g, 2, 8, 5), _randn(g, 2, 8, 5)
    mask = torch.rand(2, 6, 8, generator=g) > 0.4
    mask[:, :, 0] = True
    mask[:, :, 5] = False
    mask[:, 1, 2] = False  # key 2 hidden from query 1 only ...
    mask[:, 0, 2] = True
    kw, expected, _ = _plain(q, k, v, attn_mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[:, 5] = INF
    v2[:, 5] = -INF
    v2[:, 7, 1] = NAN
    kw.update(key=k2, value=v2)
    # key 7 / value 7 is visible to some rows: those rows' column 1 become NaN, nothing else changes
    sees7 = mask[:, :, 7]  # (2, 6)
    expected = expected.clone()
    expected[..., 1] = torch.where(sees7, torch.full_like(expected[..., 1], NAN), expected[..., 1])
    return kw, expected, None


def c_neg_inf_key_hidden_float_mask(g):
    q, k, v = _randn(g, 3, 4, 6), _randn(g, 3, 5, 6), _randn(g, 3, 5, 6)
    mask = torch.zeros(4, 5)
    mask[:, 0] = -INF
    mask[1, 1:] = -INF  # query 1 sees nothing
    return _dirty(q, k, v, mask, bad_keys=[((..., 0, slice(None)), -INF)], bad_values=[((..., 0, 2), NAN)])


def c_nan_in_visible_key(g):  # NaN in, NaN out: the rows that see it are NaN, the others are exact
    q, k, v = _randn(g, 2, 5, 6), _randn(g, 2, 7, 6), _randn(g, 2, 7, 6)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[:2, 4] = False  # queries 0, 1 do not see key 4
    kw, expected, _ = _plain(q, k, v, attn_mask=mask)
    k = k.clone()
    k[:, 4, 1] = NAN
    kw["key"] = k
    nan_rows = mask[:, 4].expand(2, 5)
    return kw, expected, nan_rows


def c_nan_in_visible_value(g):
    q, k, v = _randn(g, 5, 6), _randn(g, 7, 6), _randn(g, 7, 6)
    kw, expected, _ = _plain(q, k, v, is_causal=True)
    v = v.clone()
    v[6] = NAN  # only the last query (position 6) sees value 6
    kw["value"] = v
    nan_rows = torch.tensor([False, False, False, False, True])
    return kw, expected, nan_rows


def c_nan_in_query_of_masked_row(g):  # a query that sees nothing returns zeros, whatever it holds
    q, k, v = _randn(g, 4, 6), _randn(g, 5, 6), _randn(g, 5, 6)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    kw, expected, _ = _plain(q, k, v, attn_mask=mask)
    q = q.clone()
    q[2] = NAN
    kw["query"] = q
    return kw, expected, None


def c_large_scores_float32(g):  # scores of ±1e4 in float32: stable softmax, no overflow
    q = _randn(g, 2, 6, 16)
    k = _randn(g, 2, 9, 16)
    q = q / q.norm(dim=-1, keepdim=True) * 400.0
    k = k / k.norm(dim=-1, keepdim=True) * 100.0  # |q·k|/4 up to 1e4
    v = _randn(g, 2, 9, 5)
    kw, expected, nan_rows = _plain(q, k, v)
    scores = q.double() @ k.double().transpose(-1, -2) / 4
    assert scores.abs().max() > 5e3
    return kw, expected, nan_rows


def c_float16_products_overflow(g):  # q·k = 230400 > 65504, but q·k·scale = 28800 is finite
    q = (60.0 + _randn(g, 2, 5, 64)).half()
    k = (60.0 + _randn(g, 2, 7, 64)).half()
    v = _randn(g, 2, 7, 64).half()
    assert (q.double() @ k.double().transpose(-1, -2)).max() > 65504
    return _plain(q, k, v)


def c_float16_large_causal(g):
    q = (_randn(g, 1, 2, 33, 40) * 30).half()
    k = (_randn(g, 1, 2, 33, 40) * 30).half()
    v = _randn(g, 1, 2, 33, 40).half()
    return _plain(q, k, v, is_causal=True)


def c_bfloat16(g):
    q, k, v = (_randn(g, 2, 9, 12, dtype=torch.bfloat16) for _ in range(3))
    return _plain(q, k, v, attn_mask=torch.rand(9, 9, generator=g) > 0.3)


def c_head_dim_zero(g):  # D = 0: every score is 0, the weights are uniform over the visible keys
    q, k, v = _randn(g, 2, 3, 0), _randn(g, 2, 4, 0), _randn(g, 2, 4, 5)
    # causal, Tq = 3, Tk = 4: query i sees keys 0 .. i + 1 -> the mean of the first i + 2 values
    expected = torch.stack([v[:, : i + 2].double().mean(1) for i in range(3)], dim=1)
    return dict(query=q, key=k, value=v, is_causal=True), expected, None


def c_value_dim_differs(g):
    q, k, v = _randn(g, 2, 7, 59), _randn(g, 2, 12, 59), _randn(g, 2, 12, 3)
    return _plain(q, k, v, attn_mask=torch.rand(2, 7, 12, generator=g) > 0.5)


def c_long_sequence(g):  # T = 1025 (one past a power of two), D = 59
    q, k, v = _randn(g, 1, 1, 1025, 59), _randn(g, 1, 1, 1025, 59), _randn(g, 1, 1, 1025, 59)
    kw = dict(query=q, key=k, value=v, is_causal=True)
    # the oracle's loops are slow at this size: the float64 spec (itself checked against the oracle on
    # smaller sizes) stands in, and the oracle checks a sample of rows
    exp = sa.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    rows = torch.tensor([0, 1, 511, 1024])
    causal_rows = torch.arange(1025)[None, :] <= rows[:, None]  # (4, Tk): query i sees keys 0..i
    ref = attention_ref(q[..., rows, :], k, v, causal_rows)[0]
    assert torch.allclose(exp[..., rows, :], ref, atol=1e-10)
    return kw, exp, None


CASES = [
    Case("fully_masked_row_bool", c_fully_masked_row_bool),
    Case("fully_masked_row_float_-inf", c_fully_masked_row_float),
    Case("every_row_masked", c_every_row_masked),
    Case("first_key_block_fully_masked", c_first_key_block_fully_masked),
    Case("first_block_masked_for_some_queries", c_first_block_masked_for_some_queries),
    Case("causal_bottom_right_Tq<Tk", c_causal_q_shorter),
    Case("causal_bottom_right_Tq>Tk", c_causal_q_longer),
    Case("causal_and_bool_mask", c_causal_and_mask),
    Case("causal_and_float_mask", c_causal_and_float_mask),
    Case("scale_0.0_honoured", c_scale_zero),
    Case("scale_negative", c_scale_negative),
    Case("scale_0.0_causal", c_scale_zero_causal),
    Case("scale_negative_causal", c_scale_negative_causal),
    Case("single_token", c_single_token),
    Case("one_visible_key", c_one_visible_key),
    Case("bool_True_means_attend", c_polarity_true_means_attend),
    Case("key_padding_1d_mask_on_4d", c_key_padding_1d_on_4d),
    Case("scalar_float_mask", c_scalar_float_mask),
    Case("gqa", c_gqa),
    Case("broadcast_batch", c_broadcast_batch),
    Case("unbatched_2d", c_unbatched_2d),
    Case("non_contiguous", c_non_contiguous),
    Case("float64_exact", c_float64_exact),
    Case("empty_queries_Tq=0", c_empty_queries),
    Case("empty_keys_Tk=0", c_empty_keys),
    Case("empty_both_causal", c_empty_both_causal),
    Case("empty_batch_B=0", c_empty_batch),
    Case("zero_heads_H=0", c_zero_heads),
    Case("empty_batch_broadcast", c_empty_batch_broadcast),
    Case("nan_inf_in_key_hidden_from_all", c_nan_in_key_hidden_from_all),
    Case("nan_inf_in_key_hidden_from_some", lambda g: _hidden_from_some(g)),
    Case("inf_in_hidden_key_value_some_rows", c_inf_in_hidden_key_and_value_some_rows),
    Case("-inf_key_hidden_by_float_mask", c_neg_inf_key_hidden_float_mask),
    Case("nan_in_visible_key_gives_nan", c_nan_in_visible_key, grad=False),
    Case("nan_in_visible_value_gives_nan", c_nan_in_visible_value, grad=False),
    Case("nan_query_in_masked_row", c_nan_in_query_of_masked_row),
    Case("scores_1e4_float32", c_large_scores_float32),
    Case("float16_products_overflow", c_float16_products_overflow),
    Case("float16_large_causal", c_float16_large_causal),
    Case("bfloat16", c_bfloat16),
    Case("head_dim_0", c_head_dim_zero),
    Case("value_dim_differs", c_value_dim_differs),
    Case("T=1025_causal", c_long_sequence, grad=False),
]


def _hidden_from_some(g):
    """Key 6 is visible to the last query only (causal); the others must not see its NaN/inf."""
    q, k, v = _randn(g, 2, 3, 7, 6), _randn(g, 2, 3, 7, 6), _randn(g, 2, 3, 7, 6)
    kw, expected, _ = _plain(q, k, v, is_causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[..., 6, :] = NAN
    v2[..., 6, :2] = INF
    v2[..., 5, 2] = -INF  # value 5, column 2: seen by queries 5 and 6 -> -inf there
    kw.update(key=k2, value=v2)
    expected = expected.clone()
    expected[..., 5, 2] = -INF
    nan_rows = torch.zeros(2, 3, 7, dtype=torch.bool)
    nan_rows[..., 6] = True
    return kw, expected, nan_rows


_TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (6e-2, 6e-2),
}


def _snapshot(kw: dict) -> dict:
    return {n: t.clone() for n, t in kw.items() if isinstance(t, torch.Tensor)}


def _assert_unchanged(kw: dict, before: dict) -> None:
    for name, old in before.items():
        assert torch.equal(torch.nan_to_num(kw[name]), torch.nan_to_num(old)), f"{name} was modified in place"
        assert torch.equal(torch.isnan(kw[name]), torch.isnan(old)), f"{name} was modified in place"


def _check_result(out: torch.Tensor, kw: dict, expected: torch.Tensor, nan_rows: torch.Tensor | None):
    q = kw["query"]
    assert out.shape == expected.shape, f"shape {tuple(out.shape)} != {tuple(expected.shape)}"
    assert out.dtype == q.dtype and out.device == q.device
    atol, rtol = _TOL[q.dtype]
    o = out.double()
    if nan_rows is not None:
        rows = nan_rows.expand(out.shape[:-1])
        assert torch.isnan(o[rows]).all(), "NaN in an attended key/value must give NaN"
        o, expected = o[~rows], expected[~rows]
    assert torch.equal(torch.isnan(o), torch.isnan(expected)), "NaN where the result is not NaN (or back)"
    assert torch.equal(torch.isinf(o), torch.isinf(expected)), "inf pattern differs"
    fin = torch.isfinite(expected)
    assert torch.allclose(
        o[fin],
        expected[fin],
        atol=atol * max(1.0, expected[fin].abs().max().item() if fin.any() else 1.0),
        rtol=rtol,
    )
    # a query that sees nothing returns exactly zero
    return o


def _blind_queries(kw: dict) -> torch.Tensor | None:
    """Bool (..., Tq): queries with no visible key, or None when there are none."""
    q, k = kw["query"], kw["key"]
    tq, tk = q.shape[-2], k.shape[-2]
    vis = torch.ones(tq, tk, dtype=torch.bool)
    if kw.get("is_causal"):  # query i at position tk - tq + i sees keys 0 .. tk - tq + i
        vis = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
    m = kw.get("attn_mask")
    if m is not None:
        vis = vis & (m if m.dtype == torch.bool else m != -INF)
    blind = ~vis.any(-1)
    return blind if blind.any() else None


_MADE: dict[str, tuple] = {}


def _made(case: Case) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """The case's input (fresh copies) and expectation, built once per session (the oracle is slow)."""
    if case.name not in _MADE:
        _MADE[case.name] = case.make(torch.Generator().manual_seed(sum(map(ord, case.name))))
    kw, expected, nan_rows = _MADE[case.name]
    kw = {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    return kw, expected, nan_rows


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_edge_case_table(case: Case, backend: str):
    g = torch.Generator().manual_seed(sum(map(ord, case.name)))
    kw, expected, nan_rows = _made(case)
    before = _snapshot(kw)
    fn = get_backend(backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no unexpected warnings either
        out = fn(**kw)
    _check_result(out, kw, expected, nan_rows)
    blind = _blind_queries(kw)
    if blind is not None and out.numel():
        assert torch.equal(
            out[blind.expand(out.shape[:-1])], torch.zeros_like(out[blind.expand(out.shape[:-1])])
        )
    _assert_unchanged(kw, before)
    # the public entry point with backend= gives the same
    out2 = sa.scaled_dot_product_attention(**kw, backend=backend)
    assert torch.equal(torch.nan_to_num(out2), torch.nan_to_num(out))
    if not case.grad or out.numel() == 0 or kw["query"].dtype in (torch.float16, torch.bfloat16):
        return
    grads = _grads(fn, kw, g)
    if nan_rows is None and torch.isfinite(expected).all():
        for name, gr in grads.items():
            assert torch.isfinite(gr).all(), f"non-finite gradient for {name}"
    if blind is not None:
        gq = grads["query"]
        assert torch.equal(gq[blind.expand(gq.shape[:-1])], torch.zeros_like(gq[blind.expand(gq.shape[:-1])]))
    _assert_unchanged(kw, before)


def _grads(fn, kw: dict, g: torch.Generator) -> dict[str, torch.Tensor]:
    leaves = {n: kw[n].detach().clone().requires_grad_() for n in ("query", "key", "value")}
    out = fn(**{**kw, **leaves})
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    (torch.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0) * weight).sum().backward()
    return {n: t.grad if t.grad is not None else torch.zeros_like(t) for n, t in leaves.items()}


# ------------------------------------------------------------------- gradients against the float64 oracle


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_float64_with_masked_rows_and_hidden_nan(backend):
    g = torch.Generator().manual_seed(11)
    q, k, v = (_randn(g, 2, 6, 5, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(6, 6, generator=g) > 0.4
    mask[:, 0] = True
    mask[3] = False
    mask[:, 4] = False
    w = _randn(g, 2, 6, 5, dtype=torch.float64)

    def grads(fn, kk, vv):
        leaves = [t.clone().requires_grad_() for t in (q, kk, vv)]
        (fn(*leaves, attn_mask=mask) * w).sum().backward()
        return [t.grad for t in leaves]

    ref = grads(
        lambda a, b, c, attn_mask: sa.scaled_dot_product_attention(a, b, c, attn_mask=attn_mask), k, v
    )
    k2, v2 = k.clone(), v.clone()
    k2[:, 4] = NAN
    v2[:, 4] = INF
    got = grads(get_backend(backend), k2, v2)
    for r, o in zip(ref, got, strict=True):
        assert torch.isfinite(o).all()
        assert torch.allclose(o, r, atol=1e-10)
    assert torch.equal(got[0][:, 3], torch.zeros(2, 5, dtype=torch.float64))  # blind query: zero gradient
    # and the spec's gradient itself against finite differences
    assert torch.autograd.gradcheck(
        lambda a, b, c: sa.scaled_dot_product_attention(a, b, c, attn_mask=mask),
        tuple(t[:1].clone().requires_grad_() for t in (q, k, v)),
    )


# ---------------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_mask_of_zeros_and_ones_warns_on_every_backend(backend):
    q = k = v = torch.randn(3, 4)
    with pytest.warns(sa.FloatMaskWarning, match="bool"):
        get_backend(backend)(q, k, v, attn_mask=torch.tensor([[1.0, 0.0, 1.0]]).expand(3, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_backend(backend)(q, k, v, attn_mask=torch.tensor([0.0, -INF, 0.5]))  # a real additive mask


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_mha_mask_converts_to_the_same_result_as_torch_mha(backend):
    """``masks.from_torch_mha`` makes torch.nn.MultiheadAttention's True = blocked masks usable here."""
    g = torch.Generator().manual_seed(12)
    torch.manual_seed(12)
    e, t = 8, 6
    mha = torch.nn.MultiheadAttention(e, num_heads=1, bias=False, batch_first=True).double()
    x = torch.randn(2, t, e, generator=g, dtype=torch.float64)
    blocked = torch.rand(t, t, generator=g) > 0.6
    blocked[:, 0] = False
    pad_blocked = torch.tensor([[False] * t, [False] * (t - 2) + [True, True]])
    expected, _ = mha(x, x, x, attn_mask=blocked, key_padding_mask=pad_blocked, need_weights=False)
    wq, wk, wv = mha.in_proj_weight.chunk(3)
    keep = masks.combine(masks.from_torch_mha(blocked), masks.from_torch_mha(pad_blocked)[:, None, :])
    ctx = get_backend(backend)(x @ wq.T, x @ wk.T, x @ wv.T, attn_mask=keep)
    ours = mha.out_proj(ctx)
    assert torch.allclose(ours, expected, atol=1e-10)
    # passing torch's mask unconverted would be the polarity bug: it gives a different answer
    assert not torch.allclose(
        mha.out_proj(get_backend(backend)(x @ wq.T, x @ wk.T, x @ wv.T, attn_mask=~keep)), expected
    )
    # float masks are additive in both conventions and pass through unchanged
    fm = torch.randn(t, t, dtype=torch.float64)
    assert masks.from_torch_mha(fm) is fm


def test_from_torch_mha_rejects_other_dtypes():
    with pytest.raises(TypeError, match="bool or floating"):
        masks.from_torch_mha(torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        masks.from_torch_mha([[True]])


# ---------------------------------------------------------------------------------------- modules


@pytest.mark.parametrize("backend", BACKENDS)
def test_self_attention_module_edge_cases(backend):
    torch.manual_seed(13)
    layer = sa.SelfAttention(d_in=6, d_out=5, backend=backend).double()
    x = torch.randn(2, 7, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(7, 7, dtype=torch.bool)
    mask[4] = False
    x_before = x.detach().clone()
    out = layer(x, attn_mask=mask, is_causal=True)
    q, k, v = layer.W_query(x), layer.W_key(x), layer.W_value(x)
    assert torch.allclose(out, attention_ref(q, k, v, mask, is_causal=True)[0], atol=1e-10)
    assert torch.equal(out[:, 4], torch.zeros(2, 5, dtype=torch.float64))
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
    assert torch.isfinite(x.grad).all()
    assert torch.equal(x.detach(), x_before)
    assert layer(x[:, :0]).shape == (2, 0, 5)


def _mha_module():
    mha = pytest.importorskip("selfattention.mha")
    if not hasattr(mha, "MultiHeadAttention"):
        pytest.skip("selfattention.mha.MultiHeadAttention not there yet")
    return mha.MultiHeadAttention


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_head_attention_blind_query_and_nan_padding(backend):
    cls = _mha_module()
    torch.manual_seed(14)
    layer = cls(embed_dim=12, num_heads=4, num_kv_heads=2, backend=backend).double().eval()
    x = torch.randn(2, 6, 12, dtype=torch.float64)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[2] = False  # query 2 sees nothing -> context 0 -> output = out_proj.bias
    before = x.clone()
    out, _ = layer(x, attn_mask=mask)
    assert torch.isfinite(out).all()
    assert torch.allclose(out[:, 2], layer.out_proj.bias.expand(2, 12), atol=1e-12)
    assert torch.equal(x, before)
    # a padding token full of NaN (key_padding_mask False = padding) leaks into no real token
    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[1, 4:] = False
    ref, _ = layer(x, key_padding_mask=pad, is_causal=True)
    x2 = x.clone()
    x2[1, 4:] = NAN
    out2, _ = layer(x2, key_padding_mask=pad, is_causal=True)
    assert torch.allclose(out2[0], ref[0], atol=1e-12) and torch.allclose(out2[1, :4], ref[1, :4], atol=1e-12)
    assert torch.isfinite(out2[1, :4]).all()
    # with the padding QUERIES blind as well (a 4-D mask), even the gradients stay finite
    blind_pad = pad[:, None, :, None] & pad[:, None, None, :]  # (B, 1, Tq, Tk)
    x3 = x2.clone().requires_grad_()
    out3, _ = layer(x3, attn_mask=blind_pad, is_causal=True)
    assert torch.allclose(out3[1, 4:], layer.out_proj.bias.expand(2, 12), atol=1e-12)
    out3.sum().backward()
    # (the projections' weight gradients do get NaN: nn.Linear multiplies the NaN inputs by zero)
    assert torch.isfinite(x3.grad[0]).all() and torch.isfinite(x3.grad[1, :4]).all()


def test_multi_head_attention_sizes_that_do_not_divide():
    cls = _mha_module()
    with pytest.raises(ValueError, match=r"embed_dim \(10\).*num_heads \(4\)"):
        cls(embed_dim=10, num_heads=4)
    with pytest.raises(ValueError, match=r"num_heads \(4\).*num_kv_heads \(3\)"):
        cls(embed_dim=12, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"num_heads must be a positive int, got 0"):
        cls(embed_dim=12, num_heads=0)
    layer = cls(embed_dim=12, num_heads=4)
    with pytest.raises(ValueError, match=r"\(2, 5, 11\).*12|12.*\(2, 5, 11\)"):  # actual shape and E
        layer(torch.randn(2, 5, 11))
    with pytest.raises(TypeError, match="floating"):
        layer(torch.ones(2, 5, 12, dtype=torch.int64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 3])
def test_kv_cache_offsets_chunked_prefill_and_decode_equal_full_causal(backend, window):
    """Prefill 5 tokens, a chunk of 3, then 4 single decode steps: every output equals the full causal
    (or sliding-window) pass over all 12 tokens: an off-by-one in the offsets would shift the masks."""
    cls = _mha_module()
    kv = pytest.importorskip("selfattention.kv_cache")
    torch.manual_seed(15)
    layer = cls(embed_dim=12, num_heads=4, num_kv_heads=2, backend=backend).double().eval()
    x = torch.randn(2, 12, 12, dtype=torch.float64)
    if window is None:
        full, _ = layer(x, is_causal=True)
    else:
        full, _ = layer(x, attn_mask=masks.sliding_window_mask(12, window=window))
    cache = layer.new_cache(batch_size=2, capacity=12, window=window)
    assert isinstance(cache, kv.KVCache) and cache.offset == 0
    pieces, pos = [], 0
    for n in (5, 3, 1, 1, 1, 1):
        out, _ = layer(x[:, pos : pos + n], kv_cache=cache)
        pieces.append(out)
        pos += n
        assert cache.offset == pos
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-10)
    # full cache: one more token is a clear error, not a silent overwrite
    if window is None:
        with pytest.raises(ValueError, match="capacity"):
            layer(x[:, :1], kv_cache=cache)


def test_non_tensor_backend_name_and_unknown_backend_are_clear():
    q = torch.randn(3, 4)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        sa.scaled_dot_product_attention(q, q, q, backend="nope")
    with pytest.raises(ValueError, match="unknown attention backend"):
        sa.SelfAttention(4, 4, backend="nope")(q)


# ------------------------------------------------- non-finite values: only the keys a row sees count


def _per_row_ieee(q, k, v, mask):
    """Row by row with plain Python floats over the visible keys only: IEEE inf/NaN arithmetic, and a hidden
    key takes no part at all (independent of the library's guarded products)."""
    out = torch.zeros(q.shape[-2], v.shape[-1], dtype=torch.float64)
    for i in range(q.shape[-2]):
        keys = [j for j in range(k.shape[-2]) if mask[i, j]]
        s = torch.stack([q[i] @ k[j] for j in keys]) / q.shape[-1] ** 0.5
        w = torch.softmax(s, dim=0).tolist()
        for c in range(v.shape[-1]):
            acc = 0.0
            for wj, j in zip(w, keys, strict=True):
                acc += wj * float(v[j, c])
            out[i, c] = acc
    return out


@pytest.mark.parametrize(
    "backend,blocks", [(b, None) for b in BACKENDS] + [("tiled", (1, 1)), ("tiled", (2, 3))]
)
def test_a_visible_inf_value_is_not_poisoned_by_a_hidden_nan(backend, blocks):
    # row 0 sees key 0 only (value +inf in column 0); key 1's value is NaN in column 0, hidden from row 0;
    # rows 2 and 3 see +inf and −inf in column 1 (→ NaN); row 1 sees the NaN (→ NaN in column 0)
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(4, 3, generator=g, dtype=torch.float64)
    v[0, 0], v[1, 0], v[2, 1], v[3, 1] = INF, NAN, -INF, INF
    mask = torch.tensor(
        [[1, 0, 0, 0],
         [1, 1, 0, 0],
         [0, 0, 1, 1],
         [1, 0, 1, 1]], dtype=torch.bool,
    )  # fmt: skip
    want = _per_row_ieee(q, k, v, mask)
    assert want[0, 0] == INF and torch.isnan(want[1, 0]) and torch.isnan(want[2, 1])  # the case is live
    extra = {} if blocks is None else {"block_q": blocks[0], "block_k": blocks[1]}
    for kernel in (None, "exact") if backend == "tiled" else (None,):
        kw = dict(extra, kernel=kernel) if backend == "tiled" else extra
        fn = sa.tiled.tiled_attention if backend == "tiled" else get_backend(backend)
        out = fn(q[None], k[None], v[None], mask, **kw)[0]
        torch.testing.assert_close(out, want, equal_nan=True, rtol=1e-12, atol=1e-12)


def test_a_visible_nan_value_under_a_weight_that_underflows_to_zero_is_nan_as_in_the_spec():
    """Tq = 2 < Tk = 3, causal bottom-right: query 0 sees keys 0–1 and its weight on key 1 is exp(−1100),
    exactly 0 in float64; key 1's value is NaN. IEEE gives 0 · NaN = NaN (the spec, torch); the tiled
    engine merged the block holding key 1 with weight 0 and dropped it (a new user's fuzz run). A block
    that saw nothing (lse −inf) still contributes nothing."""
    nan = float("nan")
    q = torch.tensor([[100.0], [0.0]], dtype=torch.float64)
    k = torch.tensor([[1.0], [-10.0], [0.0]], dtype=torch.float64)
    v = torch.tensor([[1.0], [nan], [2.0]], dtype=torch.float64)
    ref = sa.scaled_dot_product_attention(q, k, v, is_causal=True, backend="reference")
    got = sa.scaled_dot_product_attention(q, k, v, is_causal=True, backend="tiled")
    assert torch.isnan(ref).all() and torch.isnan(got).all()
    hidden = torch.tensor([[100.0], [0.0], [5.0]], dtype=torch.float64)  # key 2 hidden from query 0
    v2 = torch.tensor([[1.0], [2.0], [nan]], dtype=torch.float64)
    out = sa.scaled_dot_product_attention(q, hidden, v2, is_causal=True, backend="tiled")
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()
