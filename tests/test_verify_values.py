"""The deferred NaN/inf check after a fused call (:func:`selfattention.kernels.call_ops.common_case`): a call
where every query sees every key looks at the lse only; what the spec says must still come out."""

from __future__ import annotations

import math

import pytest
import torch

from selfattention import functional
from selfattention.tiled import tiled_attention


def _inputs(where: str, row: int):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 50, 8, generator=g) for _ in range(3))
    t = {"q": q, "k": k, "v": v}[where]
    t[0, 1, row, 3] = math.nan
    return q, k, v


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_nan_gives_the_specs_rows(where, causal):
    q, k, v = _inputs(where, 20)
    with torch.no_grad():
        got = tiled_attention(q, k, v, is_causal=causal)
        ref = functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    assert torch.equal(got.isnan(), ref.isnan()), "NaN exactly in the spec's rows"
    ok = ~ref.isnan()
    assert torch.allclose(got.double()[ok], ref[ok], atol=1e-5)
    assert got.isnan().any()


def test_an_inf_value_seen_by_every_query():
    q, k, v = _inputs("q", 0)
    q = q.nan_to_num(0.0)
    v = v.clone()
    v[0, 0, 10, 2] = math.inf
    with torch.no_grad():
        got = tiled_attention(q, k, v)
        ref = functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert torch.equal(got.isinf(), ref.isinf()) and torch.equal(got.isnan(), ref.isnan())
