"""The grader: every gallery implementation diagnosed exactly, every single mistake identifiable, the
learner's exceptions reported (never raised). The command line: tests/test_grade_cli.py.

The references the grader fits are checked against independent oracles (tests/oracle.py's loops, torch's
SDPA, the lectures' printed numbers), so a wrong mutation or a wrong spec path fails here.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from selfattention import i18n
from selfattention.grade import MISTAKES, TASKS, FileSyntaxError, grade, grade_file
from selfattention.grade.attention_tasks import DECODE, SDPA, SIMPLE, attend, projections
from selfattention.grade.fit import configs
from selfattention.grade.layout_tasks import CAUSAL, HEADS, as_keep_mask
from tests.oracle import attention_ref

GALLERY = Path(__file__).parent / "grade_gallery"
FILES = sorted(GALLERY.glob("*.py"))


def _header(path: Path, key: str) -> str:
    m = re.search(rf"^# {key}: (.+)$", path.read_text(encoding="utf-8"), re.M)
    assert m, f"{path.name} has no '# {key}:' line"
    return m.group(1).strip()


def _expected(path: Path) -> set[str]:
    text = _header(path, "expect")
    return set() if text == "none" else {c.strip() for c in text.split(",")}


# --- the gallery --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_gallery_is_diagnosed_exactly(path):
    report = grade_file(path)
    assert report.task == _header(path, "task")
    assert set(report.codes) == _expected(path), str(report)
    assert report.passed == (not _expected(path))
    assert len(report.codes) == len(set(report.codes))


def test_gallery_size_and_provenance():
    wrong = [p for p in FILES if p.name.startswith("wrong_")]
    right = [p for p in FILES if p.name.startswith("right_")]
    assert len(wrong) >= 12 and len(right) >= 4
    for p in wrong:
        seen = re.search(r"^# seen: (.+?)(?=^[^#])", p.read_text(encoding="utf-8"), re.M | re.S)
        assert seen and re.search(r"[\w.-]+/[\w.-]+#\d+", seen.group(1)), f"{p.name}: cite owner/repo#N"
        assert _expected(p) <= set(MISTAKES)
    # the styles the issue asks for: loops, einsum, torch SDPA, numpy
    styles = " ".join(p.read_text(encoding="utf-8") for p in right)
    for marker in ("for i in range", "einsum", "F.scaled_dot_product_attention", "import numpy"):
        assert marker in styles
    # every mistake the grader names (but those about code it cannot run or explain) has a public case
    named = set().union(*(_expected(p) for p in wrong))
    # mutates_input is read from torch's version counters, not fitted (its own tests are at the end)
    meta = {"exception", "wrong_shape", "unrecognised", "not_gradable", "mutates_input"}
    assert set(MISTAKES) - meta <= named, sorted(set(MISTAKES) - meta - named)


# --- every single mistake has its own signature ---------------------------------------------------------


def _single_mistakes(task):
    for config in configs(task.axes, 1):
        if config != task.spec:
            yield config


def _learner_from_reference(task, config):
    """A learner whose code *is* the mutation ``config`` (float32 in, float32 out, like a learner)."""

    def run(*args):
        from selfattention.grade.fit import Probe

        info = {}
        if task is CAUSAL:
            tq, tk = (args * 2)[:2] if len(args) == 1 else args
            info = {"tq": tq, "tk": tk}
        probe = Probe("", tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args), info=info)
        out = task.reference(None, config, probe)
        if task is DECODE:  # the in-place writes of a decode step
            k_cache, v_cache = args[3], args[4]
            k_cache.copy_(out[1])
            v_cache.copy_(out[2])
            return out[0].float()
        return out.float() if out.dtype != torch.bool else out

    return run


@pytest.mark.parametrize("task", [SIMPLE, SDPA, DECODE, CAUSAL], ids=lambda t: t.name)
def test_each_single_mistake_is_identified(task):
    for config in _single_mistakes(task):
        learner = _learner_from_reference(task, config)
        expected = [c for axis in task.axes if (c := axis.code(config[axis.name]))]
        assert grade(learner, task=task.name).codes == expected, config


#: pairs of mistakes that make the very same mask: inverting tril(-1) gives triu(0), the future triangle
_SAME_MASK = {
    ("mask_polarity", "causal_diagonal"): ["causal_future"],
    ("mask_polarity", "causal_future"): ["causal_diagonal"],
    ("causal_diagonal", "causal_future"): ["mask_polarity"],
}


@pytest.mark.parametrize("task", [SIMPLE, SDPA, DECODE, CAUSAL], ids=lambda t: t.name)
def test_two_mistakes_at_once_are_both_named(task):
    """Every pair of mistakes is named as exactly that pair, unless one of them leaves no trace next to the
    other (no softmax makes its axis moot, a mask applied after the softmax makes the fill moot, a single
    decode query makes the softmax axis moot): then the one that does is named, never a mistake that is not
    there. Most pairs are named exactly."""
    exact = total = 0
    for config in configs(task.axes, 2):
        expected = [c for axis in task.axes if (c := axis.code(config[axis.name]))]
        if len([a for a in task.axes if config[a.name] != a.default]) != 2:
            continue
        total += 1
        got = grade(_learner_from_reference(task, config), task=task.name).codes
        if got == expected:
            exact += 1
        elif task is CAUSAL:
            assert got == _SAME_MASK[tuple(expected)], (config, got)
        else:
            assert got and set(got) < set(expected), (config, got)
    assert exact >= 0.6 * total, (exact, total)


def test_each_heads_mistake_is_identified():
    from selfattention.grade.layout_tasks import _merge, _split  # noqa: PLC2701 — the task's own references

    for split_opt, _code in HEADS.axes[0].options:
        for merge_opt, _code2 in HEADS.axes[1].options:
            pair = (lambda x, h, *, o=split_opt: _split(x, h, o), lambda x, *, o=merge_opt: _merge(x, o))
            expected = [c for c in (HEADS.axes[0].code(split_opt), HEADS.axes[1].code(merge_opt)) if c]
            assert grade(pair, task="heads").codes == expected, (split_opt, merge_opt)


# --- the spec paths against independent oracles ---------------------------------------------------------


def test_sdpa_spec_is_the_oracle_and_torch():
    for probe in SDPA.probes(None):
        q, k, v = probe.args[:3]
        mask = probe.args[3] if len(probe.args) > 3 else None
        got = SDPA.reference(None, SDPA.spec, probe)
        want, _w = attention_ref(q, k, v, attn_mask=mask)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(
            got.float(), torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        )
    # the mutated path with every option at the spec agrees with the spec path
    for probe in SDPA.probes(None):
        q, k, v = (t.double() for t in probe.args[:3])
        mask = probe.args[3] if len(probe.args) > 3 else None
        torch.testing.assert_close(
            attend(q, k, v, mask, SDPA.spec, 1 / math.sqrt(q.shape[-1])),
            SDPA.reference(None, SDPA.spec, probe),
            rtol=1e-12,
            atol=1e-12,
        )


def test_simple_spec_replays_lecture_000():
    probe = SIMPLE.probes(None)[0]  # "Your journey starts"
    z = SIMPLE.reference(None, SIMPLE.spec, probe)
    # lecture 000: z_journey = 0.21·x_Your + 0.36·x_journey + 0.43·x_starts (weights printed to 2 decimals)
    x = probe.args[0].double()
    torch.testing.assert_close(z[1], 0.21 * x[0] + 0.36 * x[1] + 0.43 * x[2], atol=6e-3, rtol=0)


def test_decode_spec_equals_recomputation():
    """Three decode steps from an empty cache give the causal attention of the whole sequence."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(3, 6, generator=gen),
        torch.randn(3, 6, generator=gen),
        torch.randn(3, 4, generator=gen),
    )
    k_cache, v_cache = torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)
    from selfattention.grade.fit import Probe

    outs = []
    for pos in range(3):
        probe = Probe("", (q[pos : pos + 1], k[pos : pos + 1], v[pos : pos + 1], k_cache, v_cache, pos))
        out, k_cache, v_cache = DECODE.reference(None, DECODE.spec, probe)
        outs.append(out)
    want, _w = attention_ref(q, k, v, is_causal=True)
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-10, atol=1e-10)


def test_causal_spec_is_bottom_right():
    probe = next(p for p in CAUSAL.probes(lambda a, b: None) if p.info == {"tq": 3, "tk": 6})
    assert CAUSAL.reference(None, CAUSAL.spec, probe).int().tolist() == [
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1],
    ]


def test_mask_conventions_accepted():
    keep = torch.tensor([[True, False], [True, True]])
    assert torch.equal(as_keep_mask(keep), keep)
    assert torch.equal(as_keep_mask(keep.int()), keep)
    additive = torch.zeros(2, 2).masked_fill(~keep, -math.inf)
    assert torch.equal(as_keep_mask(additive), keep)
    with pytest.raises(ValueError):
        as_keep_mask(torch.tensor([[0.5, 1.0]]))


# --- the learner's code misbehaving ---------------------------------------------------------------------


def test_learner_exception_is_a_finding():
    def scaled_dot_product_attention(q, k, v, mask=None):
        raise ValueError("boom")

    report = grade(scaled_dot_product_attention)
    assert report.codes == ["exception"]
    assert "ValueError: boom" in report.findings[0].message
    assert not report.passed


def test_file_that_fails_to_load(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def simple_attention(X):\n    return X +\n", encoding="utf-8")
    with pytest.raises(FileSyntaxError, match=r"bad\.py, line 2, column \d+: not valid Python") as e:
        grade_file(bad, task="simple")
    assert e.value.line == 2 and e.value.file == str(bad)
    crash = tmp_path / "crash.py"
    crash.write_text("import torch\nraise RuntimeError('at import')\n", encoding="utf-8")
    assert "RuntimeError: at import" in grade_file(crash, task="sdpa").findings[0].detail
    named = tmp_path / "named.py"  # raises while it runs: the task is read from its source, never "?"
    named.write_text(
        "raise RuntimeError('early')\ndef simple_attention(X):\n    return X\n", encoding="utf-8"
    )
    report = grade_file(named)
    assert report.task == "simple_attention" and report.lecture == "000" and report.codes == ["exception"]


def test_wrong_shape_and_unrecognised():
    assert grade(lambda q, k, v, mask=None: v.T, task="sdpa").codes == ["wrong_shape"]
    report = grade(lambda q, k, v, mask=None: torch.zeros(q.shape[0], v.shape[1]), task="sdpa")
    assert report.codes == ["unrecognised"]


def test_module_without_projections_is_not_gradable():
    class SelfAttention(torch.nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.a = torch.nn.Linear(d_in, d_out)

        def forward(self, x):
            return self.a(x)

    report = grade(SelfAttention)
    assert report.codes == ["not_gradable"] and "W_q" in report.findings[0].message


def test_an_instance_is_graded_on_a_copy():
    from selfattention.modules import SelfAttention

    layer = SelfAttention(5, 3)
    before = [p.detach().clone() for p in layer.parameters()]
    assert grade(layer, task="SelfAttention").passed  # the library's own module is correct
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters(), strict=True))


def test_fused_qkv_projection_is_found():
    module = torch.nn.Module()
    module.c_attn = torch.nn.Linear(5, 9)
    found = projections(module, 5, 3)
    x = torch.randn(2, 5)
    torch.testing.assert_close(found["v"](x), module.c_attn(x)[:, 6:9])


def test_task_detection(tmp_path):
    two = tmp_path / "two.py"
    two.write_text(
        "def simple_attention(X): return X\ndef causal_mask(a, b): return None\n", encoding="utf-8"
    )
    with pytest.raises(ValueError, match="several tasks"):
        grade_file(two)
    assert grade_file(two, task="causal").task == "causal_mask"
    with pytest.raises(ValueError, match="unknown task"):
        grade(lambda x: x, task="nope")
    assert set(TASKS) == {
        "simple_attention",
        "scaled_dot_product_attention",
        "causal_mask",
        "SelfAttention",
        "heads",
        "decode_step",
    }


def test_messages_in_chinese():
    with i18n.use_language("zh"):
        report = grade_file(GALLERY / "wrong_03_no_scale.py")
        text = str(report)
    assert report.codes == ["missing_scale"]
    assert "第 003 讲" in report.findings[0].passage and "√d_k" in report.findings[0].message
    assert re.search(r"[\u4e00-\u9fff]", report.findings[0].message)
    assert "结果" in text and report.language == "zh"


def test_quotes_are_the_lectures_words():
    """Each quote is in its lecture (LaTeX markup and ellipses aside), when the lecture texts are here."""
    seeds = Path("/work/shared/seeds")
    files = {n: next(seeds.glob(f"{n}_*.txt"), None) for n in ("000", "003")} if seeds.is_dir() else {}
    if not all(files.values()) or not files:
        pytest.skip("the lecture texts are not on this machine")
    texts = {n: _plain(f.read_text(encoding="utf-8")) for n, f in files.items()}
    for m in MISTAKES.values():
        for lecture, _section, quote in ((m.lecture, m.section, m.quote), m.other or ("", "", "")):
            for part in quote.split("…") if lecture else ():
                assert _plain(part) in texts[lecture], (m.code, part)


def _plain(text: str) -> str:
    """Text without LaTeX markup, spaces and quotation marks (the lecture writes ω_{ij} as \\omega_{ij})."""
    for tex, char in (
        (r"\omega", "ω"),
        (r"\cdot", "·"),
        (r"^\top", "ᵀ"),
        (r"\top", "ᵀ"),
        (r"\mathbf", ""),
        (r"\mathrm", ""),
        (r"\left", ""),
        (r"\right", ""),
    ):
        text = text.replace(tex, char)
    return re.sub(r"[\s${}\\“”\"]", "", text)


def test_wrap_breaks_between_cjk_characters_not_before_marks():
    from selfattention.commands.grade import wrap

    lines = wrap("  ✗ [code] " + "注意力分数没有缩放，" * 12, 40)
    assert len(lines) > 2 and all(cell_len_ok(line, 40) for line in lines)
    assert all(not line.strip().startswith("，") for line in lines)
    assert re.sub(r"\s", "", "".join(lines)) == "✗[code]" + "注意力分数没有缩放，" * 12


def cell_len_ok(line: str, width: int) -> bool:
    from rich.cells import cell_len

    return cell_len(line) <= width


def test_module_mistakes_alone_and_in_pairs():
    """Each single SelfAttention mistake is named exactly; a pair exactly, or as the one of the two that
    leaves a trace (softmax over the queries of K Qᵀ *is* the transposed weights)."""
    from selfattention.grade.attention_tasks import MODULE
    from selfattention.grade.fit import Probe

    for config in configs(MODULE.axes, 2):

        class SelfAttention(torch.nn.Module):
            def __init__(self, d_in, d_out, config=config):
                super().__init__()
                self.W_query = torch.nn.Linear(d_in, d_out, bias=False)
                self.W_key = torch.nn.Linear(d_in, d_out, bias=False)
                self.W_value = torch.nn.Linear(d_in, d_out, bias=False)
                self.config, self.d_in, self.d_out = config, d_in, d_out

            def forward(self, x):
                subject = {
                    "proj": projections(self, self.d_in, self.d_out),
                    "d_in": self.d_in,
                    "d_out": self.d_out,
                }
                return MODULE.reference(subject, self.config, Probe("", (x,))).float()

        expected = [c for axis in MODULE.axes if (c := axis.code(config[axis.name]))]
        got = grade(SelfAttention).codes
        wrong = [a for a in MODULE.axes if config[a.name] != a.default]
        if len(wrong) <= 1:
            assert got == expected, config
        else:
            assert got == expected or (got and set(got) < set(expected)), (config, got)


def test_the_package_is_callable_and_a_required_mask_gets_none():
    import selfattention

    def scaled_dot_product_attention(q, k, v, mask):  # mask without a default
        scores = q @ k.T / math.sqrt(k.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v

    report = selfattention.grade(scaled_dot_product_attention)
    assert report.passed, str(report)
    assert selfattention.grade.TASKS["decode_step"].lecture == "003"


def test_an_endless_loop_is_a_finding(monkeypatch):
    from selfattention.grade import fit

    monkeypatch.setattr(fit, "TIME_LIMIT", 0.2)

    def simple_attention(X):
        while True:
            pass

    report = grade(simple_attention)
    assert report.codes == ["exception"] and "TimeLimitExceeded" in report.findings[0].message


def test_a_constructor_that_raises_is_reported():
    class SelfAttention(torch.nn.Module):
        def __init__(self, d_in, d_out):
            raise RuntimeError("not today")

    report = grade(SelfAttention)
    assert report.codes == ["not_gradable"] and "RuntimeError: not today" in report.findings[0].message


# --- inputs changed in place ----------------------------------------------------------------------------


def test_an_input_changed_in_place_is_a_mistake_even_when_every_output_matches():
    def scaled_dot_product_attention(q, k, v, mask=None):
        q.div_(math.sqrt(q.shape[-1]))  # the caller's q changes
        s = q @ k.transpose(-2, -1)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, -1).nan_to_num(0.0) @ v

    report = grade(scaled_dot_product_attention)
    assert all(p.matches_spec for p in report.probes)
    assert report.codes == ["mutates_input"] and not report.passed
    assert "q" in report.findings[0].detail

    def simple_attention(X):
        X *= 1.0  # in place, even if the values stay
        return torch.softmax(X @ X.T, dim=-1) @ X

    assert grade(simple_attention).codes == ["mutates_input"]


def test_a_new_tensor_is_not_a_mutation():
    def scaled_dot_product_attention(q, k, v, mask=None):
        q = q / math.sqrt(q.shape[-1])
        s = q @ k.transpose(-2, -1)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, -1).nan_to_num(0.0) @ v

    assert grade(scaled_dot_product_attention).passed


# --- shape slips, half precision, the lecture of the task ------------------------------------------------


def test_code_that_raises_on_every_probe_is_explained_by_no_mistake():
    def scaled_dot_product_attention(q, k, v, mask=None):
        return undefined_name(q)  # noqa: F821 — a NameError on every probe

    report = grade(scaled_dot_product_attention)
    assert report.codes == ["exception"]
    assert "NameError" in report.findings[0].message


def test_a_shape_mutation_matches_only_shape_errors():
    """K Qᵀ cannot run where Tq ≠ Tk. Code that computes K Qᵀ but raises a TypeError of its own exactly
    there is not fitted as 'transposed_scores' (a TypeError is no shape error); with torch's own shape
    error it is."""

    def transposed(error):
        def scaled_dot_product_attention(q, k, v, mask=None):
            if q.shape[0] != k.shape[0]:
                raise error
            scores = k @ q.T / math.sqrt(q.shape[-1])
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v

        return scaled_dot_product_attention

    assert "transposed_scores" not in grade(transposed(TypeError("only square problems"))).codes
    assert grade(transposed(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))).codes == [
        "transposed_scores"
    ]


def test_missing_transpose_in_every_task():
    class SelfAttention(torch.nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.W_query = torch.nn.Linear(d_in, d_out, bias=False)
            self.W_key = torch.nn.Linear(d_in, d_out, bias=False)
            self.W_value = torch.nn.Linear(d_in, d_out, bias=False)

        def forward(self, x):
            q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
            return torch.softmax(q @ k / k.shape[-1] ** 0.5, dim=-1) @ v  # no .T

    def simple_attention(X):
        return torch.softmax(X @ X, dim=-1) @ X

    def scaled_dot_product_attention(q, k, v):  # no mask argument: the mask-less probes only
        return torch.softmax(q @ k / q.shape[-1] ** 0.5, dim=-1) @ v

    for fn in (SelfAttention, simple_attention, scaled_dot_product_attention):
        assert grade(fn).codes == ["missing_transpose"], fn
    report = grade(simple_attention)
    assert report.findings[0].lecture == "000" and "两两内积矩阵" in report.findings[0].passage
    assert grade(scaled_dot_product_attention).findings[0].lecture == "003"


def test_a_task_of_lecture_000_cites_lecture_000():
    report = grade(lambda X: (torch.softmax(X @ X.T, dim=-1) @ X)[:1], task="simple")
    assert report.codes == ["wrong_shape"]
    assert report.findings[0].lecture == "000" and "第 000 讲" not in report.findings[0].message
    assert "z_i" in report.findings[0].passage
    report = grade(lambda X: torch.softmax(X @ X.T, dim=-1) @ X + 0.5, task="simple")
    assert report.codes == ["unrecognised"] and "Z = softmax(X Xᵀ) X" in report.findings[0].passage


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_named_alone_and_beside_a_mistake(dtype):
    def right(q, k, v, mask=None):
        return attention_ref(q.to(dtype), k.to(dtype), v.to(dtype), mask)[0].to(dtype).float()

    def unscaled(q, k, v, mask=None):
        return attention_ref(q.to(dtype), k.to(dtype), v.to(dtype), mask, scale=1.0)[0].to(dtype)

    name = str(dtype).removeprefix("torch.")
    report = grade(right, task="sdpa")
    assert report.codes == ["low_precision"] and name in report.findings[0].message
    assert grade(unscaled, task="sdpa").codes == ["missing_scale", "low_precision"]


def test_a_float32_slip_of_the_same_size_is_not_half_precision():
    """Adding 1e-3 to every weight moves the outputs as much as bfloat16 rounding does (≈ 4e-3), but the
    outputs are float32 numbers: not low_precision."""

    def scaled_dot_product_attention(q, k, v, mask=None):
        s = q @ k.T / q.shape[-1] ** 0.5
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        w = torch.softmax(s, dim=-1).nan_to_num(0.0)
        return (w + 1e-3) @ v

    assert grade(scaled_dot_product_attention).codes == ["unrecognised"]


def test_a_stub_of_whole_numbers_is_not_half_precision():
    """torch.ones is a float16 number too: a stub is unrecognised, never low_precision (a breaker run)."""
    assert grade(lambda q, k, v, mask=None: torch.ones(q.shape[0], v.shape[1]), task="sdpa").codes == [
        "unrecognised"
    ]
    assert grade(lambda X: torch.ones_like(X), task="simple").codes == ["unrecognised"]
