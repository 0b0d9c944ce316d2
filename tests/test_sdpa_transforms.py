"""torch.func.grad over ``selfattention.scaled_dot_product_attention`` (the entry point then calls the
registered op of :mod:`selfattention.ops`): gradients equal torch's math backend in float64, with a
float mask holding a finfo.min row and with torch's CausalBias (tests/test_compile.py covers vmap, jacrev
and batched gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_upper_left

import selfattention as sa

BACKENDS = ["reference", "torch", "tiled"]


def _math_grad(q, k, v, mask):
    def loss(q):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).square().sum()

    return torch.func.grad(loss)(q)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["none", "finfo_min_row", "causal_bias"])
def test_torch_func_grad_equals_the_math_gradient(backend, mask_kind):
    # torch.func.grad hands the backward a cotangent its transform tracks; the op's backward then ran
    # through torch.library's generated autograd.Function, which functorch refused (RuntimeError: "must
    # override the setup_context staticmethod")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 6, generator=g, dtype=torch.float64) for _ in range(3))
    mask = None
    ours = None
    if mask_kind == "finfo_min_row":
        mask = torch.zeros(5, 5, dtype=torch.float64)
        mask[1] = torch.finfo(torch.float64).min
        ours = mask
    elif mask_kind == "causal_bias":
        ours = causal_upper_left(5, 5)
        mask = ours._materialize()
    got = torch.func.grad(
        lambda q: sa.scaled_dot_product_attention(q, k, v, ours, backend=backend).square().sum()
    )(q)
    torch.testing.assert_close(got, _math_grad(q, k, v, mask), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("entry", ["tiled_attention", "torch_sdpa"])
def test_torch_func_grad_with_a_causal_bias_on_the_direct_entry_points(entry):
    # the direct entry points hand a CausalBias to the registered op too: its Visibility, not its storage
    from selfattention.backends import torch_sdpa
    from selfattention.tiled import tiled_attention

    fn = {"tiled_attention": tiled_attention, "torch_sdpa": torch_sdpa}[entry]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 5, 6, generator=g, dtype=torch.float64) for _ in range(3))
    got = torch.func.grad(lambda q: fn(q, k, v, causal_upper_left(5, 5)).square().sum())(q)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    torch.testing.assert_close(got, _math_grad(q, k, v, mask), atol=1e-10, rtol=1e-10)
