"""Worked examples, the checker and the demo/check commands."""

from __future__ import annotations

import importlib
import math

import pytest

from selfattention import cli
from selfattention.worked import WorkedExampleError, classify, list_examples, load_example


def test_shipped_examples_are_listed():
    assert list_examples() == ["journey", "two-token"]


def test_journey_checker_catches_the_lectures_wrong_weights():
    results = {(r.number.step, r.number.at): r for r in load_example("journey").check()}
    # exact values computed by hand from the lecture's inputs, in float64
    s = [0.55 * 0.43 + 0.87 * 0.15 + 0.66 * 0.89 + 0.58 * 0.55, 0.55**2 + 0.87**2 + 0.66**2 + 0.58**2]
    s.append(0.55 * 0.57 + 0.87 * 0.85 + 0.66 * 0.64 + 0.58 * 0.80)
    z = sum(math.exp(v) for v in s)
    assert results[("normaliser", (1,))].exact == pytest.approx(z, abs=1e-12)
    for j in range(3):
        assert results[("weights", (1, j))].exact == pytest.approx(math.exp(s[j]) / z, abs=1e-12)
    assert results[("scores", (1, 0))].status == "ok"
    assert results[("weights", (1, 0))].status == "ok"  # 0.21 vs 0.2131
    assert results[("weights", (1, 1))].status == "wrong"  # 0.36 vs 0.3722
    assert results[("weights", (1, 2))].status == "wrong"  # 0.43 vs 0.4147
    assert results[("normaliser", (1,))].status == "wrong"  # 17.0 vs 16.77


def test_two_token_example_all_right():
    results = load_example("two-token").check()
    assert len(results) == 17
    assert all(r.status == "ok" for r in results), [
        (r.number.text, r.exact) for r in results if r.status != "ok"
    ]


def test_classify_boundaries():
    assert classify(0.670, 0.66976, 3) == "ok"
    assert classify(0.669, 0.66976, 3) == "within rounding"  # 0.76 units off
    assert classify(0.671, 0.66976, 3) == "wrong"  # 1.24 units off
    assert classify(17.0, 16.77, 1) == "wrong"


USER_FILE = """
title = "my example"
kind = "qkv"
tokens = ["a", "b"]
inputs = [[1.0, 0.0], [0.0, 1.0]]
W_query = [[1.0, 0.0], [0.0, 1.0]]
W_key = [[1.0, 0.0], [0.0, 1.0]]
W_value = [[3.0, 0.0], [0.0, 3.0]]

[[printed]]
step = "context"
at = [0, 0]
value = "2.009"
text = "right: 3 x 0.66976 = 2.00928"

[[printed]]
step = "context"
at = [0, 1]
value = "0.990"
text = "within rounding: exact 0.99072"

[[printed]]
step = "weights"
at = [1, 1]
value = "0.5"
text = "wrong"
"""


def test_user_file_right_within_rounding_and_wrong(tmp_path):
    f = tmp_path / "ex.toml"
    f.write_text(USER_FILE, encoding="utf-8")
    statuses = [r.status for r in load_example(f).check()]
    assert statuses == ["ok", "within rounding", "wrong"]


@pytest.mark.parametrize(
    "text,needle",
    [
        ("title = [", "malformed TOML"),
        ('kind = "simple"', "missing field 'inputs'"),
        ("inputs = [[1.0, 2.0], [3.0]]", "different lengths"),
        ('inputs = [[1.0]]\n[[printed]]\nstep = "weights"\nat = [0, 0]', "missing 'value'"),
        ('inputs = [[1.0]]\n[[printed]]\nstep = "wieghts"\nvalue = "1"', "step must be one of"),
        ('inputs = [[1.0]]\n[[printed]]\nstep = "weights"\nat = [0, 0]\nvalue = 0.5', "needs 'decimals'"),
        ('inputs = [[1.0]]\n[[printed]]\nstep = "weights"\nat = [0]\nvalue = "1"', "needs 'at' with 2"),
        (
            'kind = "qkv"\ninputs = [[1.0, 0.0]]\nW_query = [[1.0]]\nW_key = [[1.0]]\nW_value = [[1.0]]',
            "has 1 rows",
        ),
        ("inputs = [[1.0]]\nscael = 0.5", "unknown key 'scael' \\(did you mean 'scale'\\?\\)"),
        (
            'inputs = [[1.0]]\n[[printed]]\nstep = "weights"\nat = [0, 0]\nvalue = "1"\ntxt = "a"',
            "unknown key 'txt'",
        ),
    ],
)
def test_malformed_files_give_clear_errors(tmp_path, text, needle):
    f = tmp_path / "bad.toml"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(WorkedExampleError, match=needle):
        load_example(f)


def test_index_out_of_range_is_reported(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text(
        'inputs = [[1.0]]\n[[printed]]\nstep = "weights"\nat = [3, 0]\nvalue = "1"', encoding="utf-8"
    )
    with pytest.raises(WorkedExampleError, match="out of range"):
        load_example(f).check()


def test_every_registered_command_module_loads():
    for name in cli.COMMAND_MODULES:
        importlib.import_module(f"selfattention.commands.{name}")


def test_demo_command_prints_steps_and_flags(capsys):
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "0.3722" in out and "16.7702" in out and "1.3395" in out
    assert "3 of 7 printed numbers are wrong" in out
    assert "all 17 printed numbers check out" in out


def test_check_command_on_user_file_and_errors(tmp_path, capsys):
    f = tmp_path / "ex.toml"
    f.write_text(USER_FILE, encoding="utf-8")
    assert cli.main(["check", str(f)]) == 0
    assert "1 wrong" in capsys.readouterr().out
    assert cli.main(["check", "--strict", str(f)]) == 1
    bad = tmp_path / "bad.toml"
    bad.write_text("title = [", encoding="utf-8")
    assert cli.main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "malformed TOML" in err and "Traceback" not in err
    assert cli.main(["check", str(tmp_path / "missing.toml")]) == 2


def test_markup_in_user_text_is_shown_verbatim(tmp_path, capsys):
    f = tmp_path / "m.toml"
    f.write_text(
        'kind = "simple"\ntokens = ["[b]", "x"]\ninputs = [[1.0, 0.0], [0.0, 1.0]]\n'
        '[[printed]]\nstep = "weights"\nat = [0, 0]\nvalue = "0.73"\ntext = "[bold red]hi[/]"\n',
        encoding="utf-8",
    )
    assert cli.main(["check", str(f)]) == 0
    out = capsys.readouterr().out
    assert "[bold red]hi[/]" in out and "[b]" in out
    bad = tmp_path / "bad.toml"
    bad.write_text('inputs = [[1.0]]\n[[printed]]\nstep = "weights"\nat = [0]\nvalue = "1"', encoding="utf-8")
    assert cli.main(["check", str(bad)]) == 2
    assert "[[printed]] entry 1" in capsys.readouterr().err.replace("\n", " ")


def test_overflowing_inputs_and_bad_decimals_are_refused(tmp_path, capsys):
    f = tmp_path / "o.toml"
    f.write_text(
        'kind = "simple"\ninputs = [[1e300, 0.0], [0.0, 1e300]]\n[[printed]]\nstep = "context"\nat = [0, 0]\n'
        'value = "1.0"\n',
        encoding="utf-8",
    )
    assert cli.main(["check", str(f)]) == 2
    captured = capsys.readouterr()
    assert "not finite" in captured.err and captured.out == ""
    assert cli.main(["check", "journey", "--decimals", "-1"]) == 2
