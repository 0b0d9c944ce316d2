"""What a new user meets first: bad paths and names refused at once and clearly, timings that say when the
machine was too noisy, install instructions that match what `make test` prints."""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path

import pytest

from selfattention import i18n
from selfattention.cli import main
from selfattention.commands import timing

ROOT = Path(__file__).resolve().parents[1]


def _run(argv, capsys) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, " ".join(captured.err.split())


# ------------------------------------------------------------------------------ report --out, at once


@pytest.mark.parametrize("name", ["x.txt", "report", "page.html.bak"])
def test_report_out_must_be_html(tmp_path, capsys, name):
    t0 = time.perf_counter()
    code, err = _run(["report", "hello", "--out", str(tmp_path / name)], capsys)
    assert code == 2 and "--out" in err and ".html" in err and name in err, err
    assert time.perf_counter() - t0 < 5  # refused before any model is loaded
    assert not (tmp_path / name).exists()


def test_report_out_in_a_folder_that_cannot_exist(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code, err = _run(["report", "hello", "--out", str(blocker / "sub" / "r.html")], capsys)
    assert code == 2 and "--out" in err and "r.html" in err and "Errno" not in err, err


def test_report_out_refused_in_chinese(tmp_path, capsys):
    code, err = _run(["--lang", "zh", "report", "hello", "--out", str(tmp_path / "x.txt")], capsys)
    assert code == 2 and "错误：--out" in err and "以 .html 结尾" in err, err


# ---------------------------------------------------------------------------------------- --model


def test_a_misspelt_model_name_gets_a_suggestion(capsys):
    code, err = _run(["explain", "--model", "m3e-smal"], capsys)
    assert code == 2 and "m3e-smal" in err and "did you mean m3e-small?" in err, err
    code, err = _run(["--lang", "zh", "report", "hi", "--model", "m3e-smal"], capsys)
    assert code == 2 and "是不是想用 m3e-small" in err, err


def test_a_far_name_gets_no_suggestion(tmp_path, capsys):
    code, err = _run(["explain", "--model", str(tmp_path / "nothing-here")], capsys)
    assert code == 2 and "is not a folder" in err and "did you mean" not in err, err


@pytest.mark.parametrize("text", ["{oops", "", "[1, 2]"])
def test_a_broken_config_json_is_named(tmp_path, capsys, text):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(text, encoding="utf-8")
    for cmd in (["explain", "--model", str(folder)], ["report", "hi", "--model", str(folder)]):
        code, err = _run(cmd, capsys)
        assert code == 2 and str(folder / "config.json") in err and "JSON" in err, (cmd, err)
        assert "Traceback" not in err


# ---------------------------------------------------------------------------- generate --check timing


def _fake(times):
    it = iter(times)
    return lambda: ("tokens", next(it))


def test_interleaved_runs_alternate_and_give_the_median():
    order = []

    def run(name, secs):
        def f():
            order.append(name)
            return name, next(secs)

        return f

    a = iter([1.0, 1.2, 0.8, 1.0, 1.0])
    b = iter([3.0, 3.0, 3.3, 2.5, 3.0])
    c = timing.compare(run("a", a), run("b", b), rounds=5)
    assert order == ["a", "b"] * 5  # interleaved, never all of one then all of the other
    assert c.ratios == pytest.approx([3.0, 2.5, 4.125, 2.5, 3.0])
    assert c.median_ratio == pytest.approx(3.0) and not c.noisy
    assert c.median_seconds() == (1.0, 3.0)


def test_the_issue_s_busy_machine_is_called_noisy():
    """The issue's run: cached 8.3 s, recomputed 1.0 s once, the other pairs the usual way round."""
    firsts = itertools.chain([8.3, 1.0, 1.1])
    seconds = itertools.chain([1.0, 3.7, 3.9])
    c = timing.compare(_fake(firsts), _fake(seconds), rounds=3)
    assert c.noisy
    from selfattention.commands.generate import _timing_verdict

    line = _timing_verdict(c)
    assert "too noisy" in line and "0.1× to 3.7×" in line and "3 interleaved pairs" in line
    with i18n.use_language("zh"):
        assert "负载波动太大" in _timing_verdict(c)
    steady = timing.compare(_fake([1.0, 1.1, 0.9]), _fake([3.6, 3.9, 3.4]), rounds=3)
    line = _timing_verdict(steady)
    assert "3.6× the time of the cached run" in line and "median of 3 interleaved pairs" in line


def test_a_time_budget_stops_the_pairs_and_the_verdict_says_so():
    """The new user's busy machine: 74 s cached, 111 s recomputed; a 60 s budget stops after one pair."""
    seen = []
    c = timing.compare(
        _fake([73.9, 70.0, 70.0]),
        _fake([111.2, 100.0, 100.0]),
        rounds=3,
        budget_s=60,
        on_run=lambda n, which, secs: seen.append((n, which, secs)),
    )
    assert c.cut_short and c.rounds == 1 and seen == [(1, 0, 73.9), (1, 1, 111.2)]
    from selfattention.commands.generate import _timing_verdict

    line = _timing_verdict(c)
    assert "too busy to compare their speed" in line and "after 1 of 3 interleaved pairs (185 s" in line
    with i18n.use_language("zh"):
        assert "机器太忙" in _timing_verdict(c) and "too busy" not in _timing_verdict(c)
    quick = timing.compare(_fake([1.0, 1.1, 0.9]), _fake([3.6, 3.9, 3.4]), rounds=3, budget_s=60)
    assert quick.rounds == 3 and not quick.cut_short
    with pytest.raises(ValueError, match="budget_s must be > 0"):
        timing.compare(_fake([]), _fake([]), budget_s=0)


def test_the_batched_check_is_interleaved_and_says_when_the_machine_was_too_busy():
    """A new user's busy machine: the batch 0.25 s once and 15 s once, the prompts alone 0.75 s: one
    comparison of a batch and its runs alone claimed the runs alone took 0.3× the batch's time."""
    from selfattention.commands.generate import _batch_verdict

    c = timing.compare(_fake([15.2, 0.26, 0.25]), _fake([4.6, 0.74, 0.78]), rounds=3)
    line = _batch_verdict(c, 3)
    assert "too busy to compare their speed" in line and "0.3× to 3.1× over 3 interleaved pairs" in line
    with i18n.use_language("zh"):
        assert "机器太忙" in _batch_verdict(c, 3)
    steady = timing.compare(_fake([0.25, 0.26, 0.24]), _fake([0.75, 0.80, 0.70]), rounds=3)
    line = _batch_verdict(steady, 3)
    assert "the 3 runs alone took 3.0× the time of the batch (median of 3 interleaved pairs" in line


def test_generate_check_prints_a_line_per_timed_run(tmp_path, capsys):
    import torch

    from selfattention.decoder import CharTokenizer, Decoder, DecoderConfig, save_checkpoint

    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=13, context=48, d_model=24, num_heads=4, num_layers=2)).eval()
    path, _ = save_checkpoint(model, CharTokenizer("abcdefghijkl "), tmp_path / "m.safetensors")
    assert main(["generate", "-p", "abc", "-n", "5", "--check", "--checkpoint", str(path)]) == 0
    got = capsys.readouterr()
    assert "timing up to 3 pairs" in got.err
    for n in (1, 2, 3):
        assert f"pair {n}/3: cached run" in got.err and f"pair {n}/3: recomputed run" in got.err
    assert "PASS: identical tokens" in got.out and "pair 1/3" not in got.out


def test_rounds_must_be_positive():
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        timing.compare(_fake([]), _fake([]), rounds=0)


# -------------------------------------------------------------------------------------- the README


def test_readme_skip_counts_are_the_test_files_own():
    """The README says how many tests `make test` skips without `make zh` and why: counted here from the
    skip conditions of the test files (a skip mark's reason), per reason, so a new gated test changes it."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    m = re.search(
        r"`make test` skips the (\d+) tests that need m3e-small and the (\d+) that need the font package; "
        r"on a machine with no CJK font at all[^,]*, (\d+) more",
        readme,
    )
    assert m, "the README no longer says how many tests skip without make zh"
    said = tuple(int(g) for g in m.groups())
    needles = ("needs the m3e-small model", "needs paperang-p2-fonts-cjk", "no CJK font")
    files = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "tests").glob("test_*.py"))]
    counted = tuple(sum(_gated(f, needle) for f in files) for needle in needles)
    assert counted == said, (
        f"README says {said} (m3e, font package, any CJK font); the test files gate {counted}"
    )


def _cases(func) -> int:
    import ast

    cases = 1
    for d in func.decorator_list:
        if isinstance(d, ast.Call) and ast.unparse(d.func).endswith("parametrize") and len(d.args) > 1:
            if isinstance(d.args[1], ast.List | ast.Tuple):
                cases *= len(d.args[1].elts)
    return cases


def _gated(source: str, needle: str) -> int:
    """Tests of a file that a skip mark whose reason holds ``needle`` skips: every test of the module for
    a module-level ``pytestmark``, else each test carrying such a mark (directly or by a name given to
    it), parametrized cases counted."""
    import ast

    tree = ast.parse(source)
    tests = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    named = set()
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and needle in ast.unparse(node.value)
            and "skip" in ast.unparse(node.value)
        ):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if "pytestmark" in names:
                return sum(map(_cases, tests))
            named |= names
    return sum(
        _cases(t)
        for t in tests
        if any(
            (needle in ast.unparse(d) and "skip" in ast.unparse(d)) or ast.unparse(d) in named
            for d in t.decorator_list
        )
    )


# ------------------------------------------------------------------------------------ bench --quick


def _bench_result() -> dict:
    """A result shaped as ``run_bench`` returns it (the quick configuration's cases, made-up times)."""
    rows = []
    cases = [(t, v, p) for t in (128, 256) for v in ("dense", "causal") for p in ("fwd", "fwd+bwd")]
    cases += [(512, v, p) for v in ("window", "documents") for p in ("fwd", "fwd+bwd")] + [
        (256, "stats", "fwd")
    ]
    for i, (t, variant, pss) in enumerate(cases):
        base = {"t": t, "heads": 2, "variant": variant, "pass": pss}
        rows.append({**base, "impl": "sdpa", "median_s": 0.0123 * (i + 1)})
        rows.append({**base, "impl": "flex", "median_s": 1.5 + i})
        rows.append(
            {
                **base,
                "impl": "tiled",
                "median_s": 0.0231 * (i + 1),
                "ratio_vs_sdpa": 1.88,
                "ratio_vs_flex": 0.01,
            }
        )
    return {"rows": rows, "meta": {"config": {"window": 32, "documents": 8}}}


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_bench_summary_fits_80_columns(monkeypatch, lang):
    from rich.cells import cell_len
    from rich.console import Console

    from selfattention.commands.bench import summary_table

    term = Console(width=80, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    with i18n.use_language(lang):
        term.print(summary_table(_bench_result()))
    lines = term.export_text().splitlines()
    assert lines and max(cell_len(line) for line in lines) <= 80, lines
    assert len(lines) == 1 + 13  # a header and a line per case: nothing wrapped
    assert not any("…" in line for line in lines)
    assert any("window 32" in line or "窗口 32" in line for line in lines)
    assert any("8 documents" in line or "8 个文档" in line for line in lines)


def test_bench_quick_help_says_how_long(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["bench", "--help"]) == 0
    words = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "about 30 s of CPU time" in words and "the run prints how long it took" in words


def test_report_link_is_percent_encoded(tmp_path, capsys):
    """The printed ``file://`` link of a page in a folder with a space: terminals cut a raw link at the
    space (CLI breaker run)."""
    out = tmp_path / "my reports" / "r.html"
    out.parent.mkdir()
    assert main(["report", "--example", "two-token", "--out", str(out)]) == 0
    text = "".join(capsys.readouterr().out.split())  # rich may wrap the long line
    assert out.as_uri() in text and "my%20reports" in text
