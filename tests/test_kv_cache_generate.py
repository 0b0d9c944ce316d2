"""Batched generation on ragged/paged caches: every sequence gets exactly the tokens of its own run alone,
uncached (greedy and sampled with its seed), whatever the batch, page size or finishing order."""

from __future__ import annotations

import pytest
import torch

from selfattention.decoder import (
    Decoder,
    DecoderConfig,
    Sampling,
    generate,
    generate_batch,
    sequence_sampling,
)


def _tiny(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(vocab_size=13, context=48, d_model=24, num_heads=4, num_layers=2)
    cfg.update(kw)
    model = Decoder(DecoderConfig(**cfg)).eval()
    with torch.no_grad():  # big random weights: position-dependent, varied tokens
        for p in model.parameters():
            p.normal_(0, 0.5)
        model.pos_emb.weight.normal_(0, 2.0)
    return model


def _prompts(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 13, (n,), generator=g).tolist() for n in lens]


def _alone(model, prompt, n, sampling, b):
    return generate(model, prompt, n, sampling=sequence_sampling(sampling, b), use_cache=False).tolist()


SAMPLINGS = [
    Sampling(),
    Sampling(temperature=1.0, seed=3),
    Sampling(temperature=0.8, top_k=5, top_p=0.9, seed=11),
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "t1", "topk-topp"])
@pytest.mark.parametrize("page_size", [None, 4, 1])
@pytest.mark.parametrize("kw", [{}, {"num_kv_heads": 2}, {"num_kv_heads": 1, "window": 5}, {"backend": None}])
def test_every_sequence_equals_its_own_uncached_run(sampling, page_size, kw):
    model = _tiny(seed=len(kw), **kw)
    prompts = _prompts([1, 9, 4, 17], seed=len(kw))
    counts = [20, 5, 0, 12]  # they finish at different steps (one generates nothing)
    outs = generate_batch(model, prompts, counts, sampling=sampling, page_size=page_size)
    for b, (p, n) in enumerate(zip(prompts, counts, strict=True)):
        assert outs[b] == _alone(model, p, n, sampling, b), b


def test_uncached_batch_is_the_same_too():
    model = _tiny(seed=5)
    prompts = _prompts([3, 11, 6], seed=5)
    s = Sampling(temperature=1.0, seed=7)
    assert generate_batch(model, prompts, 10, sampling=s, use_cache=False) == generate_batch(
        model, prompts, 10, sampling=s
    )


def test_stop_token_finishes_a_sequence_alone():
    model = _tiny(seed=6)
    prompts = _prompts([2, 8, 5], seed=6)
    free = generate_batch(model, prompts, 15)
    stop = free[1][3]  # sequence 1's 4th token
    outs = generate_batch(model, prompts, 15, stop_token=stop)
    for b in range(3):
        k = free[b].index(stop) + 1 if stop in free[b] else 15
        assert outs[b] == free[b][:k]
    assert len(outs[1]) <= 4


def test_bad_batches_name_the_prompt():
    model = _tiny()
    with pytest.raises(ValueError, match=r"prompt 1 \(40 tokens\) \+ 10 new tokens = 50 exceed"):
        generate_batch(model, [[1], [2] * 40], 10)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate_batch(model, [[], [1]], 3)
    with pytest.raises(ValueError, match=r"max_new_tokens has 1 entries for 2 prompts"):
        generate_batch(model, [[1], [2]], [3])
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\] must be an int >= 0, got -1"):
        generate_batch(model, [[1], [2]], [3, -1])


def test_generate_command_with_several_prompts(tmp_path, capsys):
    from selfattention.cli import main
    from selfattention.decoder import CharTokenizer, save_checkpoint

    model = _tiny(seed=6)
    path, _ = save_checkpoint(model, CharTokenizer("abcdefghijkl "), tmp_path / "m.safetensors")
    for extra in ([], ["--greedy"]):
        argv = ["generate", "-p", "abc", "-p", "l", "-p", "kkjih ab", "-n", "25", "--checkpoint", str(path)]
        assert main([*argv, "--check", *extra]) == 0
        out = capsys.readouterr().out
        assert "3 prompts, 75 tokens" in out and "decoded together with KV cache" in out
        assert "PASS: every prompt decoded in the batch gives the tokens" in out
    assert main(["generate", "-p", "abc", "-p", "", "-n", "5", "--checkpoint", str(path)]) == 2
    assert "--prompt 2 must not be empty" in capsys.readouterr().err
    assert main(["generate", "-p", "abc", "-p", "xyz", "--checkpoint", str(path)]) == 2
    assert main(["generate", "-p", "abc", "-p", "ab", "-n", "46", "--checkpoint", str(path)]) == 2
