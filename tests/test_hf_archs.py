"""Many transformers architectures on ``selfattention.hf``, each against transformers' own attention.

The models are tiny and random (tests/tiny_archs.py: hidden 32, 2 layers, 4 heads, vocabulary 99, built
offline from configs). On the same weights, ours runs against transformers' ``eager`` (an independent
oracle: its own matmul-softmax code) and ``sdpa`` (torch's kernels; absent for Gemma 2 and gpt-oss):

* float32 logits, a batch of two with the first sequence left- or right-padded, T = 11 (a window of 4
  and Llama 4's chunks of 4 bite, and T is no multiple of any tile);
* float64 against sdpa to 1e-10 (eager computes its softmax in float32 in most models: 1e-6), on the
  default route and on the engine's block plans with 8 × 8 tiles (``planned``: every masked call planned,
  T = 11 spans two tiles, the second cut short);
* gradients of every parameter and of the input embeddings (Whisper: the input features), float64;
* greedy ``generate`` with the dynamic and the static cache (decoders, encoder-decoders): the same tokens
  as eager, and the same step logits.

Every comparison is checked to be able to fail: the same model with a control attention that ignores the
mask (every key visible) is far from eager on the same positions. Architectures that transformers does
not route through its attention interface (Bloom, Falcon, MPT, XGLM in transformers 5.x) are checked to
stay on their own code (no call reaches ours), not reported as passes.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from selfattention import hf, hf_masks  # noqa: E402
from tests import tiny_archs  # noqa: E402
from tests.tiny_archs import (  # noqa: E402
    ARCHS,
    BROKEN,
    DECODERS,
    NOT_ROUTED,
    ROUTED,
    SEQ2SEQS,
    batch,
    build,
    real,
)

CONTROL = "selfattention-control"


def _control(module, query, key, value, attention_mask, **kwargs):
    """Ours with the mask dropped (every key visible, not causal): what a backend that ignored the mask
    would return. Used only to show that each comparison below can fail."""
    kwargs.pop("is_causal", None)
    kwargs.pop("sliding_window", None)
    kwargs.pop("indices", None)  # DeepSeek sparse attention's selected keys: a mask too
    return hf.attention_forward(module, query, key, value, None, is_causal=False, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def registered():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.utils import logging

    hf.register()
    AttentionInterface.register(CONTROL, _control)
    AttentionMaskInterface.register(CONTROL, hf.attention_mask)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    logging.set_verbosity(verbosity)


_MODELS: dict[str, torch.nn.Module] = {}


def _model(name: str) -> torch.nn.Module:
    """One float32 model per architecture for the module (tests that change its dtype restore it)."""
    if name not in _MODELS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _MODELS[name] = build(name)
    return _MODELS[name]


@pytest.fixture
def planned(monkeypatch):
    """Every masked call on the engine's block plan, with 8 × 8 tiles (the score-mod kernel too)."""
    from selfattention.kernels import engine, scored

    make_problem, scored_attention = engine.make_problem, scored.attention
    monkeypatch.setattr(hf_masks, "SMALL", 0)
    monkeypatch.setattr(
        engine, "make_problem", lambda *a, **kw: make_problem(*a, **{"block_q": 8, "block_k": 8, **kw})
    )
    monkeypatch.setattr(
        scored, "attention", lambda *a, **kw: scored_attention(*a, **{"block_q": 8, "block_k": 8, **kw})
    )


def _logits(model, inputs, impl: str) -> torch.Tensor:
    model.set_attn_implementation(impl)
    out = model(**inputs)
    return out.logits if "logits" in out else out.last_hidden_state


def _cast(inputs: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def _references(name: str) -> list[str]:
    return ["eager", "sdpa"] if ARCHS[name].sdpa else ["eager"]


def _assert_close_and_sensitive(
    model, inputs, name: str, tol: dict[str, float], control: bool = True
) -> None:
    """Ours within ``tol[impl]`` × the logits' size of each reference on the defined positions, and the
    control (mask ignored) more than 100 × the loosest tolerance away from sdpa, else eager (not for an
    unpadded encoder: its mask hides nothing)."""
    keep = real(name, inputs)
    with torch.no_grad():
        ours = _logits(model, inputs, hf.NAME)
        scale = ours[keep].abs().max()
        assert torch.isfinite(ours[keep]).all() and scale > 1e-2
        refs = {impl: _logits(model, inputs, impl) for impl in tol}
        for impl, theirs in refs.items():
            if impl == "eager" and "sdpa" in refs and not torch.isfinite(theirs[keep]).all():
                # eager's float32 softmax of a float64 row that sees no key: NaN, which spreads to every
                # position in the next layer (0 · NaN); sdpa checks this case
                assert theirs.dtype == torch.float64
                continue
            err = (ours - theirs)[keep].abs().max() / scale
            assert err <= tol[impl], (impl, float(err))
        if control:
            wrong = _logits(model, inputs, CONTROL)
            assert (wrong - refs.get("sdpa", refs.get("eager")))[keep].abs().max() / scale > 100 * max(
                tol.values()
            )


# ------------------------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("side", ["left", "right", "none"])
@pytest.mark.parametrize("name", ROUTED)
def test_float32_logits_match_eager_and_sdpa(name, side):
    """Padded on either side, or no attention_mask at all (transformers' mask-less calls)."""
    model = _model(name)
    tol = dict.fromkeys(_references(name), 2e-6)
    control = side != "none" or ARCHS[name].kind != "encoder"
    _assert_close_and_sensitive(model, batch(name, side), name, tol, control)


def _query_rows(inputs, field: str) -> torch.Tensor | None:
    """Bool (B, Tq) of the real queries of an attention field (None: all); padding queries' rows differ by
    convention (eager: uniform weights over hidden keys, ours: zeros)."""
    key = "attention_mask" if field in ("attentions", "encoder_attentions") else "decoder_attention_mask"
    mask = inputs.get(key)
    return None if mask is None else mask.bool()


@pytest.mark.parametrize("name", ROUTED)
def test_output_attentions_equal_eager_weights(name):
    """The weights (the materialising route) of every layer and kind (self, cross), left padding."""
    model, inputs = _model(name), batch(name, "left")
    outs = {}
    with torch.no_grad():
        for impl in (hf.NAME, "eager"):
            model.set_attn_implementation(impl)
            outs[impl] = model(**inputs, output_attentions=True)
    fields = [f for f in outs["eager"].keys() if f.endswith("attentions") and outs["eager"][f]]
    assert fields
    for field in fields:
        ours, theirs = outs[hf.NAME][field], outs["eager"][field]
        assert len(ours) == len(theirs)
        rows = _query_rows(inputs, field)
        for a, b in zip(ours, theirs, strict=True):
            if b is None:  # a layer without attention (LFM2's convolutions)
                assert a is None
                continue
            assert a.shape == b.shape and a.dtype == b.dtype
            # (LongT5's local attention: blocked (B, H, blocks, block, 3 · block) weights, compared whole)
            keep = slice(None) if rows is None or b.dim() != 4 else rows[:, None, :, None].expand_as(b)
            assert (a - b)[keep].abs().max() <= 2e-6, field


@pytest.mark.parametrize("route", ["default", "planned"])
@pytest.mark.parametrize("name", ROUTED)
def test_float64_logits_match_sdpa_exactly(name, route, request):
    """float64: sdpa to 1e-10; eager to 1e-6, as most models' eager softmax runs in float32 (which also
    turns a left-padded float64 row into NaN: eager is compared on right padding only)."""
    if route == "planned":
        request.getfixturevalue("planned")
    model = _model(name).double()
    try:
        for side in ("left", "right") if ARCHS[name].sdpa else ("right",):
            inputs = _cast(batch(name, side), torch.float64)
            tol = {"eager": 1e-6} if side == "right" else {}
            if ARCHS[name].sdpa:
                tol["sdpa"] = 1e-10
            _assert_close_and_sensitive(model, inputs, name, tol)
    finally:
        model.float()


@pytest.mark.parametrize("name", DECODERS)
def test_prefill_in_two_chunks_matches_eager(name):
    """A left-padded batch prefilled as 6 tokens, then 5 more after the cached 6 (Tq = 5 at an offset: the
    windows, chunks and padding shifted by the cache), float32: the second chunk's logits are eager's."""
    model, inputs = _model(name), batch(name, "left")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    outs = {}
    with torch.no_grad():
        for impl in ("eager", hf.NAME, CONTROL):
            model.set_attn_implementation(impl)
            first = model(input_ids=ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
            outs[impl] = model(
                input_ids=ids[:, 6:], attention_mask=mask, past_key_values=first.past_key_values
            ).logits
    scale = outs["eager"].abs().max()
    assert (outs[hf.NAME] - outs["eager"]).abs().max() <= 2e-6 * scale
    assert (outs[CONTROL] - outs["eager"]).abs().max() > 2e-4 * scale


@pytest.mark.parametrize("name", DECODERS)
def test_packed_sequences_match_eager(name):
    """Two sequences packed in one row (position ids restart at 0, no mask, no cache): transformers'
    packed-sequence recipe, as documents on the engine."""
    model = _model(name)
    ids = torch.randint(3, tiny_archs.VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]])
    outs = {}
    with torch.no_grad():
        for impl in ("eager", hf.NAME, CONTROL):
            model.set_attn_implementation(impl)
            outs[impl] = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    scale = outs["eager"].abs().max()
    assert (outs[hf.NAME] - outs["eager"]).abs().max() <= 2e-6 * scale
    assert (outs[CONTROL] - outs["eager"]).abs().max() > 2e-4 * scale


RECORDED = ["mistral", "gemma2", "gpt_oss", "llama4_text", "modernbert", "doge", "gpt_bigcode", "deepseek_v3"]


@pytest.mark.parametrize("name", RECORDED + ["gemma3_bidirectional", "granite"])
def test_recorded_calls_give_eager_weights(name):
    """``recording()``: each recorded call (in layer order) gives, through ``AttentionCall.weights``, the
    weights eager returns for that layer; the run itself keeps ours' logits."""
    model, inputs = _model(name), batch(name, "left")
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(**inputs, output_attentions=True).attentions
        with hf.recording() as calls:
            _logits(model, inputs, hf.NAME)
    theirs = [w for w in eager if w is not None]
    assert len(calls) == len(theirs) > 0
    rows = inputs["attention_mask"].bool()[:, None, :, None]
    for call, b in zip(calls, theirs, strict=True):
        a = call.weights()
        assert a.shape == b.shape
        assert (a - b)[rows.expand_as(b)].abs().max() <= 2e-6


LONG = ["mistral", "gemma2", "gpt_oss", "llama4_text", "qwen2", "deepseek_v3", "doge"]
LONG += ["bert", "modernbert", "gemma3_bidirectional", "t5"]


@pytest.mark.parametrize("name", LONG)
def test_long_padded_batch_on_the_default_block_plans(name):
    """T = 530 (Tq · Tk past the one-call limit ``SMALL``: the engine's own plans with its default tiles,
    stacked window bands, a last tile cut short), rows left-padded by 300, 1 and 0, float32, against
    eager."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(name, max_position_embeddings=1024)
    inputs = batch(name, "left", t=530)
    inputs["attention_mask"][0, :300] = 0  # enough hidden keys for the control to show
    inputs["input_ids"][0, :300] = tiny_archs.config_pad(name)
    assert inputs["input_ids"].shape[1] ** 2 > hf_masks.SMALL
    _assert_close_and_sensitive(model, inputs, name, {"eager": 2e-6})


# ------------------------------------------------------------------------------------------------ gradients


def _grads(model, inputs, name: str, impl: str) -> dict[str, torch.Tensor]:
    """d(weighted sum of the defined logits) / d(every parameter, the input embeddings or features)."""
    model.set_attn_implementation(impl)
    model.zero_grad()
    inputs = dict(inputs)
    if not ARCHS[name].embeds:
        leaf = None
    elif "input_features" in inputs:
        leaf = inputs["input_features"].clone().requires_grad_(True)
        inputs["input_features"] = leaf
    else:
        leaf = model.get_input_embeddings()(inputs.pop("input_ids")).detach().requires_grad_(True)
        inputs["inputs_embeds"] = leaf
    out = model(**inputs)
    logits = out.logits if "logits" in out else out.last_hidden_state
    weight = torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)
    (logits[real(name, inputs)] * weight).sum().backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if leaf is not None:
        out["<inputs>"] = leaf.grad.clone()
    model.zero_grad()
    return out


@pytest.mark.parametrize("route", ["default", "planned"])
@pytest.mark.parametrize("name", ROUTED)
def test_float64_gradients_match_the_reference(name, route, request):
    """Every parameter's gradient and the inputs' (embeddings; Whisper: features; Gemma 4 needs its token
    ids: parameters only), on the default route and on 8 × 8 tiles, against sdpa in float64 (no sdpa:
    eager, right padding)."""
    if route == "planned":
        request.getfixturevalue("planned")
    model = _model(name).double()
    ref = "sdpa" if ARCHS[name].sdpa else "eager"
    inputs = _cast(batch(name, "left" if ref == "sdpa" else "right"), torch.float64)
    try:
        theirs = _grads(model, inputs, name, ref)
        if not all(torch.isfinite(g).all() for g in theirs.values()):
            # Gemma 3n: transformers' own gradients (sdpa and eager alike) are NaN with any padding (its
            # per-layer code on the padded rows); compared on the unpadded batch instead
            inputs = _cast(batch(name, "none"), torch.float64)
            theirs = _grads(model, inputs, name, ref)
        ours = _grads(model, inputs, name, hf.NAME)
    finally:
        model.float()
    assert ours.keys() == theirs.keys()
    tol = 1e-9 if ref == "sdpa" else 1e-6
    for n in ours:
        size = theirs[n].abs().max().clamp_min(1e-6)
        assert (ours[n] - theirs[n]).abs().max() <= tol * size, n
    assert max(g.abs().max() for g in theirs.values()) > 1e-4


# ------------------------------------------------------------------------------------------------ generation


GENERATE = [n for n in DECODERS + SEQ2SEQS if ARCHS[n].kind != "speech"]


@pytest.mark.parametrize("case", ["dynamic", "static-padded-planned", "static-unpadded"])
@pytest.mark.parametrize("name", GENERATE)
def test_greedy_generation_matches_eager(name, case, request):
    """Left-padded prompts (encoder-decoders: a right-padded source) or no mask at all (the static cache's
    mask-less prefill: keys padded to the cache length), 5 new tokens, float32, the dynamic or static
    cache, the default route or the block plans (8 × 8 tiles, at every decode step's offset): the tokens
    are eager's and every step's logits within 2e-5 of eager's."""
    cache = case.split("-")[0]
    if case.endswith("planned"):
        request.getfixturevalue("planned")
    model = _model(name)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, tiny_archs.VOCAB, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    if ARCHS[name].kind == "decoder":
        mask[0, :2] = 0
    else:
        mask[0, -2:] = 0
    ids[mask == 0] = tiny_archs.config_pad(name)
    masks = {} if case.endswith("unpadded") else {"attention_mask": mask}
    runs = {}
    for impl in ("eager", hf.NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs[impl] = model.generate(
                input_ids=ids, **masks, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                cache_implementation=cache, output_scores=True, return_dict_in_generate=True,
                pad_token_id=tiny_archs.config_pad(name), eos_token_id=None,
            )  # fmt: skip
    ours, theirs = runs[hf.NAME], runs["eager"]
    assert torch.equal(ours.sequences, theirs.sequences)
    for step_ours, step_theirs in zip(ours.scores, theirs.scores, strict=True):
        finite = torch.isfinite(step_theirs)  # -inf: tokens a logits processor forbids (e.g. forced BOS)
        assert torch.equal(finite, torch.isfinite(step_ours))
        assert (step_ours - step_theirs)[finite].abs().max() <= 2e-5 * step_theirs[finite].abs().max()


def test_whisper_generation_matches_eager():
    """Whisper's own ``generate`` (speech features in, its decoder with self- and cross-attention caches):
    eager's tokens."""
    model, inputs = _model("whisper"), batch("whisper", "none")
    tokens = {}
    for impl in ("eager", hf.NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokens[impl] = model.generate(
                input_features=inputs["input_features"], max_new_tokens=5, min_new_tokens=5, do_sample=False
            )
    assert tokens["eager"].shape[-1] >= 5 and torch.equal(tokens[hf.NAME], tokens["eager"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gemma3_with_images_matches_eager_and_sdpa(dtype):
    """Gemma 3 with its vision tower: image tokens see each other both ways inside a causal, left-padded
    batch (transformers' or-mask, a generic predicate here), the SigLIP tower bidirectionally. float32:
    2e-6 of eager and sdpa; float64: 1e-10 of sdpa."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_archs.build_gemma3_vision().to(dtype)
    inputs = _cast(tiny_archs.gemma3_vision_batch(), dtype)
    tol = {"eager": 2e-6, "sdpa": 2e-6} if dtype == torch.float32 else {"sdpa": 1e-10}
    with hf.recording() as calls:
        _assert_close_and_sensitive(model, inputs, "gemma3_text", tol)
    assert len(calls) >= 3  # the vision tower's layer and both text layers reached us


# ------------------------------------------------------------------------------------------------ not routed


@pytest.mark.parametrize("name", NOT_ROUTED)
def test_architectures_outside_the_attention_interface_never_reach_our_backend(name):
    """transformers 5.x runs Bloom, Falcon, MPT and XGLM on their own attention code (their classes do not
    support ``AttentionInterface``): asking for ours leaves them as they were, no call reaches us, and
    their result is their own. (Reported as not run by this backend, never as a pass of it.)"""
    model = _model(name)
    assert not getattr(type(model), "_supports_attention_backend", False)
    inputs = batch(name, "right")
    with torch.no_grad():
        before = _logits(model, inputs, "eager")
        with hf.recording() as calls:
            after = _logits(model, inputs, hf.NAME)
    assert calls == [] and torch.equal(before, after)


@pytest.mark.parametrize("name", BROKEN)
def test_architectures_transformers_cannot_build_offline(name):
    """Skipped with transformers' own error while its eager model cannot be built or run from a tiny
    config (not our module: nothing of ours has run yet); checked like the others once it can."""
    import transformers

    try:
        model = _model(name)
        inputs = batch(name, "left")
        with torch.no_grad():
            _logits(model, inputs, "eager")
    except Exception as e:  # transformers' own failure, before our backend is involved
        pytest.skip(
            f"transformers {transformers.__version__} fails on its own eager {name}: {type(e).__name__}: {e}"
        )
    tol = dict.fromkeys(_references(name), 2e-6)
    _assert_close_and_sensitive(model, inputs, name, tol)
