"""The small decoder: cached generation identical to recomputation, checkpoints exact and checked,
training deterministic and learning, the `generate` command. Tiny random models only (no long training)."""

from __future__ import annotations

import json

import pytest
import torch

from selfattention.cli import main
from selfattention.decoder import (
    CharTokenizer,
    CheckpointError,
    Decoder,
    DecoderConfig,
    generate,
    load_checkpoint,
    save_checkpoint,
    train,
    training_text,
)


def _tiny(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=13, context=40, d_model=24, num_heads=4, num_layers=2)
    cfg.update(kw)
    model = Decoder(DecoderConfig(**cfg)).eval()
    with torch.no_grad():  # random weights big enough that greedy decoding does not settle on one token
        for p in model.parameters():
            p.normal_(0, 0.5)
        model.pos_emb.weight.normal_(0, 2.0)  # position-dependent outputs: fewer repeated tokens
    return model


def _greedy_by_hand(model, prompt, n):
    """Independent oracle: argmax of the full-sequence logits, one token at a time, no cache."""
    seq = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize(
    "kw,prompt_len",
    [
        ({}, 1),
        ({}, 3),
        ({}, 7),
        ({"num_kv_heads": 2}, 3),
        ({"num_kv_heads": 1, "window": 5}, 7),  # MQA with a window shorter than the prompt
        ({"backend": None}, 1),
        ({"window": 3, "backend": None}, 3),
    ],
)
def test_greedy_generation_identical_with_and_without_cache(kw, prompt_len):
    model = _tiny(seed=prompt_len, **kw)
    prompt = torch.randint(0, 13, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    n = 40 - prompt_len
    cached = generate(model, prompt, n, use_cache=True).tolist()
    uncached = generate(model, prompt, n, use_cache=False).tolist()
    assert cached == uncached
    assert cached == _greedy_by_hand(model, prompt.tolist(), n)


def test_cached_logits_equal_uncached_at_every_step():
    model = _tiny(seed=9, num_kv_heads=2, window=6)
    ids = torch.randint(0, 13, (2, 25), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        caches = model.new_caches(2)
        start = 0
        for n in [4, 1, 9, 1, 1, 2, 7]:  # 9 > window: a chunk longer than the window
            part = model(ids[:, start : start + n], caches)
            assert (part - full[:, start : start + n]).abs().max() <= 1e-5
            start += n
        assert start == 25


def test_batched_generation_and_right_padding():
    model = _tiny(seed=3)
    prompts = torch.randint(0, 13, (3, 5), generator=torch.Generator().manual_seed(2))
    batched = generate(model, prompts, 10)
    for i in range(3):
        assert batched[i].tolist() == generate(model, prompts[i], 10).tolist()
    # right padding: logits of the real tokens equal running the short sequence alone
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    real = torch.tensor([[True] * 5, [True, True, True, False, False]])
    with torch.no_grad():
        logits = model(ids, key_padding_mask=real)
        alone = model(ids[1:, :3])
    assert torch.allclose(logits[1, :3], alone[0], atol=1e-5)


def test_checkpoint_round_trip_is_exact(tmp_path):
    model = _tiny(seed=4, num_kv_heads=2, window=7)
    tok = CharTokenizer("abcdefghijkl ")
    path, cfg = save_checkpoint(model, tok, tmp_path / "m.safetensors", {"note": "x"})
    loaded, tok2, info = load_checkpoint(path)
    assert info == {"note": "x"} and tok2.chars == tok.chars
    assert loaded.config == model.config
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    prompt = torch.tensor([1, 2, 3])
    assert generate(loaded, prompt, 20).tolist() == generate(model, prompt, 20).tolist()


def test_checkpoint_with_wrong_shapes_or_missing_tensors_names_them(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _tiny(seed=5)
    path, cfg_path = save_checkpoint(model, CharTokenizer("abcdefghijkl "), tmp_path / "m.safetensors")
    meta = json.loads(cfg_path.read_text())
    meta["config"]["d_model"] = 32  # the config now disagrees with every tensor
    cfg_path.write_text(json.dumps(meta))
    with pytest.raises(
        CheckpointError, match=r"tensor 'tok_emb.weight' has shape \(13, 24\), the model expects \(13, 32\)"
    ):
        load_checkpoint(path)
    meta["config"]["d_model"] = 24
    cfg_path.write_text(json.dumps(meta))
    tensors = load_file(str(path))
    del tensors["blocks.1.attn.k_proj.weight"]
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path))
    with pytest.raises(
        CheckpointError,
        match=r"missing tensor 'blocks.1.attn.k_proj.weight' \(the model expects shape \(24, 24\)\)",
    ) as e:
        load_checkpoint(path)
    assert "unexpected tensor 'extra.weight'" in str(e.value)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_checkpoint(tmp_path / "none.safetensors")


def test_tokenizer_and_text():
    text = training_text()
    assert len(text) > 100_000 and "assignment" in text  # CPython's own documentation prose
    tok = CharTokenizer.from_text(text)
    sample = text[1000:1200]
    assert tok.decode(tok.encode(sample)) == sample
    with pytest.raises(ValueError, match="alphabet does not have: '€'"):
        tok.encode("5 €")


def test_training_is_deterministic_and_learns():
    text = training_text()[:20000]
    tok = CharTokenizer.from_text(text)
    data = torch.tensor(tok.encode(text))

    def run():
        torch.manual_seed(0)
        m = Decoder(
            DecoderConfig(vocab_size=tok.vocab_size, context=32, d_model=32, num_heads=2, num_layers=1)
        )
        return train(m, data, steps=30, batch_size=8, lr=1e-2, seed=0)

    a, b = run(), run()
    assert a.losses == b.losses
    assert a.losses[-1] < 0.8 * a.losses[0]  # from ~log(vocab) towards the character statistics


def test_context_and_argument_errors():
    model = _tiny()
    with pytest.raises(ValueError, match="exceed the model's context of 40"):
        generate(model, [1, 2, 3], 38)
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, [], 3)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 13\)"):
        model(torch.tensor([[13]]))
    caches = model.new_caches(1, 40)
    model(torch.zeros(1, 39, dtype=torch.long), caches)
    with pytest.raises(ValueError, match="positions 39..40 exceed"):
        model(torch.zeros(1, 2, dtype=torch.long), caches)


def test_generate_command_both_ways(tmp_path, capsys):
    model = _tiny(seed=6, vocab_size=13)
    path, _ = save_checkpoint(model, CharTokenizer("abcdefghijkl "), tmp_path / "m.safetensors")
    assert main(["generate", "--prompt", "abc", "--tokens", "30", "--checkpoint", str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "identical tokens" in out and "tokens/s with KV cache" in out and "without cache" in out
    assert main(["generate", "-p", "abc", "-n", "30", "--checkpoint", str(path), "--no-cache"]) == 0
    text_uncached = capsys.readouterr().out.splitlines()[0]
    assert main(["generate", "-p", "abc", "-n", "30", "--checkpoint", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == text_uncached
    assert main(["generate", "-p", "xyz", "--checkpoint", str(path)]) == 2
    assert "alphabet does not have" in capsys.readouterr().err
    assert main(["generate", "-p", "abc", "-n", "38", "--checkpoint", str(path)]) == 2
    assert "at most --tokens 37" in capsys.readouterr().err
    (tmp_path / "bad.safetensors").write_bytes(b"not a checkpoint")
    (tmp_path / "bad.json").write_text(json.dumps(json.loads((tmp_path / "m.json").read_text())))
    assert main(["generate", "--checkpoint", str(tmp_path / "bad.safetensors")]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err


def test_generate_prints_the_prompt_bold_and_user_text_verbatim(tmp_path, monkeypatch):
    """Review fix: no literal '[bold]' markup in the output; a prompt with '[b]' is shown as typed."""
    from rich.console import Console

    import selfattention.commands.generate as gen_cmd

    rec = Console(record=True, force_terminal=True, color_system="standard", width=200)
    monkeypatch.setattr(gen_cmd, "console", rec)
    model = _tiny(seed=6, vocab_size=15)
    path, _ = save_checkpoint(model, CharTokenizer("abcdefghijkl []"), tmp_path / "m.safetensors")
    assert main(["generate", "-p", "[b]ab", "-n", "5", "--checkpoint", str(path)]) == 0
    ansi = rec.export_text(styles=True, clear=False)
    plain = rec.export_text()
    first = plain.splitlines()[0]
    assert first.startswith("[b]ab") and len(first) == 5 + 5 and "[bold]" not in plain
    assert "\x1b[1m[b]ab\x1b[0m" in ansi  # the prompt, bold, verbatim; the continuation after it plain
