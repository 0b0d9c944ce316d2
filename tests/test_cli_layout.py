"""The command line at 80 columns: no line wider than the terminal, names never broken, one line per
row in the compact tables, no ``<bool>`` beside flags, and text echoed as the user wrote it.

Snapshot-free: every check is a property of the output (widths measured in terminal cells, so a CJK
character counts 2), not a stored copy of it.
"""

from __future__ import annotations

import re

import pytest
from rich.cells import cell_len

from selfattention import lessons
from selfattention.cli import COMMAND_MODULES, command, main
from selfattention.commands import console
from selfattention.worked import load_example

WIDTH = 80


@pytest.fixture
def at_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))  # typer's help console
    monkeypatch.setattr(console, "width", WIDTH)  # the commands' console


def _lines(out: str) -> list[str]:
    return out.splitlines()


def _assert_fits(out: str) -> None:
    too_wide = [(cell_len(line), line) for line in _lines(out) if cell_len(line) > WIDTH]
    assert not too_wide, too_wide[:3]


def test_lesson_list_is_one_line_per_lesson_with_whole_names(at_80_columns, capsys):
    assert main(["lesson", "list"]) == 0
    out = capsys.readouterr().out
    _assert_fits(out)
    all_ = lessons.all_lessons()
    assert len(_lines(out)) <= len(all_) + 10  # a row per lesson, two titles and headers, a hint
    for lesson in all_:
        rows = [line for line in _lines(out) if lesson.name in line.split()]
        assert len(rows) == 1, lesson.name  # the whole name, on exactly one line
        assert lesson.status in rows[0]


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize(
    "argv", [["lesson", "list"], ["lesson", "list", "--long"], ["lesson", "show", "polysemy"]]
)
def test_lesson_listings_have_no_trailing_spaces(argv, lang, at_80_columns, capsys):
    """rich pads every table line to the table's width; a copied or piped listing must not carry them."""
    assert main(["--lang", lang, *argv]) == 0
    padded = [line for line in _lines(capsys.readouterr().out) if line != line.rstrip()]
    assert not padded, padded[:3]


@pytest.mark.parametrize(
    "argv", [["lesson", "list", "--long"], ["lesson", "show", "set-operation-without-positions"]]
)
def test_lesson_details_fit(argv, at_80_columns, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    _assert_fits(out)
    for lesson in lessons.all_lessons() if argv[1] == "list" else [lessons.get(argv[2])]:
        assert any(line.startswith(f"{lesson.name} — ") for line in _lines(out)), lesson.name


def test_check_tables_have_one_line_per_printed_number(at_80_columns, capsys):
    assert main(["check", "journey", "two-token"]) == 0
    out = capsys.readouterr().out
    _assert_fits(out)
    lines = _lines(out)
    # each printed number: its step, printed value, exact value and verdict on one line
    row = next(line for line in lines if line.startswith("normaliser[1]"))
    assert "17.0" in row and "16.7702" in row and "wrong" in row
    row = next(line for line in lines if line.startswith("context[0, 0]"))
    assert "1.340" in row and "1.339523" in row and "ok" in row
    row_pattern = re.compile(
        r"^[a-z_]+(\[[0-9, ]+\])? +[-0-9.]+ +[-0-9.]+ +[+-][0-9.]+ +(ok|wrong|within rounding)"
    )
    rows = [line for line in lines if row_pattern.match(line)]
    assert len(rows) == sum(len(load_example(name).printed) for name in ("journey", "two-token"))
    # a sentence too long for its column wraps onto the next lines: never cut with "…"
    texts = [n.text for name in ("journey", "two-token") for n in load_example(name).printed]
    assert not any("…" in line for line in lines if not any("…" in t for t in texts)), out
    words = " ".join(out.split())
    for text in texts:
        assert text.split()[-1] in words, text  # each sentence's end is shown


def test_demo_fits_and_names_lectures_by_title(at_80_columns, capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    _assert_fits(out)
    assert "lecture 000 · 简化自注意力" in out and "lecture 003 · 自注意力 Q/K/V" in out
    assert ".txt" not in out
    assert "context vector of “journey”" in out  # the token as written, no Python quoting


def test_every_help_fits_and_shows_no_bool_metavar(at_80_columns, capsys):
    root = command()
    names = [[]] + [[name] for name in root.commands]
    names += [["lesson", sub] for sub in root.commands["lesson"].commands]
    assert len(names) >= len(COMMAND_MODULES) + 1
    for argv in names:
        assert main([*argv, "--help"]) == 0, argv
        out = capsys.readouterr().out
        _assert_fits(out)
        assert "<bool>" not in out and "[default: False]" not in out, argv
        assert "--help" in out


def test_version(capsys):
    from selfattention import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"selfattention {__version__}"


def test_generate_echoes_the_prompt_as_written(tmp_path, at_80_columns, capsys):
    from selfattention.decoder import CharTokenizer, save_checkpoint

    from .test_decoder import _tiny

    tok = CharTokenizer("abcdefghij'\\¯_(ツ)/")
    model = _tiny(seed=1, vocab_size=tok.vocab_size)
    path, _ = save_checkpoint(model, tok, tmp_path / "m.safetensors")
    prompt = "can't ¯\\_(ツ)_/¯"
    prompt = "".join(c for c in prompt if c in tok.chars)
    assert main(["generate", "--checkpoint", str(path), "-p", prompt, "-n", "3"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(prompt)


@pytest.mark.parametrize(
    "argv",
    [["demo"], ["check", "journey", "two-token"], ["lesson", "list"], ["lesson", "show", "n-squared-bill"]],
)
def test_chinese_output_fits_80_columns(at_80_columns, capsys, argv):
    """Chinese characters take two columns each: the tables and wrapped lines must still fit."""
    assert main(["--lang", "zh", *argv]) == 0
    out = capsys.readouterr().out
    _assert_fits(out)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in out)


def test_every_chinese_help_fits(at_80_columns, capsys):
    root = command()
    names = [[]] + [[name] for name in root.commands]
    names += [["lesson", sub] for sub in root.commands["lesson"].commands]
    for argv in names:
        assert main(["--lang", "zh", *argv, "--help"]) == 0, argv
        out = capsys.readouterr().out
        _assert_fits(out)
        assert "显示此帮助信息并退出" in out, argv


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_table_fits_and_shows_each_ranks_positions_as_runs(at_80_columns, capsys, layout):
    from selfattention.distributed import sequence_positions

    argv = ["ring", "-n", "2", "--seq-len", "10", "--heads", "1", "--head-dim", "4", "--layout", layout]
    assert main(argv) == 0
    out = capsys.readouterr().out
    _assert_fits(out)
    assert "positions" in out and "positio…" not in out  # the one-word header is never truncated
    cells = re.sub(r"[│┃\s]+", " ", out)
    for rank in range(2):
        pos = sorted(sequence_positions(10, 2, rank, layout).tolist())
        # independent of the command's formatting code: split the positions where they jump
        cuts = [i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1]
        runs = [pos[a:b] for a, b in zip([0, *cuts], [*cuts, len(pos)], strict=True)]
        want = ", ".join(f"{r[0]}–{r[-1]}" for r in runs)
        assert want in cells, (want, out)


@pytest.mark.parametrize("argv", [["check"], ["explain"], ["report"], ["lesson", "run"], ["lesson", "show"]])
def test_usage_lines_name_arguments_in_upper_case(at_80_columns, capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        command().main([*argv, "--help"], prog_name="selfattention")
    assert exit_.value.code == 0
    usage = next(line for line in capsys.readouterr().out.splitlines() if "Usage:" in line)
    placeholders = re.findall(r"[{\[]([A-Za-z_]+)[}\]]", usage.split("[OPTIONS]", 1)[1])
    assert placeholders and all(p.isupper() for p in placeholders), usage
