"""The small decoder: cached generation identical to recomputation, checkpoints exact and checked,
training deterministic and learning, the `generate` command. Tiny random models only (no long training)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from selfattention.cli import main
from selfattention.decoder import (
    GREEDY,
    CharTokenizer,
    CheckpointError,
    Decoder,
    DecoderConfig,
    Sampling,
    generate,
    held_out_loss,
    load_checkpoint,
    next_tokens,
    recipe_with,
    save_checkpoint,
    shipped_checkpoint,
    train,
    train_recipe,
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
    assert "PASS: identical tokens" in out and "tokens/s with KV cache" in out and "without cache" in out
    assert "sampled: temperature 0.6, top-k 40, seed 0" in out
    assert main(["generate", "-p", "abc", "-n", "30", "--checkpoint", str(path), "--greedy", "--check"]) == 0
    out = capsys.readouterr().out
    assert "PASS: identical tokens" in out and "greedy (arg-max)" in out
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


# ---------------------------------------------------------------- sampling


def _sample_by_hand(model, prompt, n, temperature, top_k, top_p, seed):
    """Independent oracle: recompute the whole sequence each step, softmax in Python floats, filter by
    top-k then top-p by hand, and invert the CDF with one uniform draw per step from a generator seeded
    like the library's (the random stream is the only thing shared)."""
    gen = torch.Generator().manual_seed(seed)
    seq = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([seq]))[0, -1].double().tolist()
        top = max(logits)
        weights = [math.exp((x - top) / temperature) for x in logits]
        total = sum(weights)
        ranked = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
        kept, mass = [], 0.0
        for rank, i in enumerate(ranked):
            if (top_k is not None and rank >= top_k) or (rank > 0 and mass >= top_p):
                break
            kept.append(i)
            mass += weights[i] / total
        u = torch.rand(1, 1, generator=gen, dtype=torch.float64).item()
        kept_total = sum(weights[i] for i in kept)
        acc = 0.0
        for i in kept:
            acc += weights[i] / kept_total
            if acc > u:
                break
        seq.append(i)
    return seq[len(prompt) :]


@pytest.mark.parametrize(
    "sampling,kw",
    [
        (Sampling(temperature=1.0, seed=0), {}),
        (Sampling(temperature=0.7, top_k=4, seed=1), {"num_kv_heads": 2}),
        (Sampling(temperature=1.3, top_p=0.8, seed=2), {"window": 5}),
        (Sampling(temperature=0.9, top_k=6, top_p=0.9, seed=3), {"backend": None}),
    ],
)
def test_sampled_generation_identical_with_and_without_cache_and_to_an_oracle(sampling, kw):
    model = _tiny(seed=11, **kw)
    prompt = [3, 1, 4]
    n = 30
    cached = generate(model, prompt, n, sampling=sampling).tolist()
    uncached = generate(model, prompt, n, sampling=sampling, use_cache=False).tolist()
    assert cached == uncached
    oracle = _sample_by_hand(
        model, prompt, n, sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed
    )
    assert cached == oracle
    assert cached != generate(model, prompt, n).tolist()  # not greedy
    other_seed = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, seed=sampling.seed + 100)
    assert generate(model, prompt, n, sampling=other_seed).tolist() != cached


def test_sampling_frequencies_follow_temperature_top_k_and_top_p():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    rows = 40_000
    batch = logits.expand(rows, -1)
    gen = torch.Generator().manual_seed(5)

    def expected(temperature, top_k, top_p):
        p = torch.softmax(logits.double() / temperature, -1)
        order = p.argsort(descending=True)
        keep = torch.zeros(5, dtype=torch.bool)
        mass = 0.0
        for rank, i in enumerate(order.tolist()):
            if (top_k is not None and rank >= top_k) or (rank > 0 and mass >= top_p):
                break
            keep[i] = True
            mass += p[i].item()
        q = torch.where(keep, p, torch.zeros_like(p))
        return q / q.sum()

    for temperature, top_k, top_p in [(1.0, None, 1.0), (0.5, None, 1.0), (2.0, 3, 1.0), (1.0, None, 0.7)]:
        picks = next_tokens(batch, Sampling(temperature, top_k, top_p, seed=0), gen)
        freq = torch.bincount(picks, minlength=5).double() / rows
        torch.testing.assert_close(freq, expected(temperature, top_k, top_p), atol=0.012, rtol=0)
    # top-k 1 and a tiny top-p are the arg-max
    assert next_tokens(batch[:3], Sampling(1.0, top_k=1), gen).tolist() == [0, 0, 0]
    assert next_tokens(batch[:3], Sampling(1.0, top_p=1e-6), gen).tolist() == [0, 0, 0]
    assert next_tokens(batch[:3], GREEDY, None).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"temperature": 1.0, "top_k": 0}, "top_k must be an int >= 1 or None"),
        ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"temperature": 1.0, "seed": 1.5}, "seed must be an int"),
        ({"top_k": 3}, "top_k=3 has no effect with greedy decoding"),
        ({"top_p": 0.5}, "top_p=0.5 has no effect with greedy decoding"),
    ],
)
def test_sampling_arguments_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kw)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--temperature", "-1"], "--temperature must be a number >= 0"),
        (["--top-k", "-2"], "--top-k must be >= 0"),
        (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
        (["--greedy", "--temperature", "0.5"], "--temperature has no effect with --greedy"),
        (["--greedy", "--top-k", "5"], "--top-k has no effect with --greedy"),
        (["--temperature", "0", "--top-p", "0.9"], "have no effect with --temperature 0"),
    ],
)
def test_generate_sampling_options_are_checked(argv, message, capsys):
    assert main(["generate", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_generate_with_a_missing_checkpoint_says_how_to_train_one(tmp_path, capsys, monkeypatch):
    import selfattention.decoder.training as training

    monkeypatch.setattr(training, "train", _no_training)
    missing = tmp_path / "none.safetensors"
    assert main(["generate", "--checkpoint", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint at" in err and "selfattention train --checkpoint" in err


# ---------------------------------------------------------------- the shipped checkpoint


def _no_training(*args, **kwargs):
    raise AssertionError("generate must not train")


def _shipped():
    path = shipped_checkpoint()
    assert path.is_file(), f"the shipped checkpoint is missing: {path}"
    return path


def test_shipped_checkpoint_is_small_documented_and_reaches_the_loss():
    path = _shipped()
    assert path.stat().st_size < 8 * 2**20
    info = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))["info"]
    assert info["command"].startswith("selfattention train")
    for key in ("steps", "recipe", "train_loss", "held_out_loss", "held_out_history", "seconds", "torch"):
        assert key in info, key
    assert info["recipe"]["seed"] == 0 and info["steps"] == info["recipe"]["steps"]
    # recomputed here, on this Python's copy of the text: not read back from the JSON
    model, tok, _ = load_checkpoint(path)
    text = training_text()
    if set(text) <= set(tok.chars):
        data = torch.tensor(tok.encode(text))
        held_out = data[int(data.numel() * 0.95) :]
        assert held_out_loss(model, held_out) <= 1.6


def _wordlike_share(text: str) -> float:
    """Share of the generated words that occur in the training text (words = runs of letters)."""
    known = set(re.findall(r"[A-Za-z]+", training_text().lower()))
    words = re.findall(r"[A-Za-z]+", text.lower())
    return sum(w in known for w in words) / max(1, len(words))


@pytest.mark.parametrize(
    "extra", [[], ["--greedy"], ["--temperature", "1.0", "--top-p", "0.9", "--seed", "3"]]
)
def test_generate_with_the_shipped_checkpoint_starts_without_training(extra, capsys, monkeypatch):
    import selfattention.decoder.training as training

    _shipped()
    monkeypatch.setattr(training, "train", _no_training)
    monkeypatch.setattr(training, "train_recipe", _no_training)
    assert main(["generate", "--prompt", "The ", "--tokens", "120", "--check", *extra]) == 0
    out = capsys.readouterr().out
    assert "PASS: identical tokens with and without the cache" in out
    lines = out.splitlines()
    # The generated text may hold newlines of its own: it ends where the sampling line begins.
    end = next(i for i, line in enumerate(lines) if line.startswith(("sampled:", "greedy")))
    text = "\n".join(lines[:end])
    assert text.startswith("The ") and len(text) == 4 + 120, text
    # Greedy decoding of a small model settles into layout (runs of spaces) sooner than sampling does.
    assert len(re.findall(r"[A-Za-z]+", text)) >= (5 if "--greedy" in extra else 10), text
    assert _wordlike_share(text) >= 0.7, text


def test_shipped_model_greedy_and_sampled_identical_with_and_without_cache():
    model, tok, _ = load_checkpoint(_shipped())
    ids = tok.encode("The ")
    for sampling in (GREEDY, Sampling(temperature=0.8, top_k=40, seed=0), Sampling(1.0, top_p=0.95, seed=7)):
        cached = generate(model, ids, 80, sampling=sampling).tolist()
        assert cached == generate(model, ids, 80, sampling=sampling, use_cache=False).tolist()


# ---------------------------------------------------------------- training by steps


def test_train_recipe_is_deterministic_and_records_how_it_was_made(tmp_path):
    recipe = recipe_with(context=32, d_model=16, num_heads=2, num_layers=1, steps=6, eval_every=3, threads=1)
    a = train_recipe(tmp_path / "a.safetensors", recipe, command="selfattention train --steps 6")
    b = train_recipe(tmp_path / "b.safetensors", recipe)
    for name, t in a[0].state_dict().items():
        assert torch.equal(t, b[0].state_dict()[name]), name
    info = json.loads((tmp_path / "a.json").read_text(encoding="utf-8"))["info"]
    assert info["command"] == "selfattention train --steps 6"
    assert info["steps"] == 6 and info["recipe"]["steps"] == 6
    assert [s for s, _ in info["held_out_history"]] == [3, 6]
    assert info["held_out_loss"] == info["held_out_history"][-1][1]
    assert info["torch"] == torch.__version__
    c = train_recipe(tmp_path / "c.safetensors", recipe_with(**{**recipe.__dict__, "seed": 1}))
    assert not torch.equal(c[0].tok_emb.weight, a[0].tok_emb.weight)
    with pytest.raises(ValueError, match="unknown recipe field"):
        recipe_with(max_seconds=3)


def test_held_out_loss_matches_a_loop_by_hand():
    model = _tiny(seed=2)
    data = torch.randint(0, 13, (95,), generator=torch.Generator().manual_seed(0))
    total = 0.0
    with torch.no_grad():
        for start in range(0, 94, 40):
            x = data[start : start + 40]
            y = data[start + 1 : start + 41]
            logp = torch.log_softmax(model(x[: len(y)][None])[0].double(), -1)
            total -= logp[torch.arange(len(y)), y].sum().item()
    assert held_out_loss(model, data) == pytest.approx(total / 94, rel=1e-6)


def test_train_command_by_steps(tmp_path, capsys):
    path = tmp_path / "mine.safetensors"
    assert main(["train", "--steps", "2", "--checkpoint", str(path), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "trained 2 steps" in out and "held-out loss" in out
    info = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))["info"]
    assert info["steps"] == 2 and info["recipe"]["threads"] == 1
    assert main(["generate", "--checkpoint", str(path), "-n", "5", "--check"]) == 0
    assert main(["train", "--checkpoint", str(tmp_path / "x.pt")]) == 2
    assert "--checkpoint must name a .safetensors file" in capsys.readouterr().err
