"""Issue 19's defects of the drop-in: each test failed on the code before the fix.

Oracles: zeros where nothing can be attended (the docstring's promise, and what torch's autograd gives the
other backends), the module's own uncached cross-attention, transformers' window rule (a key is hidden
when it is W or more positions before the query).
"""

from __future__ import annotations

import gc
import os
import types
import warnings
import weakref

import pytest
import torch

import selfattention
from selfattention import MultiHeadAttention
from selfattention.kernels import vendor
from selfattention.tiled import tiled_attention

BACKENDS = ["reference", "torch", "tiled"]


# ------------------------------------------------------------------------------------ 1: Tk = 0 gradients
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("tq", "tk"), [(3, 0), (0, 0), (0, 4)])
def test_empty_keys_or_queries_give_zero_gradients_not_none(backend, tq, tk):
    q = torch.randn(2, 3, tq, 5, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, tk, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, tk, 7, dtype=torch.float64, requires_grad=True)
    out = selfattention.scaled_dot_product_attention(q, k, v, backend=backend)
    assert out.shape == (2, 3, tq, 7) and torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for name, t in (("query", q), ("key", k), ("value", v)):
        assert t.grad is not None, f"{name}.grad is None on {backend}"
        assert torch.equal(t.grad, torch.zeros_like(t)), name


# --------------------------------------------------------------------------- 2: backward twice, one graph
@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_twice_through_one_graph(backend):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 6, generator=g, requires_grad=True) for _ in range(3))
    out = selfattention.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    out.sum().backward(retain_graph=True)
    first = q.grad.clone()
    q.grad = None
    (out**2).sum().backward()  # a second backward through the same graph
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = selfattention.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    (dq1,) = torch.autograd.grad(ref.sum(), q64, retain_graph=True)
    (dq2,) = torch.autograd.grad((ref**2).sum(), q64)
    assert (first.double() - dq1).abs().max() <= 1e-5
    assert (q.grad.double() - dq2).abs().max() <= 1e-5


# ------------------------------------------------------------------ 3: hf sliding window guard off by one
def test_mask_less_single_query_over_w_plus_one_keys_is_refused():
    pytest.importorskip("transformers")
    from selfattention import hf

    hf.register()
    w = 3
    module = types.SimpleNamespace(is_causal=True, training=False, num_key_value_groups=1, sinks=None)
    module.config = types.SimpleNamespace(_attn_implementation="selfattention")
    q = torch.randn(1, 2, 1, 4)
    k = v = torch.randn(1, 2, w + 1, 4)
    # one query at position W over W + 1 keys: key 0 is W positions back, outside the window
    with pytest.raises(ValueError, match=f"sliding_window={w}"):
        hf.attention_forward(module, q, k, v, None, sliding_window=w)
    # W keys all fit: allowed, and equal to plain attention
    out, _ = hf.attention_forward(module, q, k[..., :w, :], v[..., :w, :], None, sliding_window=w)
    ref = selfattention.functional.scaled_dot_product_attention(q, k[..., :w, :], v[..., :w, :])
    assert (out.transpose(1, 2) - ref).abs().max() <= 1e-6


# ------------------------------------------------------------------- 4: register() leaves os.environ alone
def test_register_does_not_touch_the_environment(monkeypatch):
    pytest.importorskip("transformers")
    from selfattention import hf

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = {k: v for k, v in os.environ.items() if k.startswith(("HF_", "TRANSFORMERS_"))}
    hf.register()
    assert "HF_HUB_OFFLINE" not in os.environ
    # (importing transformers may set torch's own TORCHINDUCTOR_* variables: not ours)
    assert {k: v for k, v in os.environ.items() if k.startswith(("HF_", "TRANSFORMERS_"))} == before


# ---------------------------------------------------------------------------- 6: the vendor self-check
@pytest.fixture
def fresh_checks(monkeypatch):
    monkeypatch.setattr(vendor, "_CHECKED", {})


def test_self_check_is_keyed_by_device_index(fresh_checks, monkeypatch):
    seen = []
    monkeypatch.setattr(vendor, "_self_check", lambda device, dtype: seen.append(device))
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", object(), raising=False)
    for index in (0, 1, 0):
        assert vendor.unavailable(torch.device("cuda", index), torch.float32) is None
    assert [d.index for d in seen] == [0, 1]  # each device once


def test_self_check_uses_no_autograd(fresh_checks, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the self-check ran autograd")

    monkeypatch.setattr(torch.autograd, "backward", refuse)
    monkeypatch.setattr(torch.autograd, "grad", refuse)
    with torch.no_grad():
        assert vendor.unavailable(torch.device("cpu"), torch.float32) is None


def test_self_check_does_not_run_while_compiling(fresh_checks, monkeypatch):
    def boom(device, dtype):
        raise AssertionError("self-check inside compile")

    monkeypatch.setattr(vendor, "_self_check", boom)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert vendor.unavailable(torch.device("cpu"), torch.float64) is None
    assert vendor._CHECKED == {}  # nothing decided: the next call outside compile checks


def test_transient_self_check_failure_is_retried_with_a_warning(fresh_checks, monkeypatch):
    calls = []

    def flaky(device, dtype):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (transient)")
        return None

    monkeypatch.setattr(vendor, "_self_check", flaky)
    monkeypatch.setattr(vendor, "RETRY_SECONDS", 0.0, raising=False)
    with pytest.warns(RuntimeWarning, match="out of memory"):
        why = vendor.unavailable(torch.device("cpu"), torch.float32)
    assert why is not None and "out of memory" in why
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert vendor.unavailable(torch.device("cpu"), torch.float32) is None  # retried, now trusted
    assert len(calls) == 2


# --------------------------------------------------------------------- 7: validate first, then the cache
def test_cache_hit_still_validates():
    q = torch.randn(1, 2, 5, 4)
    tiled_attention(q, q, q)  # cached
    with pytest.raises(TypeError, match="layout"):
        tiled_attention(q.to_sparse(), q, q)
    with pytest.raises(TypeError, match="layout"):
        tiled_attention(q, q, q.to_sparse())


# ---------------------------------------------------------- 8: pretrained: bounded cache, no mode switch
def test_compare_does_not_switch_the_shared_model(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from selfattention import pretrained
    from tests.tiny_models import save_checkpoint

    folder = save_checkpoint("bert", tmp_path / "bert")
    net, _ = pretrained.load_model(folder)
    switches = []
    monkeypatch.setattr(net, "set_attn_implementation", lambda name: switches.append(name))
    run = pretrained.run_text("the cat sat", model=folder, compare=True)
    assert switches == []  # another thread using the shared model keeps our attention
    assert net.config._attn_implementation == "selfattention"
    assert run.max_abs_diff_hidden is not None and run.max_abs_diff_hidden <= pretrained.MATCH_TOLERANCE


def test_loaded_models_are_not_kept_forever(tmp_path):
    pytest.importorskip("transformers")
    from selfattention import pretrained
    from tests.tiny_models import save_checkpoint

    first = save_checkpoint("bert", tmp_path / "m0")
    net, tok = pretrained.load_model(first)
    ref = weakref.ref(net)
    assert pretrained.load_model(first)[0] is net  # cached while recent
    del net, tok
    for i in range(1, 6):
        pretrained.load_model(save_checkpoint("bert", tmp_path / f"m{i}"))
    gc.collect()
    assert ref() is None


# ------------------------------------------------------------ 9: kv_cache with cross-attention key/value
@pytest.mark.parametrize("backend", [None, "torch", "tiled"])
def test_cross_attention_with_a_cache_matches_uncached(backend):
    torch.manual_seed(0)
    mha = MultiHeadAttention(embed_dim=12, num_heads=4, num_kv_heads=2, kdim=10, vdim=10, backend=backend)
    memory = torch.randn(2, 7, 10)  # encoder output
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, 5:] = False
    steps = torch.randn(2, 4, 12)  # decoder queries, one per step
    cache = mha.new_cache(2, capacity=7)
    projections = []
    mha.k_proj.register_forward_hook(lambda *a: projections.append(1))
    for t in range(4):
        x = steps[:, t : t + 1]
        got, _ = mha(x, memory, memory, key_padding_mask=pad, kv_cache=cache)
        want, _ = mha(x, memory, memory, key_padding_mask=pad)
        assert (got - want).abs().max() <= 1e-5, t
    assert len(projections) == 1 + 4  # the cache projected the memory once (the uncached calls 4 times)
    assert cache.offset == 7


def test_cross_attention_cache_refuses_other_memory():
    mha = MultiHeadAttention(embed_dim=8, num_heads=2)
    memory = torch.randn(1, 5, 8)
    cache = mha.new_cache(1, capacity=8)
    mha(torch.randn(1, 1, 8), memory, memory, kv_cache=cache)
    with pytest.raises(ValueError, match="cross-attention"):
        mha(torch.randn(1, 1, 8), memory[:, :3], memory[:, :3], kv_cache=cache)
