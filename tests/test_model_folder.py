"""Any local checkpoint folder on our attention: run_text, explain and report with --model PATH.

Tiny random-weight checkpoints (tests/tiny_models.py) with a word-level tokenizer, saved to a temporary
folder; the oracle is the same folder loaded separately with transformers' own eager attention.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from selfattention import pretrained  # noqa: E402
from selfattention.cli import main  # noqa: E402
from selfattention.focus import strongest_link  # noqa: E402
from selfattention.pretrained import MATCH_TOLERANCE as TOLERANCE  # noqa: E402
from selfattention.report import decode_array, model_report  # noqa: E402
from tests.tiny_models import save_checkpoint  # noqa: E402

TEXT = "the animal did not cross the street because it was too tired"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only waits on a busy machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: save_checkpoint(name, root / name) for name in ("bert", "llama", "t5")}


def _eager(folder, text):
    """The oracle: the checkpoint loaded on its own with transformers' eager attention."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True, attn_implementation="eager").eval()
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_attentions=True)
    return tok.convert_ids_to_tokens(enc["input_ids"][0]), torch.stack([a[0] for a in out.attentions]), out


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_run_text_on_a_folder_matches_its_eager_attention(folders, name):
    tokens, eager, out = _eager(folders[name], TEXT)
    run = pretrained.run_text(TEXT, model=folders[name])
    assert run.tokens == tokens and run.model_name == name
    assert run.attentions.shape == eager.shape == (2, 4, len(tokens), len(tokens))
    assert (run.attentions - eager).abs().max() <= TOLERANCE  # two float32 passes (MATCH_TOLERANCE)
    assert (run.hidden_states[-1] - out.last_hidden_state).abs().max() <= TOLERANCE
    assert run.max_abs_diff_weights <= TOLERANCE and run.max_abs_diff_hidden <= TOLERANCE
    if name == "llama":  # a decoder: nothing above the diagonal
        assert run.attentions.triu(1).abs().max() == 0
        assert run.queries.shape == run.keys.shape == (2, 4, len(tokens), 8)  # 2 key/value heads, repeated
    assert run.special == [t in ("[CLS]", "[SEP]") for t in tokens]
    assert run.trained_length == 48 and not run.past_trained_length


def test_long_inputs_keep_no_matrices_but_the_same_numbers(folders):
    text = " ".join([TEXT] * 3)
    tokens, eager, _ = _eager(folders["llama"], text)
    run = pretrained.run_text(text, model=folders["llama"], materialise=False)
    assert run.attentions is None and run.traces == [] and run.max_abs_diff_weights is None
    for la, h in [(0, 0), (1, 3)]:
        assert (run.weights(la, h) - eager[la, h]).abs().max() <= 1e-6
    p = model_report(run, exact_budget_mb=1e-6, top_k=3)
    # statistics from the tiled path, against the eager weights computed here
    w = eager.double()
    entropy = -(torch.special.xlogy(w, w)).sum(-1).mean(-1) / math.log(2)
    np.testing.assert_allclose(p["stats"]["entropy"], entropy.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p["stats"]["self"], w.diagonal(dim1=-2, dim2=-1).mean(-1).numpy(), atol=1e-6)
    np.testing.assert_allclose(p["stats"]["first"], w[..., 0].mean(-1).numpy(), atol=1e-6)
    np.testing.assert_allclose(p["stats"]["last"], w[..., -1].mean(-1).numpy(), atol=1e-6)
    top = torch.topk(eager, 3, dim=-1)
    np.testing.assert_allclose(decode_array(p["topk"]["weights"]), top.values.numpy(), atol=1e-6)
    # only the opening head has a matrix, and it is the model's
    (key,) = p["u8_heads"]
    la, h = map(int, key.split("."))
    assert list(p["exact"]) == [key]
    np.testing.assert_allclose(decode_array(p["exact"][key]["weights"]), eager[la, h].numpy(), atol=1e-6)


def test_past_the_trained_length_is_flagged(folders):
    text = " ".join([TEXT] * 5)  # 60 tokens; the tokenizer says 48
    run = pretrained.run_text(text, model=folders["bert"], compare=False)
    assert run.past_trained_length and run.trained_length == 48 and len(run.tokens) == 62
    assert any("at most 48 tokens" in n for n in model_report(run)["notes"])


def test_explain_with_model_matches_and_opens_on_the_rule(folders, capsys):
    code = main(["explain", TEXT, "--model", str(folders["llama"]), "--top", "2"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    tokens, eager, _ = _eager(folders["llama"], TEXT)
    link = strongest_link(eager, tokens, [False] * len(tokens))
    assert f"llama · layer {link.layer}, head {link.head} (of 2 × 4, 0-based)" in out
    assert "MATCH" in out and "MISMATCH" not in out
    assert f"Opening on layer {link.layer}, head {link.head}" in out
    assert f'text: "{TEXT}"' in out


def test_explain_with_model_prints_the_trained_length_note(folders, capsys):
    code = main(
        ["explain", " ".join([TEXT] * 5), "--model", str(folders["bert"]), "--layer", "1", "--head", "0"]
    )
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "trained on inputs of at most 48 tokens" in out and "this text has 62" in out


def test_report_with_model(folders, tmp_path, capsys):
    target = tmp_path / "r.html"
    assert main(["report", TEXT, "--model", str(folders["bert"]), "--out", str(target)]) == 0
    html = target.read_text(encoding="utf-8")
    payload = __import__("json").loads(
        re.search(r'<script type="application/json" id="report-data">(.*?)</script>', html, re.S).group(1)
    )
    tokens, eager, _ = _eager(folders["bert"], TEXT)
    assert payload["tokens"] == tokens and payload["subtitle"].startswith("bert ")
    assert len(payload["exact"]) == 8  # every head of a short text
    for key, rec in payload["exact"].items():
        la, h = map(int, key.split("."))
        np.testing.assert_allclose(decode_array(rec["weights"]), eager[la, h].numpy(), atol=1e-6)
    link = strongest_link(eager, tokens, [t in ("[CLS]", "[SEP]") for t in tokens])
    assert payload["initial"] == {
        "layer": link.layer,
        "head": link.head,
        "token": link.query,
        "view": "tokens:raw",
    }
    assert not any("within 0" in n for n in payload["notes"])


@pytest.mark.parametrize(
    ("which", "message"),
    [("missing", "is not a folder"), ("no-config", "has no config.json"), ("t5", "encoder-decoder")],
)
@pytest.mark.parametrize("command", ["explain", "report"])
def test_bad_model_folders_are_usage_errors(folders, tmp_path, capsys, which, message, command):
    folder = {"missing": tmp_path / "nope", "no-config": tmp_path, "t5": folders["t5"]}[which]
    args = [command, "hello", "--model", str(folder)]
    if command == "report":
        args += ["--out", str(tmp_path / "x.html")]
    assert main(args) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_tokenizer_ids_past_the_vocab_are_a_usage_error(folders, tmp_path, capsys):
    """Tokenizer files from another model (ids past the embedding table) name the cause, not IndexError."""
    import shutil

    from transformers import AutoModel

    folder = tmp_path / "small-vocab"
    shutil.copytree(folders["llama"], folder)
    model = AutoModel.from_pretrained(folder, local_files_only=True)
    model.resize_token_embeddings(4)
    model.save_pretrained(folder)
    assert main(["explain", TEXT, "--model", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "vocab_size is 4" in err and "do not belong to this model" in err


def test_a_folder_without_tokenizer_files_says_so(folders, tmp_path, capsys):
    """A model saved without its tokenizer: the message names the missing files and how to add them, on
    one line (transformers' own ends in "one of:" with the list on the following lines)."""
    import shutil

    folder = tmp_path / "no-tokenizer"
    shutil.copytree(folders["llama"], folder)
    removed = [p for p in folder.iterdir() if p.name.startswith(("tokenizer", "vocab", "special_tokens"))]
    assert removed, sorted(p.name for p in folder.iterdir())  # the fixture did save a tokenizer
    for p in removed:
        p.unlink()
    assert main(["explain", TEXT, "--model", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "holds no tokenizer files" in err and "tokenizer.json" in err, err
    assert "tokenizer.save_pretrained" in err and not err.rstrip().endswith(":"), err
