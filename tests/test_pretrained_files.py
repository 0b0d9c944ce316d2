"""Locating a checkpoint and reading its config (selfattention.pretrained_files), without transformers or
any model package: folders written here, by hand."""

from __future__ import annotations

import json

import pytest

from selfattention import pretrained, pretrained_files, pretrained_load


def _folder(tmp_path, config, **files):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content))
    return folder


def test_pretrained_reexports_the_same_objects():
    for name in ("NAMED_MODELS", "M3E_INSTALL", "resolve_model", "trained_length", "n_layers_and_heads"):
        assert getattr(pretrained, name) is getattr(pretrained_files, name)
    assert pretrained.load_model is pretrained_load.load_model
    assert pretrained.load_reference_model is pretrained_load.load_reference_model
    assert set(pretrained.__all__) >= {"NAMED_MODELS", "load_model", "run_text", "ModelRun", "LOADED_MAX"}
    for name in pretrained.__all__:
        getattr(pretrained, name)


def test_config_lengths_prefer_the_trained_length(tmp_path):
    folder = _folder(
        tmp_path,
        {"num_hidden_layers": 3, "num_attention_heads": 5, "max_position_embeddings": 640},
        **{"tokenizer_config.json": {"model_max_length": 300}},
    )
    assert pretrained.position_limit(folder) == 640
    assert pretrained.trained_length(folder) == 300  # the tokenizer's, not the position table
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    assert pretrained.trained_length(folder) == 128  # sentence-transformers' own limit comes first
    assert pretrained.n_layers_and_heads(pretrained.model_config(folder)) == (3, 5)
    assert pretrained.model_label(folder) == "ckpt"


def test_gpt2_names_and_a_huge_tokenizer_limit(tmp_path):
    folder = _folder(
        tmp_path,
        {"n_layer": 2, "n_head": 4, "n_positions": 96},
        **{"tokenizer_config.json": {"model_max_length": 10**30}},  # transformers' "no limit" value
    )
    assert pretrained.n_layers_and_heads(pretrained.model_config(folder)) == (2, 4)
    assert pretrained.trained_length(folder) == 96  # the huge value is not a length: the positions are


def test_bad_folders_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        pretrained.resolve_model(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="did you mean m3e-small"):
        pretrained.resolve_model("m3e-smal")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        pretrained.resolve_model(tmp_path / "empty")
    with pytest.raises(ValueError, match="not valid JSON"):
        pretrained.model_config(_folder(tmp_path, "{not json"))


def test_a_config_without_layers_or_heads_is_refused(tmp_path):
    with pytest.raises(ValueError, match="layers and attention heads"):
        pretrained.n_layers_and_heads({"num_hidden_layers": 2})
    with pytest.raises(ValueError, match="JSON object"):
        pretrained.model_config(_folder(tmp_path, "[1, 2]"))
