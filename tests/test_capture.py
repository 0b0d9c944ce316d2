"""capture() records one event per attention call: its inputs and its steps together."""

from __future__ import annotations

import torch

import selfattention as sa
from selfattention.functional import attention_steps


def test_a_tiled_module_call_is_traced_with_its_own_inputs_and_steps():
    torch.manual_seed(0)
    layer = sa.SelfAttention(4, 3, backend="tiled")
    x, q = torch.randn(5, 4), torch.randn(2, 3)
    with sa.capture() as traces:
        out = layer(x)
        attention_steps(q, q, q)  # a bare call after it: no inputs of its own
    assert len(traces) == 2
    first, second = traces
    assert torch.equal(first["inputs"], x)
    ref = attention_steps(layer.W_query(x), layer.W_key(x), layer.W_value(x))
    assert torch.allclose(first["weights"], ref.weights) and torch.allclose(out, ref.context)
    assert second.inputs is None and torch.equal(second["query"], q)


def test_outside_capture_the_module_runs_its_backend():
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    tiled, ref = sa.SelfAttention(4, 3, backend="tiled"), sa.SelfAttention(4, 3)
    ref.load_state_dict(tiled.state_dict())
    assert torch.allclose(tiled(x), ref(x), atol=1e-6)


def test_every_call_of_several_modules_gets_its_own_inputs():
    torch.manual_seed(1)
    mha = sa.MultiHeadAttention(8, 2, backend="torch")
    simple = sa.SimpleSelfAttention()
    a, b = torch.randn(1, 3, 8), torch.randn(4, 2)
    with sa.capture() as traces:
        mha(a)
        simple(b)
        mha(a[:, :2])
    assert [t.inputs.shape for t in traces] == [(1, 3, 8), (4, 2), (1, 2, 8)]
    assert torch.equal(traces[1]["inputs"], b)
