"""Bad input gets one clear ValueError/TypeError naming the argument and what was wrong, on every path.

Each row of ``BAD_INPUTS`` is run against every registered backend (and the public entry point): the
exception type must match, and the message must name the argument and the offending shape, dtype,
device or value, so that a user can fix the call without reading a stack trace.
"""

from __future__ import annotations

import re

import pytest
import torch

import selfattention as sa
from selfattention import masks
from selfattention.backends import available_backends, get_backend

BACKENDS = available_backends()


def t(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype, device=device)


Q, K, V = t(2, 3, 5, 8), t(2, 3, 7, 8), t(2, 3, 7, 6)

# (id, kwargs, exception, regex the message must match)
BAD_INPUTS = [
    ("query_not_tensor", dict(query=[[1.0]]), TypeError, r"query must be a torch\.Tensor, got list"),
    ("key_none", dict(key=None), TypeError, r"key must be a torch\.Tensor, got NoneType"),
    ("query_int", dict(query=t(2, 3, 5, 8, dtype=torch.int64)), TypeError, r"query .*floating.*int64"),
    ("value_bool", dict(value=t(2, 3, 7, 6, dtype=torch.bool)), TypeError, r"value .*floating.*torch\.bool"),
    (
        "mixed_dtypes",
        dict(key=t(2, 3, 7, 8, dtype=torch.float64)),
        TypeError,
        r"same dtype.*query torch\.float32, key torch\.float64",
    ),
    ("half_and_float", dict(value=t(2, 3, 7, 6, dtype=torch.float16)), TypeError, r"value torch\.float16"),
    ("complex", dict(query=t(2, 3, 5, 8, dtype=torch.complex64)), TypeError, r"query .*complex64"),
    ("key_on_meta", dict(key=t(2, 3, 7, 8, device="meta")), ValueError, r"same device.*key on meta"),
    ("query_on_meta", dict(query=t(2, 3, 5, 8, device="meta")), ValueError, r"same device.*query on meta"),
    ("query_1d", dict(query=t(8)), ValueError, r"query must have at least 2 dims.*\(8\)"),
    (
        "rank_mismatch",
        dict(key=t(3, 7, 8), value=t(3, 7, 6)),
        ValueError,
        r"same number of dims.*\(3, 7, 8\)",
    ),
    ("head_dim_mismatch", dict(key=t(2, 3, 7, 9)), ValueError, r"same head_dim.*D=8.*D=9"),
    ("kv_length_mismatch", dict(value=t(2, 3, 6, 6)), ValueError, r"same sequence length.*Tk=7.*Tk=6"),
    (
        "kv_batch_mismatch",
        dict(value=t(1, 3, 7, 6)),
        ValueError,
        r"key and value must have the same batch/head",
    ),
    (
        "heads_without_gqa",
        dict(key=t(2, 1, 7, 8), value=t(2, 1, 7, 6), query=t(2, 4, 5, 8)),
        None,  # broadcasts (1 head shared) -> allowed; see heads_3_vs_2
        None,
    ),
    (
        "heads_3_vs_2",
        dict(key=t(2, 2, 7, 8), value=t(2, 2, 7, 6)),
        ValueError,
        r"do not broadcast.*enable_gqa=True",
    ),
    (
        "gqa_heads_do_not_divide",
        dict(query=t(2, 6, 5, 8), key=t(2, 4, 7, 8), value=t(2, 4, 7, 6), enable_gqa=True),
        ValueError,
        r"multiple of the key/value heads.*query heads 6.*key/value heads 4",
    ),
    ("batch_mismatch", dict(query=t(3, 3, 5, 8)), ValueError, r"query \(3, 3, 5, 8\) and key \(2, 3, 7, 8\)"),
    (
        "mask_wrong_tk",
        dict(attn_mask=t(5, 6, dtype=torch.bool)),
        ValueError,
        r"attn_mask of shape \(5, 6\).*\(2, 3, 5, 7\)",
    ),
    (
        "mask_wrong_tq",
        dict(attn_mask=t(4, 7, dtype=torch.bool)),
        ValueError,
        r"attn_mask of shape \(4, 7\) does not broadcast",
    ),
    (
        "mask_bigger_batch",
        dict(attn_mask=t(4, 3, 5, 7, dtype=torch.bool)),
        ValueError,
        r"attn_mask of shape \(4, 3, 5, 7\) does not broadcast",
    ),
    (
        "mask_extra_dim",
        dict(attn_mask=t(1, 2, 3, 5, 7, dtype=torch.bool)),
        ValueError,
        r"attn_mask of shape \(1, 2, 3, 5, 7\)",
    ),
    (
        "mask_int",
        dict(attn_mask=t(5, 7, dtype=torch.int64)),
        TypeError,
        r"attn_mask must be bool.*int64.*\.bool\(\)",
    ),
    ("mask_uint8", dict(attn_mask=t(5, 7, dtype=torch.uint8)), TypeError, r"attn_mask .*uint8"),
    (
        "mask_list",
        dict(attn_mask=[[True]]),
        TypeError,
        r"attn_mask must be a torch\.Tensor or None, got list",
    ),
    ("mask_nan", dict(attn_mask=torch.full((5, 7), float("nan"))), ValueError, r"attn_mask contains NaN"),
    (
        "mask_posinf",
        dict(attn_mask=torch.full((5, 7), float("inf"))),
        ValueError,
        r"attn_mask contains \+inf",
    ),
    (
        "mask_on_meta",
        dict(attn_mask=t(5, 7, dtype=torch.bool, device="meta")),
        ValueError,
        r"attn_mask is on meta",
    ),
    ("dropout_1", dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\), got 1\.0"),
    ("dropout_negative", dict(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\), got -0\.1"),
    ("dropout_str", dict(dropout_p="0.1"), TypeError, r"dropout_p must be a float.*str"),
    ("scale_nan", dict(scale=float("nan")), ValueError, r"scale must be finite, got nan"),
    ("scale_inf", dict(scale=float("inf")), ValueError, r"scale must be finite, got inf"),
    ("scale_str", dict(scale="0.1"), TypeError, r"scale must be a float or None, got str"),
    ("scale_bool", dict(scale=True), TypeError, r"scale must be a float or None, got bool"),
    ("scale_tensor_2", dict(scale=torch.ones(2)), ValueError, r"scale must be a number.*\(2\)"),
    ("is_causal_int", dict(is_causal=1), TypeError, r"is_causal must be a bool, got int"),
    (
        "is_causal_tensor",
        dict(is_causal=torch.tensor(True)),
        TypeError,
        r"is_causal must be a bool, got torch\.Tensor",
    ),
    ("enable_gqa_str", dict(enable_gqa="yes"), TypeError, r"enable_gqa must be a bool, got str"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,kwargs,exc,pattern", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_a_clear_error(backend, name, kwargs, exc, pattern):
    args = {"query": Q, "key": K, "value": V, **kwargs}
    fn = get_backend(backend)
    if exc is None:
        fn(**args)  # allowed
        return
    with pytest.raises(exc, match=pattern) as info:
        fn(**args)
    assert "\n" not in str(info.value), "one line, please"
    with pytest.raises(exc, match=pattern):  # the public entry point says the same
        sa.scaled_dot_product_attention(**args, backend=backend)


def test_dropout_is_checked_even_when_not_training():
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="dropout_p"):
            get_backend(backend)(Q, K, V, dropout_p=1.5, training=False)


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; choose one of \['reference'"):
        sa.scaled_dot_product_attention(Q, K, V, backend="flash")
    with pytest.raises(ValueError, match="unknown attention backend"):
        sa.scaled_dot_product_attention(Q, K, V, backend=3)


def test_empty_sequences_are_defined_not_refused():
    """T = 0 is not an error: Tq = 0 gives an empty result, Tk = 0 gives zeros (every path)."""
    for backend in BACKENDS:
        fn = get_backend(backend)
        assert fn(t(2, 0, 8), t(2, 4, 8), t(2, 4, 3)).shape == (2, 0, 3)
        out = fn(torch.ones(2, 5, 8), t(2, 0, 8), t(2, 0, 3))
        assert out.shape == (2, 5, 3) and not out.any()


def test_meta_device_inputs_all_on_meta_get_a_clear_error():
    """Everything on the meta device (shapes, no values): a clear ValueError, not torch's RuntimeError
    from deep inside ("Tensor.item() cannot be called on meta tensors")."""
    q, k, v = t(2, 5, 8, device="meta"), t(2, 7, 8, device="meta"), t(2, 7, 6, device="meta")
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="meta device"):
            get_backend(backend)(q, k, v)


# --------------------------------------------------------------------------------- other public functions


@pytest.mark.parametrize(
    "call,exc,pattern",
    [
        (lambda: sa.attention_weights(Q, t(2, 3, 7, 9)), ValueError, r"head_dim"),
        (lambda: sa.attention_weights(Q, K, attn_mask=t(5, 6, dtype=torch.bool)), ValueError, r"attn_mask"),
        (
            lambda: sa.simple_attention(t(4)),
            ValueError,
            r"x must have shape \(\.\.\., T, d\), got shape \(4,\)",
        ),
        (lambda: sa.simple_attention([[1.0]]), TypeError, r"x must be a torch\.Tensor, got list"),
        (lambda: sa.simple_attention(t(3, 4, dtype=torch.int32)), TypeError, r"floating.*int32"),
        (lambda: sa.attention_steps(Q, K, V, scale="x"), TypeError, r"scale"),
        (lambda: masks.causal_mask(-1), ValueError, r"q_len must be >= 0, got -1"),
        (lambda: masks.causal_mask(2.5), TypeError, r"q_len must be an int, got float"),
        (lambda: masks.causal_mask(3, -2), ValueError, r"k_len must be >= 0, got -2"),
        (lambda: masks.sliding_window_mask(4, window=0), ValueError, r"window must be a positive int, got 0"),
        (lambda: masks.sliding_window_mask(4, window=-3), ValueError, r"window .* got -3"),
        (lambda: masks.padding_mask([3, -1]), ValueError, r"lengths must be >= 0"),
        (lambda: masks.padding_mask([3, 5], max_len=4), ValueError, r"a length \(5\) exceeds max_len \(4\)"),
        (lambda: masks.padding_mask([1.5, 2.0]), ValueError, r"lengths must be a 1-D integer sequence"),
        (lambda: masks.combine(torch.ones(2, 2)), TypeError, r"combine\(\) takes bool masks"),
        (lambda: masks.to_additive(torch.ones(2, 2)), TypeError, r"to_additive\(\) takes a bool mask"),
        (lambda: masks.document_mask(torch.tensor([0.5, 1.0])), ValueError, r"q_doc_ids must be an integer"),
        (lambda: masks.from_torch_mha(torch.ones(2, dtype=torch.int8)), TypeError, r"bool or floating"),
    ],
)
def test_other_public_functions(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize(
    "make,exc,pattern",
    [
        (lambda: sa.SelfAttention(0, 4), ValueError, r"d_in must be a positive int, got 0"),
        (lambda: sa.SelfAttention(4, -1), ValueError, r"d_out must be a positive int, got -1"),
        (lambda: sa.SelfAttention(4.0, 4), TypeError, r"d_in must be a positive int, got float"),
        (lambda: sa.SelfAttention(True, 4), TypeError, r"d_in must be a positive int, got bool"),
    ],
)
def test_module_constructor_errors(make, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make()


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_forward_errors(backend):
    layer = sa.SelfAttention(4, 3, backend=backend)
    with pytest.raises(ValueError, match=r"x has 5 features in its last dim, this module expects d_in=4"):
        layer(t(2, 3, 5))
    with pytest.raises(TypeError, match=r"x must be a floating-point tensor, got dtype torch\.int64"):
        layer(t(2, 3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., T, d_in\), got shape \(4,\)"):
        layer(t(4))
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 4\)"):
        layer(t(2, 3, 4), attn_mask=t(3, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        sa.SimpleSelfAttention()("text")


def test_tiled_block_sizes_must_be_positive():
    tiled = pytest.importorskip("selfattention.tiled")
    fn = getattr(tiled, "tiled_attention", None)
    if fn is None:
        pytest.skip("tiled_attention not there yet")
    q = torch.randn(5, 8)
    for name in ("block_q", "block_k"):
        for bad, exc in ((0, ValueError), (-4, ValueError), (2.5, TypeError), (True, TypeError)):
            with pytest.raises(exc, match=name):
                fn(q, q, q, **{name: bad})
    # sizes that do not divide T are fine
    assert torch.allclose(
        fn(q, q, q, block_q=3, block_k=2), sa.scaled_dot_product_attention(q, q, q), atol=1e-6
    )


def test_kv_cache_bad_input():
    kv = pytest.importorskip("selfattention.kv_cache")
    with pytest.raises(ValueError, match=r"capacity must be a positive int, got 0"):
        kv.KVCache(1, 2, 4, 0)
    with pytest.raises(ValueError, match=r"capacity \(2\) must be >= window \(3\)"):
        kv.KVCache(1, 2, 4, 2, window=3)
    with pytest.raises(TypeError, match=r"dtype must be a floating torch\.dtype"):
        kv.KVCache(1, 2, 4, 8, dtype=torch.int64)


# --------------------------------------------------------------------------------------------- persistence


def _roundtrip(module: torch.nn.Module, tmp_path, make: callable) -> torch.nn.Module:
    from safetensors.torch import load_file, save_file

    f = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(f))
    fresh = make()
    fresh.load_state_dict(load_file(str(f)), strict=True)
    return fresh


@pytest.mark.parametrize("kind", ["SelfAttention", "MultiHeadAttention"])
def test_state_dict_safetensors_roundtrip_is_exact(tmp_path, kind):
    torch.manual_seed(21)
    if kind == "SelfAttention":

        def make():
            return sa.SelfAttention(6, 5, qkv_bias=True)

        x = torch.randn(2, 7, 6)
    else:
        mha = pytest.importorskip("selfattention.mha")

        def make():
            return mha.MultiHeadAttention(embed_dim=12, num_heads=4, num_kv_heads=2)

        x = torch.randn(2, 7, 12)
    module = make()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    torch.manual_seed(99)  # the fresh module starts from other weights: the load must really happen
    loaded = _roundtrip(module, tmp_path, make)
    for name, t in module.state_dict().items():
        assert torch.equal(t, before[name]), f"saving modified {name}"
        assert torch.equal(loaded.state_dict()[name], t), name
    out = module(x, is_causal=True)
    out_loaded = loaded(x, is_causal=True)
    if isinstance(out, tuple):
        out, out_loaded = out[0], out_loaded[0]
    assert torch.equal(out, out_loaded)


def _decoder():
    import selfattention.decoder

    return selfattention.decoder


def test_checkpoint_wrong_shapes_missing_and_unexpected_tensors_are_named(tmp_path):
    dec = _decoder()
    from safetensors.torch import load_file, save_file

    torch.manual_seed(22)
    tok = dec.CharTokenizer("abc d")
    model = dec.Decoder(
        dec.DecoderConfig(vocab_size=tok.vocab_size, context=16, d_model=8, num_heads=2, num_layers=1)
    )
    path, cfg = dec.save_checkpoint(model, tok, tmp_path / "ok.safetensors")
    loaded, tok2, _ = dec.load_checkpoint(path)
    assert tok2.chars == tok.chars
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name

    tensors = load_file(str(path))
    name = next(iter(tensors))
    # wrong shape
    bad = dict(tensors)
    bad[name] = torch.zeros(3, 3)
    save_file(bad, str(path))
    with pytest.raises(
        ValueError, match=rf"tensor '{re.escape(name)}' has shape \(3, 3\), the model expects"
    ):
        dec.load_checkpoint(path)
    # missing and unexpected
    bad = {k: v for k, v in tensors.items() if k != name}
    bad["extra.weight"] = torch.zeros(2)
    save_file(bad, str(path))
    with pytest.raises(
        ValueError, match=rf"missing tensor '{re.escape(name)}'.*unexpected tensor 'extra\.weight'"
    ):
        dec.load_checkpoint(path)
    # not a safetensors file at all / no config next to it / a broken config
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        dec.load_checkpoint(path)
    cfg.write_text("{broken", encoding="utf-8")
    with pytest.raises(ValueError, match="not a valid decoder config"):
        dec.load_checkpoint(path)
    cfg.unlink()
    with pytest.raises(FileNotFoundError, match=r"ok\.json"):
        dec.load_checkpoint(path)


def test_check_state_dict_works_for_the_attention_modules_too():
    dec = _decoder()
    layer = sa.SelfAttention(4, 3)
    sd = dict(layer.state_dict())
    sd["W_key.weight"] = torch.zeros(3, 5)
    del sd["W_value.weight"]
    with pytest.raises(ValueError, match=r"W_value\.weight.*|W_key\.weight.*\(3, 5\)"):
        dec.check_state_dict(layer, sd, source="layer.safetensors")


@pytest.mark.parametrize("backend", available_backends())
def test_sparse_inputs_get_a_clear_error_naming_the_layout(backend):
    q = torch.randn(2, 4, 8)
    with pytest.raises(
        TypeError, match=r"key must be a dense \(strided\) tensor, got layout torch\.sparse_coo"
    ):
        sa.scaled_dot_product_attention(q, q.to_sparse(), q, backend=backend)
