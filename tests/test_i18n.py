"""The Chinese interface: gettext catalogs complete and compiled, ``--lang`` and the locale.

The catalog check extracts the messages with Babel's own API (as ``make i18n`` does) from the package
source, so a message marked with ``_()``/``N_()``/``ngettext`` that has no Chinese translation, a fuzzy
one, a translation that drops or renames a ``{placeholder}``, or a ``.mo`` older than its ``.po`` fails.
"""

from __future__ import annotations

import ast
import io
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest

from selfattention import i18n
from selfattention.cli import main

babel = pytest.importorskip("babel", reason="Babel (the dev extra) extracts and compiles the catalogs")
from babel.messages.extract import DEFAULT_KEYWORDS, extract_from_dir  # noqa: E402
from babel.messages.mofile import write_mo  # noqa: E402
from babel.messages.pofile import read_po  # noqa: E402

PKG = Path(i18n.__file__).parent
PO = PKG / "locale" / "zh" / "LC_MESSAGES" / "selfattention.po"
MO = PO.with_suffix(".mo")


def _extracted() -> dict[str, str]:
    """msgid → the file it is in, for every message marked in the package (Babel's python extractor)."""
    found = {}
    for filename, _lineno, message, _comments, _context in extract_from_dir(
        str(PKG), method_map=[("**.py", "python")], keywords=DEFAULT_KEYWORDS
    ):
        msgid = message[0] if isinstance(message, tuple) else message
        found.setdefault(msgid, filename)
    return found


def _catalog():
    with open(PO, "rb") as f:
        return read_po(f, locale="zh")


def _fields(template: str) -> list[tuple[str, str]]:
    """The placeholders of a str.format template: (name, format spec), sorted."""
    return sorted(
        (name, spec or "")
        for _text, name, spec, _conv in string.Formatter().parse(template)
        if name is not None
    )


def test_extraction_finds_the_marked_messages():
    found = _extracted()
    # one message from each kind of place: a help text, an error, a table header, a verdict word
    for msgid in (
        "Print the version and exit.",
        "--decimals must be between 0 and 12, got {value}",
        "verdict",
    ):
        assert msgid in found
    assert len(found) > 40


def test_every_message_has_a_chinese_translation():
    catalog = _catalog()
    problems = []
    for msgid, where in sorted(_extracted().items()):
        entry = catalog.get(msgid)
        if entry is None:
            problems.append(f"{where}: not in the catalog (run `make i18n`): {msgid!r}")
            continue
        forms = entry.string if isinstance(entry.string, tuple) else (entry.string,)
        if not all(forms):
            problems.append(f"{where}: no translation: {msgid!r}")
        elif entry.fuzzy:
            problems.append(f"{where}: fuzzy translation: {msgid!r}")
    assert not problems, "\n".join(problems)


def test_translations_keep_every_placeholder():
    problems = []
    for entry in _catalog():
        if not entry.id:
            continue
        ids = entry.id if isinstance(entry.id, tuple) else (entry.id,)
        forms = entry.string if isinstance(entry.string, tuple) else (entry.string,)
        for form in forms:
            if form and _fields(form) != _fields(ids[-1]):
                problems.append(f"{ids[0]!r}: {_fields(ids[-1])} vs {_fields(form)} in {form!r}")
    assert not problems, "\n".join(problems)


def test_catalog_has_no_stale_messages():
    """Every catalog entry is still used: a message changed in the code must be re-extracted."""
    found = _extracted()
    stale = [e.id for e in _catalog() if e.id and (e.id[0] if isinstance(e.id, tuple) else e.id) not in found]
    assert not stale, f"run `make i18n`: no longer in the code: {stale}"


def test_compiled_catalog_is_up_to_date():
    assert MO.is_file(), "the compiled catalog is missing: run `make i18n`"
    buf = io.BytesIO()
    write_mo(buf, _catalog())
    assert MO.read_bytes() == buf.getvalue(), "the .mo is older than the .po: run `make i18n`"


def test_language_from_the_locale():
    assert i18n.language_from_env({}) == "en"
    assert i18n.language_from_env({"LANG": "zh_CN.UTF-8"}) == "zh"
    assert i18n.language_from_env({"LC_MESSAGES": "zh_TW", "LANG": "en_US.UTF-8"}) == "zh"
    assert i18n.language_from_env({"LC_ALL": "en_GB.UTF-8", "LANG": "zh_CN.UTF-8"}) == "en"
    assert i18n.language_from_env({"LANGUAGE": "de:en", "LANG": "zh_CN.UTF-8"}) == "en"
    assert i18n.language_from_env({"LANG": "fr_FR.UTF-8"}) == "en"  # no French catalog
    assert i18n.language_from_env({"LANG": "POSIX"}) == "en"


def test_set_language_refuses_unknown_languages():
    with pytest.raises(ValueError, match=r"--lang must be one of en, zh, got 'xx'"):
        i18n.set_language("xx")
    assert i18n.language() == "en"


def test_gettext_switches_and_restores():
    with i18n.use_language("zh"):
        assert i18n._("verdict") == "结论"
        assert "{total}" in i18n.ngettext(
            "the {total} printed number checks out", "all {total} printed numbers check out", 2
        )
    assert i18n._("verdict") == "verdict"


# -------------------------------------------------------------------------------------------- the CLI

_CHINESE_DEMO = ["注意力分数", "注意力权重", "上下文向量", "重新计算讲义给出的每个数", "结论"]
_ENGLISH_DEMO = [
    "every number the text prints",
    "verdict",
    "context vector of",
    "weights α",
    "what the text says",
]


def test_chinese_locale_demo_speaks_chinese(monkeypatch, capsys):
    monkeypatch.setenv("LANG", "zh_CN.UTF-8")
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for text in _CHINESE_DEMO:
        assert text in out, text
    for text in _ENGLISH_DEMO:
        assert text not in out, text


def test_lang_en_overrides_a_chinese_locale(monkeypatch, capsys):
    monkeypatch.setenv("LC_ALL", "zh_CN.UTF-8")
    assert main(["--lang", "en", "demo"]) == 0
    out = capsys.readouterr().out
    for text in _ENGLISH_DEMO:
        assert text in out, text
    assert not any(text in out for text in _CHINESE_DEMO)


def test_lang_zh_on_an_english_locale(monkeypatch, capsys):
    monkeypatch.setenv("LANG", "en_US.UTF-8")
    assert main(["--lang=zh", "demo", "--example", "two-token"]) == 0
    assert "注意力权重" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["demo", "--lang", "zh"], ["demo", "--example", "two-token", "--lang=zh"]])
def test_lang_after_the_command_is_honoured(monkeypatch, capsys, args):
    """``selfattention demo --lang zh`` (the option given after the command) works as ``--lang zh demo``."""
    monkeypatch.setenv("LANG", "en_US.UTF-8")
    assert main(args) == 0
    assert "注意力权重" in capsys.readouterr().out


def test_two_token_notes_follow_the_language(monkeypatch, capsys):
    """The example's own note beside the printed 1/√2 (text / text_zh in two-token.toml) is translated."""

    def joined(text):  # the note may wrap inside its table cell
        return "".join(text.split())

    assert main(["--lang", "zh", "demo", "--example", "two-token"]) == 0
    out = joined(capsys.readouterr().out)
    assert joined("（讲义写作 √2 ≈ 1.414）") in out and "lectureprints" not in out
    assert main(["--lang", "en", "demo", "--example", "two-token"]) == 0
    assert joined("(the lecture prints √2 ≈ 1.414)") in joined(capsys.readouterr().out)


def test_lang_alone_shows_the_help(capsys):
    assert main(["--lang", "zh"]) == 0
    assert "按讲义实现的自注意力" in capsys.readouterr().out


def test_unknown_lang_is_a_clear_error(capsys):
    assert main(["--lang", "xx", "demo"]) == 2
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert "'xx'" in err and "en, zh" in err and "--lang" in err
    assert "Traceback" not in err and captured.out == ""


@pytest.mark.parametrize("value", ["ZH", "zh_CN", "zh-Hans", "Zh"])
def test_lang_takes_the_locale_spellings(capsys, value):
    """``--lang zh_CN`` or ``ZH`` (the locale's spellings) mean zh; they were refused (CLI breaker run)."""
    for argv in (["--lang", value, "lesson", "list"], ["lesson", "list", f"--lang={value}"]):
        assert main(argv) == 0
        assert "第 000 讲" in capsys.readouterr().out
    i18n.set_language("en")


def test_errors_and_help_in_chinese(monkeypatch, capsys):
    assert main(["--lang", "zh", "demo", "--decimals", "13"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "错误：" in err and "--decimals 必须在 0 到 12 之间" in err and "13" in err
    assert main(["--lang", "zh", "--help"]) == 0
    out = capsys.readouterr().out
    assert "按讲义实现的自注意力" in out and "界面语言" in out
    assert "选项" in out and "命令" in out and "Options" not in out  # typer's panel titles too
    assert main(["--help"]) == 0  # and back: English again in the same process
    out = capsys.readouterr().out
    assert "Options" in out and "Commands" in out and "选项" not in out and "界面语言" not in out


def test_a_lesson_in_chinese(capsys):
    """The lecture's claim as quoted, Chinese tables and a Chinese verdict computed from the measurement."""
    assert main(["--lang", "zh", "lesson", "run", "single-token"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "如果一句话只有一个词" in out  # claim_zh, the lecture's words
    assert "结论：" in out and "成立" in out and "注意力权重" in out
    assert "verdict:" not in out and "Exercise 4" not in out and "holds" not in out


def test_lesson_list_in_chinese(capsys):
    assert main(["--lang", "zh", "lesson", "list"]) == 0
    out = capsys.readouterr().out
    assert "第 000 讲 · 简化自注意力" in out and "第 003 讲 · 自注意力 Q/K/V" in out
    assert "可运行" in out and "仅讨论" in out and "为什么注意力分数要除以 √d_k" in out
    assert "why divide the scores" not in out


def test_the_script_speaks_chinese_under_a_chinese_locale():
    """What a user runs: the installed script with LANG=zh_CN.UTF-8 (a subprocess, its own environment)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LANGUAGE", "LC_ALL", "LC_MESSAGES")}
    env |= {"LANG": "zh_CN.UTF-8", "COLUMNS": "100"}
    r = subprocess.run(
        [sys.executable, "-m", "selfattention", "demo", "--example", "journey"],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "注意力权重" in r.stdout and "结论" in r.stdout
    assert "every number the text prints" not in r.stdout


# ------------------------------------------------------------------------------------ the HTML report


def _page_texts() -> set[str]:
    """Every text the report page shows through ``tx()``: its calls in report.js, ``METRIC_NOTE``, and the
    ``data-t`` / ``data-t-title`` elements of report.html (whitespace collapsed, as report.js does)."""
    import html
    import json
    import re

    js = (PKG / "report" / "report.js").read_text(encoding="utf-8")
    page = (PKG / "report" / "report.html").read_text(encoding="utf-8")
    texts = {json.loads(f'"{m}"') for m in re.findall(r'tx\("((?:[^"\\]|\\.)*)"', js)}
    notes = re.search(r"METRIC_NOTE = \{(.*?)\};", js, re.S).group(1)
    texts |= {json.loads(f'"{m}"') for m in re.findall(r'^\s*\w+: "((?:[^"\\]|\\.)*)",', notes, re.M)}
    for _tag, inner in re.findall(r"<(\w+)[^>]*\bdata-t\b[^>]*>(.*?)</\1>", page, re.S):
        texts.add(html.unescape(" ".join(inner.split())))
    texts |= {html.unescape(t) for t in re.findall(r'title="([^"]*)"[^>]*data-t-title', page)}
    return texts


def test_report_labels_list_exactly_the_page_texts():
    from selfattention.report.labels import LABELS

    texts = _page_texts()
    assert len(texts) > 50
    assert set(LABELS) == texts, (sorted(texts - set(LABELS)), sorted(set(LABELS) - texts))


def test_a_report_made_in_chinese_carries_its_words():
    from selfattention.report import example_report, render_html
    from selfattention.worked import load_example

    payload = example_report(load_example("two-token"))
    english = render_html(payload)
    assert '"lang":"en","labels":{}' in english
    with i18n.use_language("zh"):
        chinese = render_html(example_report(load_example("two-token")))
    assert '"lang":"zh"' in chinese and '"Trace":"逐步计算"' in chinese
    assert "一个可以完全手算的例子" in chinese  # the example's Chinese title
    assert "lang" not in payload  # the caller's payload is not changed


# ------------------------------------------------------------------------- no English error left bare


def _bare_english_errors(path: Path) -> list[str]:
    """``UsageError(...)`` calls whose message is not a translated template (``_()``/``ngettext``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "UsageError" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant | ast.JoinedStr | ast.BinOp) or (
                isinstance(arg, ast.Call)
                and not any(
                    isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("_", "ngettext")
                    for n in ast.walk(arg)
                )
                and getattr(arg.func, "id", None) != "str"
            ):
                bad.append(f"{path.name}:{node.lineno}")
    return bad


def test_every_cli_error_is_translated():
    files = sorted((PKG / "commands").glob("*.py"))
    bad = [b for f in files for b in _bare_english_errors(f)]
    assert not bad, f"UsageError messages not wrapped in _(): {bad}"


def _ascii_words(text: str) -> set[str]:
    """The English words (3+ letters) of a text, less those that stay English in Chinese ones: cos,
    m3e-small, MiniLM, the command `make zh`, and the word the English sentences are about ("apple")."""
    import re

    return set(re.findall(r"[A-Za-z]{3,}", text)) - {"cos", "small", "MiniLM", "make", "apple"}


def test_polysemy_verdicts_and_tables_in_chinese():
    """Every branch of both polysemy verdicts, and the tables of the lecture's pair, built under zh."""
    from selfattention.lessons import _polysemy_zh, polysemy

    def zh(last: float, gap: float, static: float = 1.0) -> dict:
        anchors = {}
        for sense, words in _polysemy_zh.ANCHORS.items():
            other = "fruit" if sense == "company" else "company"
            for w in words:
                anchors[w] = {"sense": sense, sense: [0.2, 0.5 + gap], other: [0.1, 0.5]}
        attended = [[("公", 0.05)], [("咬", 0.07)]]
        return {"static_cos": static, "sentence_cos": [0.9, last], "anchors": anchors, "attended": attended}

    english = {"static_cos": 1.0, "last_cos": {"12": 0.66, "13": 0.68, "23": 0.94}, "zh": None}
    measured = [
        {**english, "static_cos": 0.5},
        {**english, "last_cos": {"12": 0.995, "13": 0.7, "23": 0.9}},
        english,
        {**english, "last_cos": {"12": 0.9, "13": 0.7, "23": 0.8}},
        {**english, "zh": zh(0.85, 0.03, static=0.5)},
        {**english, "zh": zh(0.999, 0.03)},
        {**english, "zh": zh(0.85, 0.03)},
        {**english, "zh": zh(0.85, -0.03)},
    ]
    with i18n.use_language("zh"):
        verdicts = [polysemy.verdict(m) for m in measured]
        tables = _polysemy_zh.tables(zh(0.85, 0.03))
    assert len({v.status for v in verdicts}) == 3  # every status is reached
    for v in verdicts:
        assert not _ascii_words(v.because + v.condition), v
    for t in tables:
        assert not _ascii_words(
            t.title + " ".join(t.columns) + " ".join(str(c) for r in t.rows for c in r)
        ), t


def test_unknown_token_note_in_chinese():
    from types import SimpleNamespace

    from selfattention.commands._notes import unknown_tokens_note

    run = SimpleNamespace(n_unknown=6, tokens=["x"] * 13, text="苹果公司发布了新手机。")
    with i18n.use_language("zh"):
        note = unknown_tokens_note(run, "all-MiniLM-L6-v2")
    assert "13" in note and "6" in note and "[UNK]" in note and "--model m3e-small" in note
    assert "unknown to" not in note and "For this text" not in note and "。 " not in note
