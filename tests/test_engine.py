"""The block engine (kernels/): every plan strategy, both kernels, forward and backward, against the spec.

The spec (functional.attention_steps, float64, autograd) is the oracle; the plan strategies are checked by
:func:`selfattention.tiled.describe` so that each case really exercises the strategy it is named after.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import selfattention as sa
from selfattention import masks
from selfattention.kernels import vendor
from selfattention.kernels.plan import make_plan
from selfattention.kv_cache import KVCache
from selfattention.tiled import describe, tiled_attention, tiled_attention_with_stats
from selfattention.visibility import FULL, PARTIAL, SKIP, Visibility, classify, visible
from tests.oracle import attention_ref, visible_mask


def _qkv(b, h, hk, tq, tk, d, dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, h, tq, d, generator=g, dtype=dtype),
        torch.randn(b, hk, tk, d, generator=g, dtype=dtype),
        torch.randn(b, hk, tk, dv, generator=g, dtype=dtype),
    )


def _grads(fn, q, k, v, seed=99, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kw)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _spec(q, k, v, **kw):
    window = kw.pop("window", None)
    docs = kw.pop("document_ids", None)
    kw.pop("block_q", None), kw.pop("block_k", None), kw.pop("kernel", None)
    tq, tk = q.shape[-2], k.shape[-2]
    mask = kw.pop("attn_mask", None)
    if window is not None:
        mask = masks.combine(mask, masks.sliding_window_mask(tq, tk, window))
    if docs is not None:
        qd, kd = docs if isinstance(docs, tuple) else (docs, docs)
        dm = masks.document_mask(qd, kd)
        dm = dm[:, None] if dm.dim() == 3 else dm
        mask = (
            dm
            if mask is None
            else (mask & dm if mask.dtype == torch.bool else mask.masked_fill(~dm, -math.inf))
        )
    return sa.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, **kw)


def _close(got, want, tol):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol)


# (name, expected strategy, b, h, hk, tq, tk, d, dv, kwargs)
CASES = [
    ("dense", "single", 2, 2, 2, 37, 41, 8, 8, {}),
    ("causal-square", "causal", 1, 4, 2, 45, 45, 8, 5, {"is_causal": True}),
    ("causal-tq<tk", "causal", 1, 2, 2, 13, 40, 8, 8, {"is_causal": True}),
    ("causal-tq>tk", "causal", 1, 2, 1, 40, 13, 8, 8, {"is_causal": True}),
    ("decode-row", "causal", 2, 2, 2, 1, 30, 8, 8, {"is_causal": True}),
    ("window-bands", "window", 1, 2, 2, 67, 67, 8, 8, {"window": 9, "block_q": 8}),
    ("window-gqa-bands", "window", 2, 4, 2, 67, 67, 8, 6, {"window": 9, "block_q": 8}),
    ("window-tq<tk", "window", 1, 2, 2, 29, 70, 8, 8, {"window": 12, "block_q": 5}),
    ("window-tq>tk", "window", 1, 2, 2, 70, 29, 8, 8, {"window": 12, "block_q": 5}),
    ("window-1", "window", 1, 1, 1, 23, 23, 4, 4, {"window": 1, "block_q": 4}),
    ("window-wider-than-t", "window", 1, 1, 1, 23, 23, 4, 4, {"window": 50, "block_q": 4}),
    ("key-mask+causal", "causal", 3, 2, 2, 21, 21, 8, 8, {"is_causal": True, "pad": True}),
    ("key-mask+window", "window", 3, 2, 2, 40, 40, 8, 8, {"window": 6, "block_q": 7, "pad": True}),
    ("docs-equal", "documents", 1, 2, 2, 48, 48, 8, 8, {"docs": [12, 12, 12, 12]}),
    ("docs-uneven-causal", "documents", 1, 2, 1, 50, 50, 8, 8, {"docs": [7, 20, 3, 20], "is_causal": True}),
    ("docs-window", "documents", 1, 2, 2, 60, 60, 8, 8, {"docs": [30, 30], "window": 8, "block_q": 4}),
    ("docs-unsorted", "blocks", 1, 2, 2, 30, 30, 8, 8, {"docs_unsorted": True, "block_q": 8, "block_k": 8}),
    ("dense-mask-blocks", "blocks", 2, 2, 2, 33, 47, 8, 8, {"dense_mask": True, "block_q": 8, "block_k": 16}),
    ("float-bias", "single", 1, 2, 2, 9, 17, 8, 8, {"float_bias": True}),
]


def _case(name):
    _, strategy, b, h, hk, tq, tk, d, dv, kw = next(c for c in CASES if c[0] == name)
    kw = dict(kw)
    q, k, v = _qkv(b, h, hk, tq, tk, d, dv, seed=sum(map(ord, name)))
    g = torch.Generator().manual_seed(7)
    if kw.pop("pad", False):  # key padding: a (B, 1, 1, Tk) mask, one row hides its last keys
        m = torch.ones(b, 1, 1, tk, dtype=torch.bool)
        m[0, ..., tk - 5 :] = False
        kw["attn_mask"] = m
    if "docs" in kw:
        sizes = kw.pop("docs")
        kw["document_ids"] = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    if kw.pop("docs_unsorted", False):
        kw["document_ids"] = torch.randint(0, 3, (tq,), generator=g)
    if kw.pop("dense_mask", False):
        m = torch.rand(b, 1, tq, tk, generator=g) > 0.5
        m[..., 8:16, :] = False  # whole blocks hidden (and two blind row blocks)
        m[..., :, 16:32] = False
        kw["attn_mask"] = m
    if kw.pop("float_bias", False):
        bias = torch.randn(tq, tk, generator=g, dtype=torch.float64)
        bias[2, :] = -math.inf  # a blind row
        bias[:, 3] = -math.inf
        kw["attn_mask"] = bias
    return strategy, q, k, v, kw


@pytest.mark.parametrize("kernel", ["vendor", "exact"])
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_every_strategy_equals_the_spec_forward_and_backward(name, kernel):
    strategy, q, k, v, kw = _case(name)
    info = describe(q, k, v, enable_gqa=True, kernel=kernel, **kw)
    assert info.strategy == strategy and info.kernel == kernel
    got = _grads(tiled_attention, q, k, v, enable_gqa=True, kernel=kernel, **kw)
    want = _grads(_spec, q, k, v, **kw)
    _close(got, want, 1e-10)


@pytest.mark.parametrize(
    "name", ["causal-tq<tk", "window-gqa-bands", "docs-uneven-causal", "dense-mask-blocks"]
)
def test_float32_vendor_equals_float64_spec(name):
    _, q, k, v, kw = _case(name)
    q, k, v = q.float(), k.float(), v.float()
    got = _grads(tiled_attention, q, k, v, enable_gqa=True, **kw)
    want = _grads(_spec, q.double(), k.double(), v.double(), **kw)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=2e-5)


def test_the_oracle_agrees_on_a_window_band_case():
    # independent of the spec: the loop oracle with the window mask it builds itself
    _, q, k, v, kw = _case("window-tq<tk")
    out = tiled_attention(q, k, v, **kw)
    ref, _ = attention_ref(q, k, v, attn_mask=visible_mask(29, 70, window=12))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_window_bands_are_stacked_into_one_call_and_skip_the_rest():
    q = torch.randn(1, 2, 4096, 16)
    info = describe(q, q, q, window=256, block_q=128)
    assert info.strategy == "window" and info.calls == 2  # the causal head + every band in one call
    assert info.computed_fraction < (256 + 128) / 4096
    plan = make_plan(Visibility(4096, 4096, window=256), 128, 512)
    band = plan.calls[-1]
    assert band.count == (4096 - 256) // 128 and band.step == 128 and band.cols == 255 + 128


def test_equal_documents_are_stacked_into_one_call():
    docs = torch.arange(8).repeat_interleave(64)
    q = torch.randn(1, 2, 512, 16)
    assert describe(q, q, q, document_ids=docs).calls == 1
    assert describe(q, q, q, document_ids=docs, is_causal=True).calls == 1
    assert describe(q, q, q, document_ids=docs).computed_fraction == pytest.approx(1 / 8)


def test_a_key_mask_rides_along_without_a_dense_tile():
    # causal + (B, 1, 1, Tk) padding: one call (the kernel's causal mask + the broadcast key bias)
    q = torch.randn(2, 2, 64, 8)
    pad = torch.ones(2, 1, 1, 64, dtype=torch.bool)
    pad[1, ..., 50:] = False
    info = describe(q, q, q, attn_mask=pad, is_causal=True)
    assert (info.strategy, info.calls) == ("causal", 1)
    vis = Visibility(64, 64, is_causal=True, attn_mask=pad)
    assert vis.tile(0, 64, 0, 64, torch.float32, q.device, structure=False).shape == (2, 1, 1, 64)


def test_kernel_reasons_are_named():
    q, k, v = _qkv(1, 1, 1, 5, 5, 4, 4, dtype=torch.float32)
    assert describe(q, k, v).kernel == "vendor"
    bad = k.clone()
    bad[..., 0, 0] = math.nan
    assert "NaN" in describe(q, bad, v).reason
    assert "dropout" in describe(q, k, v, dropout_p=0.1).reason
    m = torch.zeros(5, 5, requires_grad=True)
    assert "requires grad" in describe(q, k, v, attn_mask=m).reason
    with pytest.raises(ValueError, match="kernel='vendor' cannot serve this problem: .*dropout"):
        tiled_attention(q, k, v, dropout_p=0.1, kernel="vendor")
    with pytest.raises(ValueError, match="kernel must be one of"):
        tiled_attention(q, k, v, kernel="flash")


def test_the_vendor_kernel_passed_its_self_check_here():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        assert vendor.unavailable(torch.device("cpu"), dtype) is None
    assert vendor.compute_dtype(torch.device("cpu"), torch.bfloat16) == torch.float32


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_first_call_without_autograd_still_gets_the_vendor_kernel(mode, monkeypatch):
    # The self-check differentiates its oracle; a first call under no_grad once failed it for good, and
    # every later call (model inference, decoding) ran on the slow exact kernel.
    monkeypatch.setattr(vendor, "_CHECKED", {})
    q, k, v = (torch.randn(1, 2, 70, 16) for _ in range(3))
    with getattr(torch, mode)():
        assert describe(q, k, v, is_causal=True).kernel == "vendor"
        out = tiled_attention(q, k, v, is_causal=True)
    assert vendor._CHECKED == {("cpu", None, torch.float32): (None, None)}  # (device, index, dtype): final
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


# ------------------------------------------------------------------------------- the predicate


def test_classify_agrees_with_the_predicate_on_every_small_block():
    for causal, window in ((True, None), (True, 3), (False, 2)):
        for q0 in range(-2, 8):
            for k0 in range(0, 8):
                for nq, nk in ((1, 1), (3, 2), (4, 4)):
                    qp = torch.arange(q0, q0 + nq)[:, None]
                    kp = torch.arange(k0, k0 + nk)[None, :]
                    vis = visible(qp, kp, causal=causal, window=window)
                    kind = classify(q0, q0 + nq - 1, k0, k0 + nk - 1, causal=causal, window=window)
                    want = SKIP if not bool(vis.any()) else (FULL if bool(vis.all()) else PARTIAL)
                    assert kind == want, (causal, window, q0, k0, nq, nk)


def test_masks_are_the_dense_form_of_the_predicate():
    assert torch.equal(masks.causal_mask(5, 9), visible_mask(5, 9, is_causal=True))
    assert torch.equal(masks.sliding_window_mask(9, 5, 3), visible_mask(9, 5, window=3))
    top_left = Visibility(2, 4, is_causal=True, q_offset=0).to_mask()
    assert torch.equal(top_left, torch.ones(2, 4, dtype=torch.bool).tril())


def test_top_left_visibility_matches_torch_sdpa_semantics():
    # what transformers' sdpa path relies on for a mask-less call with Tk > Tq
    q, k, v = _qkv(1, 2, 2, 4, 9, 8, 8, dtype=torch.float32)
    vis = Visibility(4, 9, is_causal=True, q_offset=0)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for backend in ("reference", "torch", "tiled"):
        got = sa.scaled_dot_product_attention(q, k, v, attn_mask=vis, backend=backend)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- defects of issue 11


def _dq_ref(q, k, v, dout):
    qq = q.double().requires_grad_()
    out = _spec(qq, k.double(), v.double(), scale=1.0, is_causal=True)
    (dq,) = torch.autograd.grad(out, qq, dout.double())
    return dq


PATHS = {
    "tiled": functools.partial(tiled_attention),
    "tiled-exact": functools.partial(tiled_attention, kernel="exact"),
    "torch": functools.partial(sa.scaled_dot_product_attention, backend="torch"),
    "reference": sa.scaled_dot_product_attention,
}


@pytest.mark.parametrize("path", list(PATHS))
def test_backward_precision_does_not_depend_on_the_scale_of_the_upstream_gradient(path):
    # rows with a log-sum-exp near 60 (an extra feature of √60 on every query and key, scale 1): the
    # backward is linear in dO, so its relative error must not grow as dO shrinks
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 64, 8, generator=g) for _ in range(3))
    col = torch.full((1, 2, 64, 1), math.sqrt(60.0))
    q, k = torch.cat([q, col], -1), torch.cat([k, col], -1)
    dout = torch.randn(1, 2, 64, 8, generator=g)
    want = _dq_ref(q, k, v, dout)
    for tiny in (1.0, 1e-12, 1e-14, 1e-16):
        qq = q.clone().requires_grad_()
        out = PATHS[path](qq, k, v, scale=1.0, is_causal=True)
        (dq,) = torch.autograd.grad(out, qq, dout * tiny)
        rel = ((dq.double() / tiny) - want).norm() / want.norm()
        assert rel < 1e-4, (tiny, rel.item())


@pytest.mark.parametrize("backend", ["torch", "tiled"])
def test_double_backward_works_on_the_fast_backends(backend):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 5, 6, 3, 3))
    fn = functools.partial(sa.scaled_dot_product_attention, is_causal=True, backend=backend)
    assert torch.autograd.gradgradcheck(fn, (q, k, v))
    mha = sa.MultiHeadAttention(8, 2, backend=backend).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    out, _ = mha(x, is_causal=True)
    (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    gx.square().sum().backward()  # a gradient penalty
    ref = sa.MultiHeadAttention(8, 2).double()
    ref.load_state_dict(mha.state_dict())
    x2 = x.detach().clone().requires_grad_()
    (g2,) = torch.autograd.grad(ref(x2, is_causal=True)[0].square().sum(), x2, create_graph=True)
    g2.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-10, rtol=1e-10)


def _bf16_errors(fn, q, k, v, dout, **kw):
    """Max errors of (out, dq, dk, dv) against float64."""
    exact = _grads(_spec, q.double(), k.double(), v.double(), **kw)
    qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))
    out = fn(qb, kb, vb, **kw)
    out.backward(dout.bfloat16())
    got = (out, qb.grad, kb.grad, vb.grad)
    return [(g.double() - e).abs().max().item() for g, e in zip(got, exact, strict=True)]


def _naive_bf16(q, k, v, is_causal=False, scale=None):
    s = (q @ k.transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)
    if is_causal:
        s = s.masked_fill(~masks.causal_mask(q.shape[-2], k.shape[-2]), -math.inf)
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("backend", ["tiled", "torch"])
@pytest.mark.parametrize("kernel", ["vendor", "exact"])
def test_bfloat16_forward_and_gradients_at_most_twice_the_naive_error(backend, kernel):
    if backend == "torch" and kernel == "exact":
        pytest.skip("the torch backend has one kernel")
    g = torch.Generator().manual_seed(97)
    q, k, v = (torch.randn(5, 2, 97, 64, generator=g) for _ in range(3))
    dout = torch.randn(5, 2, 97, 64, generator=g)
    if backend == "tiled":
        fn = functools.partial(tiled_attention, kernel=kernel)
    else:
        fn = functools.partial(sa.scaled_dot_product_attention, backend="torch")
    ours = _bf16_errors(fn, q, k, v, dout, is_causal=True)
    naive = _bf16_errors(_naive_bf16, q, k, v, dout, is_causal=True)
    for name, o, n in zip(("output", "query grad", "key grad", "value grad"), ours, naive, strict=True):
        assert o <= 2 * n, (name, o, n)


def test_infinite_query_against_infinite_key_gets_the_spec_gradient():
    q = torch.tensor([[[[math.inf]]]], requires_grad=True)
    k = torch.tensor([[[[-math.inf]]]])
    v = torch.tensor([[[[2.0]]]])
    out = tiled_attention(q, k, v)
    out.sum().backward()
    q2 = q.detach().clone().requires_grad_()
    sa.scaled_dot_product_attention(q2, k, v).sum().backward()
    assert torch.equal(out.detach(), torch.zeros(1, 1, 1, 1))
    assert torch.equal(q.grad, q2.grad) and torch.isfinite(q.grad).all()


# ------------------------------------------------------------------------------- KV cache, stats, layers


def test_the_kv_cache_hands_over_a_visibility_not_a_dense_mask():
    cache = KVCache(1, 2, 8, capacity=64, window=16)
    for n in (20, 1, 1, 5):
        k = torch.randn(1, 2, n, 8)
        keys, _, vis = cache.update(k, k)
        assert isinstance(vis, Visibility) and vis.attn_mask is None
        assert (vis.is_causal, vis.window, vis.q_len, vis.k_len) == (True, 16, n, keys.shape[2])
        q = torch.randn(1, 2, n, 8)
        info = describe(q, keys, keys, attn_mask=vis)
        assert info.kernel == "vendor"
        if n == 1:
            assert info.calls == 1  # a decoding step: one call over the kept keys
        torch.testing.assert_close(
            tiled_attention(q, keys, keys, attn_mask=vis),
            sa.scaled_dot_product_attention(q, keys, keys, attn_mask=vis.to_mask()),
        )


@pytest.mark.parametrize("name", ["causal-tq<tk", "window-gqa-bands", "docs-equal", "key-mask+causal"])
@pytest.mark.parametrize("kernel", ["vendor", "exact"])
def test_statistics_on_every_strategy_equal_the_materialised_weights(name, kernel):
    _, q, k, v, kw = _case(name)
    kw.pop("block_k", None)
    out, st = tiled_attention_with_stats(q, k, v, enable_gqa=True, top_k=3, kernel=kernel, **kw)
    spec_kw = {key: val for key, val in kw.items() if key != "block_q"}
    want = _spec(q, k, v, **spec_kw)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    steps_mask = None
    tq, tk = q.shape[-2], k.shape[-2]
    if "window" in kw:
        steps_mask = masks.sliding_window_mask(tq, tk, kw["window"])
    elif kw.get("is_causal"):
        steps_mask = masks.causal_mask(tq, tk)
    if "document_ids" in kw:
        d = kw["document_ids"]
        steps_mask = masks.combine(steps_mask, masks.document_mask(d, d))
    if "attn_mask" in kw:
        steps_mask = masks.combine(steps_mask, kw["attn_mask"])
    w = sa.attention_weights(q, k, attn_mask=steps_mask, enable_gqa=True)  # (B, H, Tq, Tk)
    ent = -(w * torch.where(w > 0, w.log(), torch.zeros_like(w))).sum(-1)
    torch.testing.assert_close(st.entropy, ent, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(st.column_sums, w.sum(-2), atol=1e-9, rtol=1e-9)
    top = w.topk(3, dim=-1)
    torch.testing.assert_close(st.topk_weights, top.values, atol=1e-9, rtol=1e-9)
    idx = st.topk_indices
    picked = w.gather(-1, idx.clamp_min(0)).masked_fill(idx < 0, 0.0)
    torch.testing.assert_close(picked, top.values, atol=1e-12, rtol=0)


def _imports(module: str) -> set[str]:
    """The package-relative modules a source file imports (from its syntax tree)."""
    import ast
    import importlib.util

    path = importlib.util.find_spec(f"selfattention.{module}").origin
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            out.add((node.module or "").split(".")[0] or ",".join(a.name for a in node.names))
    return out


def test_the_spec_is_a_leaf_and_dispatch_has_one_registry():
    # core imports only core: the spec imports nothing faster, the predicate imports nothing at all
    assert _imports("functional") <= {"_hooks", "_validation", "visibility"}
    assert _imports("visibility") <= {"predicate"}  # its programmable part (flex's mask_mod / score_mod)
    assert _imports("predicate") == set()
    assert _imports("mods") <= {"masks", "scores"} and _imports("mods.masks") == set()
    assert _imports("masks") <= {"_validation", "visibility"}
    for mod in ("kernels.engine", "kernels.plan", "kernels.vendor", "kernels.exact", "kernels.stats"):
        assert not _imports(mod) & {"backends", "tiled", "mha", "modules", "distributed"}, mod
    from selfattention import backends

    assert backends.available_backends() == ["reference", "tiled", "torch"]


@pytest.mark.parametrize("where", ["hidden key", "visible key", "hidden value", "visible value", "query"])
def test_without_autograd_a_non_finite_input_still_gets_the_spec_result(where):
    # Without autograd the keys/values are not scanned before the fused kernel (an O(Tk) pass per decode
    # step); a non-finite output sends the call to the exact kernel. Same result as the spec either way.
    q, k, v = _qkv(1, 2, 2, 70, 70, 16, 16, dtype=torch.float32, seed=5)
    t = {"key": k, "value": v, "query": q}[where.split()[-1]]
    t[0, 1, 65] = float("nan")
    keep = torch.ones(70, dtype=torch.bool)
    if where.startswith("hidden"):
        keep[65] = False  # a padded key: no query sees it
    with torch.no_grad():
        out = tiled_attention(q, k, v, attn_mask=keep, is_causal=True, block_q=16, block_k=32)
    want = sa.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep, is_causal=True)
    assert torch.equal(torch.isnan(out), torch.isnan(want))
    fin = ~torch.isnan(want)
    torch.testing.assert_close(out[fin].double(), want[fin], atol=2e-5, rtol=2e-5)
    assert torch.isnan(out).any() != where.startswith("hidden")


@pytest.mark.parametrize("tq,tk", [(2, 5), (4, 8), (16, 40), (100, 300), (37, 37)])
@pytest.mark.parametrize("kernel", ["vendor", "exact"])
def test_key_padding_mask_with_bottom_right_causal(tq, tk, kernel):
    # Found by the fuzzer: a key the mask shows but the diagonal call's causal rule hides made a blind row
    # look seen (lse 0 from the fused kernel), and the merge shrank the row (Tq=2, Tk=5: 0.70 · v[2]).
    g = torch.Generator().manual_seed(tq * 1000 + tk)
    q, k, v = _qkv(2, 2, 2, tq, tk, 8, 8, dtype=torch.float32, seed=tq + tk)
    for _ in range(5):
        keep = torch.rand(tk, generator=g) > 0.5
        for mask in (keep, keep.view(1, 1, 1, tk), keep.view(1, 1, 1, tk).float().log()):
            out = tiled_attention(
                q, k, v, attn_mask=mask, is_causal=True, block_q=16, block_k=32, kernel=kernel
            )
            want = sa.scaled_dot_product_attention(
                q.double(), k.double(), v.double(), attn_mask=mask, is_causal=True
            )
            torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kernel", [None, "exact"])
def test_a_minus_inf_query_row_still_sees_a_nan_value(kernel):
    # Every score of the row is −inf from the data: its weights are 0, but a NaN value it may see makes it
    # NaN (0 · NaN), as in the spec; the exact kernel once judged "seen" from the scores and gave 0.
    q, k, v = _qkv(1, 2, 2, 6, 6, 4, 4, dtype=torch.float32, seed=3)
    k = k.abs() + 0.1
    q[0, 1, 3] = -math.inf
    v[0, 1, 1, 2] = math.nan
    out = tiled_attention(q, k, v, is_causal=True, block_q=2, block_k=2, kernel=kernel)
    want = sa.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and bool(torch.isnan(want[0, 1, 3]).any())
    torch.testing.assert_close(out.nan_to_num().double(), want.nan_to_num(), atol=2e-5, rtol=2e-5)


def test_a_dropout_seed_that_is_not_an_int_is_refused():
    q = torch.randn(1, 1, 4, 2)
    for bad in (1.5, "3", True):
        with pytest.raises(TypeError, match="dropout_seed"):
            tiled_attention(q, q, q, dropout_p=0.5, dropout_seed=bad)


@pytest.mark.parametrize("backend", ["torch", "tiled"])
def test_a_learned_mask_of_zeros_gets_its_gradient(backend):
    # The tiled path once dropped the tiles of a float mask whose blocks are all 0 ("no bias needed") and
    # returned a zero gradient for a mask that requires grad.
    q, k, v = _qkv(1, 2, 2, 9, 9, 4, 4, dtype=torch.float32, seed=11)
    w = torch.randn(1, 2, 9, 4, generator=torch.Generator().manual_seed(2))
    grads = {}
    for name, dtype in (("spec", torch.float64), ("fast", torch.float32)):
        ins = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        m = torch.zeros(9, 9, dtype=dtype, requires_grad=True)
        b = "reference" if name == "spec" else backend
        (sa.scaled_dot_product_attention(*ins, attn_mask=m, backend=b) * w.to(dtype)).sum().backward()
        grads[name] = [t.grad.double() for t in (*ins, m)]
    assert grads["spec"][3].abs().sum() > 0.1
    for got, want in zip(grads["fast"], grads["spec"], strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_row_whose_only_visible_key_is_not_finite_matches_the_spec(bad, grad):
    # The fused kernel drops a NaN score like a hidden key: a row whose visible keys are all NaN came back
    # finite ("sees nothing") and, without autograd, the output check let it through (found by the fuzzer).
    q = torch.tensor([[1.0, 1.0], [0.5, -1.0], [2.0, 0.0]])
    k = torch.tensor([[bad, 0.5], [0.3, 0.2], [0.1, 0.1]])
    v = torch.tensor([[1.0, 2.0], [0.5, 0.0], [3.0, 1.0]])
    with torch.set_grad_enabled(grad):
        out = tiled_attention(q, k, v, window=1)  # each query sees its own key only
    want = sa.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=torch.eye(3, dtype=torch.bool)
    )
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.equal(
        torch.isinf(out), torch.isinf(want)
    )
    torch.testing.assert_close(out.nan_to_num().double(), want.nan_to_num(), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("t", [6, 70])  # the fused kernel returns a NaN query row as zeros at 6, NaN at 70
@pytest.mark.parametrize("layout", ["dense", "causal", "padding", "window"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_query_row_without_autograd_matches_the_spec(bad, layout, t):
    # Without autograd the query is not scanned before the fused kernel either (its cost exceeds the kernel's
    # at small T): the fused kernel returns a NaN query row as "sees nothing" (zeros), so the engine must
    # catch it from the result. Rows 3 and t − 1 hold the bad entry; at 70 rows windows split into calls.
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, t, 16, generator=g) for _ in range(3))
    q[0, 1, 3, 5] = bad
    q[1, 2, t - 1, 0] = bad
    kw: dict = {}
    mask = None
    if layout == "causal":
        kw["is_causal"] = True
        mask = torch.ones(t, t, dtype=torch.bool).tril()
    elif layout == "padding":
        mask = torch.ones(2, 1, 1, t, dtype=torch.bool)
        mask[1, ..., t - 2 :] = False
        kw["attn_mask"] = mask
    elif layout == "window":
        kw.update(window=9, block_q=16, block_k=16)
        i = torch.arange(t)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 9)
    with torch.no_grad():
        out = tiled_attention(q, k, v, **kw)
    want = sa.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert bool(torch.isnan(want).any()) or bool(torch.isinf(want).any()) or bad == -math.inf
    assert torch.equal(torch.isnan(out), torch.isnan(want)) and torch.equal(
        torch.isinf(out), torch.isinf(want)
    )
    torch.testing.assert_close(out.nan_to_num().double(), want.nan_to_num(), atol=2e-5, rtol=2e-5)
