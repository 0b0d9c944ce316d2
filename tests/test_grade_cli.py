"""The ``selfattention grade`` command: English and Chinese text, 80 columns with nothing cut, exit codes,
the JSON report's schema, the help's warning that the file is executed, and the README's real output."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from selfattention import i18n
from selfattention.cli import main
from selfattention.grade import MISTAKES, grade_file

GALLERY = Path(__file__).parent / "grade_gallery"


# --- the command line -----------------------------------------------------------------------------------


def test_cli_english_exit_codes(capsys):
    assert main(["grade", str(GALLERY / "right_01_loops.py")]) == 0
    assert "result: correct" in capsys.readouterr().out
    assert main(["grade", str(GALLERY / "wrong_20_scale_and_nan.py")]) == 1
    out = capsys.readouterr().out
    assert "[missing_scale]" in out and "[masked_row_nan]" in out and "2 mistakes found" in out
    assert "lecture 003" in out and "缩放：一个工程修正" in out


def test_cli_chinese(capsys):
    assert main(["--lang", "zh", "grade", str(GALLERY / "wrong_02_scale_d_model.py")]) == 1
    out = capsys.readouterr().out
    assert "[scale_d_model]" in out and "第 003 讲" in out
    assert "The scores" not in out and "result:" not in out


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_cli_syntax_error_is_a_usage_error_naming_line_and_column(lang, tmp_path, capsys):
    bad = tmp_path / "syntax.py"
    bad.write_text("import torch\n\ndef simple_attention(X)\n    return X\n", encoding="utf-8")
    assert main(["--lang", lang, "grade", str(bad)]) == 2
    got = capsys.readouterr()
    assert "?" not in got.out and "0 of 0" not in got.out and "expects" not in got.out
    assert str(bad) in got.err and "3" in got.err and "24" in got.err and "expected ':'" in got.err
    if lang == "zh":
        flat = " ".join(got.err.split())  # rich wraps at 80 columns: a long tmp path moves the break
        assert "第 3 行" in flat and "not valid" not in flat
    assert main(["--lang", lang, "grade", "--json", "-", str(bad)]) == 2
    data = json.loads(capsys.readouterr().out)
    assert (data["file"], data["line"], data["column"], data["message"]) == (str(bad), 3, 24, "expected ':'")
    assert str(bad) in data["error"] and "task" not in data


def test_cli_usage_errors(tmp_path, capsys):
    assert main(["grade", str(tmp_path / "missing.py")]) == 2
    assert main(["grade", str(GALLERY / "right_01_loops.py"), "--task", "nope"]) == 2
    txt = tmp_path / "a.txt"
    txt.write_text("x", encoding="utf-8")
    assert main(["grade", str(txt)]) == 2
    none = tmp_path / "none.py"
    none.write_text("x = 1\n", encoding="utf-8")
    assert main(["grade", str(none)]) == 2
    assert main(["grade", str(GALLERY / "right_01_loops.py"), "--json", str(tmp_path / "no" / "r.json")]) == 2
    err = capsys.readouterr().err
    assert "missing.py" in err and "nope" in err


def _check_schema(data: dict) -> None:
    assert set(data) >= {"schema", "task", "passed", "findings", "probes", "language", "file"}
    assert isinstance(data["passed"], bool)
    for f in data["findings"]:
        assert set(f) == {"code", "message", "lecture", "passage", "note", "detail"}
        assert f["code"] in MISTAKES
    for p in data["probes"]:
        assert set(p) == {"name", "matches_spec", "raised", "max_error"}


def test_cli_json_stdout_and_file(tmp_path, capsys):
    noisy = tmp_path / "noisy.py"
    noisy.write_text(
        (GALLERY / "wrong_06_masked_row_nan.py").read_text(encoding="utf-8")
        + "\nprint('hello from the learner')\n",
        encoding="utf-8",
    )
    assert main(["grade", str(noisy), "--json", "-"]) == 1
    data = json.loads(capsys.readouterr().out)  # the learner's print went to stderr
    _check_schema(data)
    assert data["task"] == "scaled_dot_product_attention" and not data["passed"]
    assert [f["code"] for f in data["findings"]] == ["masked_row_nan"]
    assert data["findings"][0]["lecture"] == "003"
    path = tmp_path / "r.json"
    assert main(["--lang", "zh", "grade", str(GALLERY / "right_04_numpy.py"), "--json", str(path)]) == 0
    data = json.loads(path.read_text(encoding="utf-8"))
    _check_schema(data)
    assert data["passed"] and data["findings"] == [] and data["language"] == "zh"
    assert all(p["matches_spec"] for p in data["probes"])


def test_cli_help_says_it_runs_the_code(capsys):
    assert main(["grade", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "RUNS the code" in out and "trust" in out


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize(
    "name", ["wrong_09_causal_triu.py", "wrong_20_scale_and_nan.py", "wrong_15_cache_shifted.py"]
)
def test_cli_output_fits_80_columns_and_loses_nothing(lang, name, monkeypatch, capsys):
    from rich.cells import cell_len

    from selfattention.commands import console

    monkeypatch.setattr(console, "width", 80)
    assert main(["--lang", lang, "grade", str(GALLERY / name)]) == 1
    out = capsys.readouterr().out
    assert all(cell_len(line) <= 80 for line in out.splitlines()), out
    with i18n.use_language(lang):
        report = grade_file(GALLERY / name)
    flat = re.sub(r"\s", "", out)
    for finding in report.findings:  # every word of every message is printed, in order, none cut
        assert re.sub(r"\s", "", finding.message) in flat
        assert re.sub(r"\s", "", finding.passage) in flat
    # Chinese lines never start with a full-width closing mark
    assert not [line for line in out.splitlines() if line.strip()[:1] in set("，。、；：？！）」”")]


def _readme_blocks() -> list[str]:
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Grade your own attention code", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```(?:python)?\n(.*?)```", section, re.S)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_readme_shows_the_real_output(lang, tmp_path, monkeypatch, capsys):
    from selfattention.commands import console

    code, english, chinese = _readme_blocks()
    (tmp_path / "mine.py").write_text(code, encoding="utf-8")
    monkeypatch.setattr(console, "width", 80)
    monkeypatch.chdir(tmp_path)
    assert main(["--lang", lang, "grade", "mine.py"]) == 1
    out = capsys.readouterr().out
    if lang == "en":
        assert out == english
    else:  # lines taken from the output, in order
        lines = out.splitlines()
        positions = [lines.index(line) for line in chinese.splitlines()]
        assert positions == sorted(positions)


def test_cli_json_reports_a_file_without_a_task_as_json(tmp_path, capsys):
    """``grade --json -`` on a file with no task's name printed plain text while a syntax error gives a
    JSON object (CLI breaker run): an autograder reads one format."""
    empty = tmp_path / "empty.py"
    empty.write_text("", encoding="utf-8")
    assert main(["grade", "--json", "-", str(empty)]) == 2
    payload = json.loads(capsys.readouterr().out)
    assert "defines none of the tasks' names" in payload["error"] and payload["file"] == str(empty)
