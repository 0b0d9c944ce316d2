"""MultiHeadAttention against independent oracles: torch.nn.MultiheadAttention with copied weights, the
float64 loop oracle per head, and GQA against plain MHA with the key/value heads repeated."""

from __future__ import annotations

import pytest
import torch

import selfattention as sa
from selfattention import masks
from selfattention.mha import MultiHeadAttention, merge_masks
from tests.oracle import attention_ref


def _torch_pair(E, H, kdim=None, vdim=None, bias=True, seed=0):
    """Our module and a torch MHA with the same weights (torch's in-projection split into q/k/v)."""
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=True, kdim=kdim, vdim=vdim)
    with torch.no_grad():  # torch initialises the in-projection bias to 0: make it hide nothing
        if bias:
            ref.in_proj_bias.normal_()
            ref.out_proj.bias.normal_()
    ours = MultiHeadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim)
    with torch.no_grad():
        if kdim is None and vdim is None:
            wq, wk, wv = ref.in_proj_weight.chunk(3)
        else:
            wq, wk, wv = ref.q_proj_weight, ref.k_proj_weight, ref.v_proj_weight
        ours.q_proj.weight.copy_(wq)
        ours.k_proj.weight.copy_(wk)
        ours.v_proj.weight.copy_(wv)
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        if bias:
            bq, bk, bv = ref.in_proj_bias.chunk(3)
            ours.q_proj.bias.copy_(bq)
            ours.k_proj.bias.copy_(bk)
            ours.v_proj.bias.copy_(bv)
            ours.out_proj.bias.copy_(ref.out_proj.bias)
    return ours.eval(), ref.eval()


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("T", [1, 7, 97])
def test_self_attention_matches_torch_mha(backend, T):
    ours, ref = _torch_pair(E=30, H=5)  # head_dim 6
    ours.backend = backend
    x = torch.randn(3, T, 30)
    out, w = ours(x, need_weights=True)
    out_ref, w_ref = ref(x, x, x, need_weights=True, average_attn_weights=False)
    assert torch.allclose(out, out_ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(w, w_ref, atol=1e-6)
    out_fast, none = ours(x)  # without weights: the chosen backend
    assert none is None
    assert torch.allclose(out_fast, out_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [None, "torch"])
def test_masks_converted_from_torch_polarity(backend):
    ours, ref = _torch_pair(E=24, H=4, seed=1)
    ours.backend = backend
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 24, generator=g)
    blocked = torch.rand(7, 7, generator=g) > 0.6  # torch: True = blocked
    blocked.fill_diagonal_(False)  # every query keeps one key (torch returns NaN otherwise)
    blocked[6, :5] = True  # ... except query 6 of the padded sequence: it sees only padding (keys 5, 6)
    pad_torch = torch.tensor([[False] * 7, [False] * 4 + [True] * 3])  # torch: True = padding
    out_ref, w_ref = ref(
        x,
        x,
        x,
        attn_mask=blocked,
        key_padding_mask=pad_torch,
        need_weights=True,
        average_attn_weights=False,
    )
    out, w = ours(
        x,
        attn_mask=masks.from_torch_mha(blocked),
        key_padding_mask=masks.from_torch_mha(pad_torch),
        need_weights=True,
    )
    # rows of batch 1 whose only visible keys are padding are NaN in torch and zeros in ours; compare the rest
    ok = ~torch.isnan(out_ref).any(-1)
    assert ok[0].all() and not ok[1, 6]
    assert torch.allclose(out[1, 6], ours.out_proj.bias)  # zero context vector, never NaN
    assert torch.allclose(out[ok], out_ref[ok], atol=1e-5)
    assert torch.allclose(w[0], w_ref[0], atol=1e-6)
    assert (w[1][..., 4:] == 0).all()  # padding never attended to
    assert torch.isfinite(out).all()


def test_cross_attention_with_kdim_vdim_matches_torch():
    ours, ref = _torch_pair(E=16, H=2, kdim=11, vdim=13, seed=2)
    q = torch.randn(2, 5, 16)
    k = torch.randn(2, 9, 11)
    v = torch.randn(2, 9, 13)
    kpm = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    out, w = ours(q, k, v, key_padding_mask=kpm, need_weights=True)
    out_ref, w_ref = ref(q, k, v, key_padding_mask=~kpm, need_weights=True, average_attn_weights=False)
    assert torch.allclose(out, out_ref, atol=1e-5)
    assert torch.allclose(w, w_ref, atol=1e-6)
    assert w.shape == (2, 2, 5, 9)


def test_each_head_against_float64_loops():
    torch.manual_seed(3)
    mha = MultiHeadAttention(18, 3, num_kv_heads=1).double()  # multi-query
    x = torch.randn(2, 7, 18, dtype=torch.float64)
    keep = torch.rand(7, 7) > 0.3
    out, w = mha(x, attn_mask=keep, is_causal=True, need_weights=True)
    q = mha.q_proj(x).view(2, 7, 3, 6).transpose(1, 2)
    k = mha.k_proj(x).view(2, 7, 1, 6).transpose(1, 2).expand(2, 3, 7, 6)
    v = mha.v_proj(x).view(2, 7, 1, 6).transpose(1, 2).expand(2, 3, 7, 6)
    ctx, w_ref = attention_ref(q, k, v, attn_mask=keep, is_causal=True)
    assert torch.allclose(w, w_ref, atol=1e-12)
    expected = mha.out_proj(ctx.transpose(1, 2).reshape(2, 7, 18))
    assert torch.allclose(out, expected, atol=1e-12)


@pytest.mark.parametrize("H,Hkv", [(6, 2), (6, 1), (4, 4)])
def test_gqa_equals_mha_with_repeated_kv_heads(H, Hkv):
    torch.manual_seed(4)
    E = 12 * 5
    D = E // H
    gqa = MultiHeadAttention(E, H, num_kv_heads=Hkv)
    mha = MultiHeadAttention(E, H)
    group = H // Hkv
    with torch.no_grad():
        mha.q_proj.load_state_dict(gqa.q_proj.state_dict())
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for name in ("k_proj", "v_proj"):
            src, dst = getattr(gqa, name), getattr(mha, name)
            dst.weight.copy_(src.weight.view(Hkv, D, E).repeat_interleave(group, 0).reshape(H * D, E))
            dst.bias.copy_(src.bias.view(Hkv, D).repeat_interleave(group, 0).reshape(H * D))
    x = torch.randn(2, 9, E)
    for backend in (None, "torch"):
        gqa.backend = mha.backend = backend
        a, _ = gqa(x, is_causal=True)
        b, _ = mha(x, is_causal=True)
        assert torch.allclose(a, b, atol=1e-6)
    # and the grouping is not trivially symmetric: a different head order changes the result
    if Hkv > 1 and Hkv < H:
        with torch.no_grad():
            w = gqa.k_proj.weight.view(Hkv, D, E)
            mha.k_proj.weight.copy_(w.repeat(group, 1, 1).reshape(H * D, E))  # tiled, not interleaved
        assert not torch.allclose(gqa(x)[0], mha(x)[0], atol=1e-4)


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_batch_equals_each_sequence_alone(backend, causal):
    torch.manual_seed(5)
    mha = MultiHeadAttention(20, 4, num_kv_heads=2, backend=backend).eval()
    lengths = [7, 3, 1, 5]
    seqs = [torch.randn(n, 20) for n in lengths]
    batch = torch.zeros(4, 7, 20)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    batch[1, 3:] = float("nan")  # padding content must never leak, whatever it holds
    real = masks.padding_mask(lengths).view(4, 7)
    out, _ = mha(batch, key_padding_mask=real, is_causal=causal)
    for i, s in enumerate(seqs):
        alone, _ = mha(s[None], is_causal=causal)
        assert torch.allclose(out[i, : len(s)], alone[0], atol=1e-5), i


def test_capture_records_named_steps_and_weights_for_any_backend():
    torch.manual_seed(6)
    mha = MultiHeadAttention(8, 2, backend="torch")
    x = torch.randn(1, 4, 8)
    with sa.capture() as traces:
        out_captured, _ = mha(x, is_causal=True)
    assert len(traces) == 1
    t = traces[0]
    assert t.step_names()[:4] == ["inputs", "query", "key", "value"]
    assert t["weights"].shape == (1, 2, 4, 4)
    assert (t["weights"][0, 0].triu(1) == 0).all()  # causal
    assert torch.allclose(t["weights"].sum(-1), torch.ones(1, 2, 4))
    out_fast, _ = mha(x, is_causal=True)  # outside capture: torch path, same numbers
    assert torch.allclose(out_captured, out_fast, atol=1e-6)


def test_unbatched_and_dropout_eval():
    torch.manual_seed(7)
    mha = MultiHeadAttention(8, 2, dropout=0.5)
    x = torch.randn(5, 8)
    mha.eval()
    a, _ = mha(x)
    b, _ = mha(x[None])
    assert a.shape == (5, 8)
    assert torch.allclose(a, b[0])
    mha.train()
    c, _ = mha(x)
    assert not torch.allclose(a, c)  # dropout acts in training


def test_merge_masks():
    b1 = torch.tensor([True, True, False])
    b2 = torch.tensor([True, False, True])
    f = torch.tensor([0.5, 0.0, -1.0])
    assert merge_masks(b1, b2).tolist() == [True, False, False]
    assert merge_masks(b1, f).tolist() == [0.5, 0.0, float("-inf")]
    assert merge_masks(f, f).tolist() == [1.0, 0.0, -2.0]
    assert merge_masks(None, b1) is b1


def test_bad_arguments_give_clear_errors():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        MultiHeadAttention(12, 4, num_kv_heads=3)
    mha = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"query has 7 features \(last dim of \(2, 3, 7\)\)"):
        mha(torch.randn(2, 3, 7))
    with pytest.raises(
        ValueError, match=r"query must have shape \(B, T, 8\) or \(T, 8\), got \(3, 8, 1, 1\)"
    ):
        mha(torch.randn(3, 8, 1, 1))
    with pytest.raises(TypeError, match="floating"):
        mha(torch.ones(2, 3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, Tk\) = \(2, 3\)"):
        mha(torch.randn(2, 3, 8), key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="ambiguous"):
        mha(torch.randn(2, 3, 8), attn_mask=torch.ones(2, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="cannot have a window"):  # cross-attention caches hold the memory
        mha(torch.randn(1, 3, 8), torch.randn(1, 3, 8), kv_cache=mha.new_cache(1, 8, window=4))
    cache = sa.KVCache(1, 1, 4, 8)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        mha(torch.randn(1, 3, 8), kv_cache=cache)


def test_inputs_not_modified():
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8)
    kpm = torch.tensor([[True, True, False], [True, True, True]])
    x0, kpm0 = x.clone(), kpm.clone()
    mha(x, key_padding_mask=kpm, is_causal=True)
    assert torch.equal(x, x0) and torch.equal(kpm, kpm0)


# ------------------------------------------------------------------ argument checks (review fixes)
@pytest.mark.parametrize("name,bad", [("is_causal", "False"), ("is_causal", 0), ("need_weights", 1)])
def test_flags_must_be_real_bools(name, bad):
    mha = MultiHeadAttention(16, 4)
    with pytest.raises(TypeError, match=f"{name} must be a bool, got {type(bad).__name__}"):
        mha(torch.randn(1, 3, 16), **{name: bad})


def test_input_dtype_must_match_the_parameters():
    mha = MultiHeadAttention(16, 4)
    x64 = torch.randn(1, 3, 16, dtype=torch.float64)
    with pytest.raises(
        TypeError, match=r"query has dtype torch.float64 .* parameters are torch.float32.*double"
    ):
        mha(x64)
    with pytest.raises(TypeError, match="key has dtype torch.float64"):
        mha(torch.randn(1, 3, 16), x64, x64)
    out64, _ = mha.double()(x64)  # the suggested fix works
    assert out64.dtype == torch.float64
    with pytest.raises(TypeError, match="query must be a floating-point tensor, got dtype torch.int64"):
        MultiHeadAttention(16, 4)(torch.ones(1, 3, 16, dtype=torch.long))


def test_feature_size_mismatch_names_the_module_size():
    mha = MultiHeadAttention(16, 4, kdim=6, vdim=7)
    q, k, v = torch.randn(1, 3, 16), torch.randn(1, 5, 6), torch.randn(1, 5, 7)
    with pytest.raises(ValueError, match=r"query has 15 features .* embed_dim is 16"):
        mha(torch.randn(1, 3, 15), k, v)
    with pytest.raises(ValueError, match=r"key has 7 features .* kdim is 6"):
        mha(q, v, v)
    with pytest.raises(ValueError, match=r"value has 6 features .* vdim is 7"):
        mha(q, k, k)
    assert mha(q, k, v)[0].shape == (1, 3, 16)


@pytest.mark.parametrize("backend", [None, "tiled", "torch"])
def test_a_visibility_as_attn_mask(backend):
    """forward's attn_mask takes a Visibility, as annotated (it raised TypeError on every backend; found by
    a breaker run): causal as a Visibility equals is_causal=True, with a key padding mask too, and a window
    shows each query its last W keys in the weights."""
    from selfattention import Visibility

    torch.manual_seed(0)
    x = torch.randn(2, 7, 16)
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[0, :2] = False
    m = MultiHeadAttention(16, 4, backend=backend).eval()
    a, _ = m(x, is_causal=True, key_padding_mask=pad)
    b, _ = m(x, attn_mask=Visibility(7, 7, is_causal=True), key_padding_mask=pad)
    assert torch.allclose(a, b, atol=1e-6)
    _, w = m(x, attn_mask=Visibility(7, 7, is_causal=True, window=3), need_weights=True)
    want = torch.ones(7, 7, dtype=torch.bool).tril() & ~torch.ones(7, 7, dtype=torch.bool).tril(-3)
    assert torch.equal(w.ne(0).expand(2, 4, 7, 7), want.expand(2, 4, 7, 7))
