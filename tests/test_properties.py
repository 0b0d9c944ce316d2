"""Property tests (hypothesis) that every backend must satisfy for any shapes, masks and scales.

* permutation equivariance: permuting the keys (with their values and mask columns) changes nothing;
  permuting the queries permutes the output rows;
* the weights of a row sum to 1, or to 0 for a query with no visible key (on the backends, seen through
  an all-ones value: the output is then exactly the row sum);
* adding a constant to every score of a row changes nothing (a float mask constant per row);
* every backend equals the independent float64 oracle (tests/oracle.py), gradients equal the spec's.

Sizes stay small so that the oracle's loops are quick; ``max_examples`` is modest to keep CI fast.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import selfattention as sa
from selfattention.backends import available_backends, get_backend
from tests.oracle import attention_ref as _attention_ref

BACKENDS = available_backends()
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def attention_ref(q, k, v, mask=None, is_causal=False, scale=None):
    """The oracle, with empty sizes (which its reshapes cannot take) answered by definition."""
    if 0 in (*q.shape, *k.shape[:-1], v.shape[-1]):
        shape = (*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]), q.shape[-2])
        return torch.zeros(*shape, v.shape[-1], dtype=torch.float64), torch.zeros(
            *shape, k.shape[-2], dtype=torch.float64
        )
    return _attention_ref(q, k, v, mask, is_causal, scale)


@st.composite
def problems(draw, *, causal: bool = True, min_t: int = 0):
    """A random attention problem in float64: shapes, a bool or float mask (or none), causal, scale."""
    b = draw(st.integers(1, 2))
    h = draw(st.integers(1, 3))
    tq = draw(st.integers(min_t, 9))
    tk = draw(st.integers(min_t, 9))
    d = draw(st.integers(1, 9))
    dv = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    spread = draw(st.sampled_from([0.1, 1.0, 5.0]))
    q = torch.randn(b, h, tq, d, generator=g, dtype=torch.float64) * spread
    k = torch.randn(b, h, tk, d, generator=g, dtype=torch.float64) * spread
    v = torch.randn(b, h, tk, dv, generator=g, dtype=torch.float64)
    kind = draw(st.sampled_from(["none", "bool", "bool_bcast", "float"]))
    density = draw(st.sampled_from([0.2, 0.6, 0.95]))
    mask = None
    if kind == "bool":
        mask = torch.rand(b, h, tq, tk, generator=g) < density
    elif kind == "bool_bcast":
        mask = torch.rand(tq, tk, generator=g) < density
    elif kind == "float":
        mask = torch.randn(b, 1, tq, tk, generator=g, dtype=torch.float64)
        mask = mask.masked_fill(torch.rand(b, 1, tq, tk, generator=g) > density, -math.inf)
    is_causal = causal and draw(st.booleans())
    scale = draw(st.sampled_from([None, 0.0, 0.37, -1.5, 2.0]))
    return dict(query=q, key=k, value=v, attn_mask=mask, is_causal=is_causal, scale=scale)


def _visible(p) -> torch.Tensor:
    """(…, Tq, Tk) keys each query sees, built independently of the library."""
    q, k = p["query"], p["key"]
    tq, tk = q.shape[-2], k.shape[-2]
    vis = torch.ones(tq, tk, dtype=torch.bool)
    if p["is_causal"]:
        vis = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + (tk - tq)
    m = p["attn_mask"]
    if m is not None:
        vis = vis & (m if m.dtype == torch.bool else m != -math.inf)
    return vis.expand(*q.shape[:-2], tq, tk)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(p=problems())
def test_every_backend_equals_the_float64_oracle(backend, p):
    out = get_backend(backend)(**p)
    ref, _ = attention_ref(p["query"], p["key"], p["value"], p["attn_mask"], p["is_causal"], p["scale"])
    assert out.shape == ref.shape and out.dtype == torch.float64
    assert torch.allclose(out, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(p=problems(causal=False), data=st.data())
def test_permutation_equivariance(backend, p, data):
    """Permuting keys+values changes nothing; permuting queries permutes the output (masks follow)."""
    fn = get_backend(backend)
    tq, tk = p["query"].shape[-2], p["key"].shape[-2]
    pq = torch.tensor(data.draw(st.permutations(range(tq))), dtype=torch.long)
    pk = torch.tensor(data.draw(st.permutations(range(tk))), dtype=torch.long)
    out = fn(**p)
    m = p["attn_mask"]
    permuted = dict(
        p,
        query=p["query"][..., pq, :],
        key=p["key"][..., pk, :],
        value=p["value"][..., pk, :],
        attn_mask=None if m is None else m[..., pq, :][..., :, pk],
    )
    assert torch.allclose(fn(**permuted), out[..., pq, :], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(p=problems())
def test_rows_of_the_weights_sum_to_one_or_zero(backend, p):
    """With every value = 1 the output is the row sum of the weights: 1, or 0 for a blind query."""
    ones = torch.ones(*p["value"].shape[:-1], 1, dtype=torch.float64)
    out = get_backend(backend)(**dict(p, value=ones))[..., 0]
    expected = _visible(p).any(-1).to(torch.float64)
    assert torch.allclose(out, expected, atol=1e-12)


@SETTINGS
@given(p=problems())
def test_attention_weights_rows_sum_to_one_or_zero_and_hide_what_is_masked(p):
    w = sa.attention_weights(p["query"], p["key"], p["attn_mask"], p["is_causal"], p["scale"])
    vis = _visible(p)
    assert torch.allclose(w.sum(-1), vis.any(-1).to(w.dtype), atol=1e-12)
    assert (w[~vis] == 0).all() and (w >= 0).all()
    assert torch.allclose(
        w,
        attention_ref(p["query"], p["key"], p["value"], p["attn_mask"], p["is_causal"], p["scale"])[1],
        atol=1e-12,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(p=problems(min_t=1), shift=st.floats(-1e3, 1e3, allow_nan=False), data=st.data())
def test_adding_a_constant_to_a_row_of_scores_changes_nothing(backend, p, shift, data):
    """softmax(s + c) = softmax(s): a float mask that adds c_i to every score of row i is a no-op."""
    fn = get_backend(backend)
    tq = p["query"].shape[-2]
    consts = torch.tensor(
        data.draw(st.lists(st.floats(-50, 50), min_size=tq, max_size=tq)), dtype=torch.float64
    )
    row_const = (consts + shift)[:, None]  # (Tq, 1): broadcasts over the keys
    m = p["attn_mask"]
    if m is None:
        shifted = row_const.expand(tq, p["key"].shape[-2])
    elif m.dtype == torch.bool:
        base = torch.zeros(m.shape, dtype=torch.float64).masked_fill(~m, -math.inf)
        p = dict(p, attn_mask=base)
        shifted = base + row_const
    else:
        shifted = m + row_const
    out = fn(**p)
    out_shifted = fn(**dict(p, attn_mask=shifted))
    assert torch.allclose(out_shifted, out, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
@settings(max_examples=15, deadline=None)
@given(p=problems(min_t=1))
def test_gradients_equal_the_spec(backend, p):
    def grads(fn):
        leaves = {n: p[n].clone().requires_grad_() for n in ("query", "key", "value")}
        out = fn(**dict(p, **leaves))
        w = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
        (out * w).sum().backward()
        return [leaves[n].grad for n in ("query", "key", "value")]

    for got, ref in zip(grads(get_backend(backend)), grads(get_backend("reference")), strict=True):
        assert torch.isfinite(got).all()
        assert torch.allclose(got, ref, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(p=problems(), factor=st.sampled_from([0.5, 2.0, 3.0]))
def test_scale_multiplies_the_scores(backend, p, factor):
    """scale=s on q equals scale=1 on s·q; scale=None equals 1/√D (never confused with 0.0)."""
    fn = get_backend(backend)
    d = p["query"].shape[-1]
    s = 1 / math.sqrt(d) if p["scale"] is None else p["scale"]
    a = fn(**dict(p, scale=s * factor))
    b = fn(**dict(p, query=p["query"] * factor, scale=s))
    assert torch.allclose(a, b, atol=1e-10, rtol=1e-10)
    assert torch.allclose(fn(**dict(p, scale=None)), fn(**dict(p, scale=1 / math.sqrt(d))), atol=1e-12)
