"""``selfattention generate``: text from the small decoder (shipped trained), with or without the KV cache."""

from __future__ import annotations

import math
import time
from pathlib import Path

import typer

from ..i18n import N_, _
from . import UsageError, console, err_console

# The defaults of `generate`: sampled, sharpened (0.6 keeps this small model on words; 0.8 often wanders into
# the grammar blocks of its training text), from a fixed seed (the same text every run).
DEFAULT_TEMPERATURE = 0.6
DEFAULT_TOP_K = 40


def _timed_generate(model, prompt_ids, tokens: int, use_cache: bool, sampling):
    from ..decoder import generate

    t0 = time.perf_counter()
    out = generate(model, prompt_ids, tokens, use_cache=use_cache, sampling=sampling)
    return out.tolist(), time.perf_counter() - t0


#: ``--check``: how many cached/recomputed pairs are timed (interleaved; the median ratio is reported)
CHECK_ROUNDS = 3
#: ``--check``: no new pair starts once the timed runs took this many seconds (a busy machine: one pair)
CHECK_BUDGET_S = 60.0


def _timing_verdict(timing) -> str:
    """The PASS line of ``--check``: the median ratio of the interleaved pairs, or that the machine was too
    noisy to tell which run is faster."""
    lo, hi = min(timing.ratios), max(timing.ratios)
    if timing.cut_short:
        return _(
            "[bold green]PASS[/bold green]: identical tokens with and without the cache; the machine was too "
            "busy to compare their speed: the timing stopped after {rounds} of {wanted} interleaved pairs "
            "({secs:.0f} s, recompute / cached: {lo:.1f}× to {hi:.1f}×)"
        ).format(
            rounds=timing.rounds,
            wanted=CHECK_ROUNDS,
            secs=sum(timing.first_seconds) + sum(timing.second_seconds),
            lo=lo,
            hi=hi,
        )
    if timing.noisy:
        return _(
            "[bold green]PASS[/bold green]: identical tokens with and without the cache; the machine was too "
            "noisy to compare their speed (recompute / cached: {lo:.1f}× to {hi:.1f}× over {rounds} "
            "interleaved pairs)"
        ).format(lo=lo, hi=hi, rounds=timing.rounds)
    return _(
        "[bold green]PASS[/bold green]: identical tokens with and without the cache; recomputing took "
        "{ratio:.1f}× the time of the cached run (median of {rounds} interleaved pairs, {lo:.1f}× to {hi:.1f}×)"
    ).format(ratio=timing.median_ratio, rounds=timing.rounds, lo=lo, hi=hi)


def _progress(round_: int, which: int, secs: float) -> None:
    """One line on stderr per timed run of --check (stdout keeps the result only)."""
    line = (
        _("[dim]  pair {round}/{rounds}: cached run {secs:.1f} s[/dim]")
        if which == 0
        else _("[dim]  pair {round}/{rounds}: recomputed run {secs:.1f} s[/dim]")
    )
    err_console.print(line.format(round=round_, rounds=CHECK_ROUNDS, secs=secs), highlight=False)


def _sampling(greedy: bool, temperature: float | None, top_k: int | None, top_p: float | None, seed: int):
    """The :class:`Sampling` the options ask for; a UsageError naming the option for a contradiction."""
    from ..decoder import Sampling

    if greedy:
        for name, value in (("--temperature", temperature), ("--top-k", top_k), ("--top-p", top_p)):
            if value is not None:
                raise UsageError(
                    _(
                        "{option} has no effect with --greedy (greedy decoding takes the most likely "
                        "character); leave out one of the two"
                    ).format(option=name)
                )
        return Sampling()
    if temperature == 0:
        if top_k is not None or top_p is not None:
            raise UsageError(
                _(
                    "--top-k and --top-p have no effect with --temperature 0 (greedy decoding); "
                    "give a temperature > 0 to sample"
                )
            )
        return Sampling()
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise UsageError(
            _("--temperature must be a number >= 0 (0 = greedy), got {value}").format(value=temperature)
        )
    if top_k is not None and top_k < 0:
        raise UsageError(_("--top-k must be >= 0 (0 = all characters), got {value}").format(value=top_k))
    if top_p is not None and not 0 < top_p <= 1:
        raise UsageError(_("--top-p must be in (0, 1] (1 = all characters), got {value}").format(value=top_p))
    return Sampling(
        temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_k=DEFAULT_TOP_K if top_k is None else (top_k or None),
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
    )


_HELP = N_(
    "Continue --prompt with the small decoder (shipped trained) and print tokens/s.\n\n"
    "With the KV cache (default) each new token costs one single-token step; --no-cache recomputes "
    "everything; --check runs both and verifies that the text is the same (greedy or sampled: the same "
    "seed draws the same random numbers)."
)


def generate_cmd(
    prompt: list[str] = typer.Option(
        None,
        "--prompt",
        "-p",
        help=N_('Text to continue (default "The "); give it several times to decode the prompts together.'),
        show_default=False,
    ),
    tokens: int = typer.Option(200, "--tokens", "-n", min=0, help=N_("How many characters to generate.")),
    temperature: float = typer.Option(
        None,
        "--temperature",
        "-t",
        help=N_("Sampling temperature; 0 = greedy (default {temperature})."),
        show_default=False,
    ),
    top_k: int = typer.Option(
        None,
        "--top-k",
        help=N_("Sample among the K most likely characters; 0 = all (default {top_k})."),
        show_default=False,
    ),
    top_p: float = typer.Option(
        None,
        "--top-p",
        help=N_(
            "Sample among the most likely characters whose probabilities reach P, in (0, 1] (default 1: all)."
        ),
        show_default=False,
    ),
    seed: int = typer.Option(0, "--seed", help=N_("Seed of the sampling (the same seed, the same text).")),
    greedy: bool = typer.Option(False, "--greedy", help=N_("Always take the most likely character.")),
    no_cache: bool = typer.Option(
        False, "--no-cache", help=N_("Recompute the whole sequence for every token.")
    ),
    check: bool = typer.Option(
        False, "--check", help=N_("Generate both ways, verify the tokens are identical, compare speed.")
    ),
    checkpoint: Path = typer.Option(
        None,
        "--checkpoint",
        help=N_(
            "A .safetensors checkpoint (with its .json), e.g. from `selfattention train`. "
            "Default: the one shipped in the package."
        ),
        show_default=False,
    ),
) -> None:
    from rich.text import Text

    from ..decoder import CheckpointError, load_checkpoint, shipped_checkpoint

    sampling = _sampling(greedy, temperature, top_k, top_p, seed)
    prompts = list(prompt) if prompt else ["The "]
    path = Path(checkpoint) if checkpoint is not None else shipped_checkpoint()
    if path.suffix != ".safetensors":
        raise UsageError(_("--checkpoint must name a .safetensors file, got {path}").format(path=path))
    if not path.exists():
        if checkpoint is None:
            raise UsageError(
                _(
                    "the shipped checkpoint {path} is missing from this installation; train one with "
                    "`selfattention train --checkpoint my.safetensors` and pass --checkpoint my.safetensors"
                ).format(path=path)
            )
        raise UsageError(
            _("no checkpoint at {path}; train one with `selfattention train --checkpoint {path}`").format(
                path=path
            )
        )
    try:
        model, tok, _info = load_checkpoint(path)
    except (CheckpointError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    if len(prompts) > 1:
        _generate_many(model, tok, prompts, tokens, sampling, no_cache, check)
        return
    prompt = prompts[0]
    if not prompt:
        raise UsageError(_("--prompt must not be empty"))
    try:
        ids = tok.encode(prompt)
    except ValueError as e:
        raise UsageError(_("--prompt: {problem}").format(problem=e)) from None
    ctx = model.config.context
    if len(ids) + tokens > ctx:
        raise UsageError(
            _(
                "--prompt ({n} characters) + --tokens {tokens} = {total} exceed the model's context of {ctx} "
                "positions; use at most --tokens {most}"
            ).format(n=len(ids), tokens=tokens, total=len(ids) + tokens, ctx=ctx, most=max(0, ctx - len(ids)))
        )

    modes = [True, False] if check else [not no_cache]
    for use_cache in modes:  # warm-up, untimed: the first call pays for allocations and lazy imports
        _timed_generate(model, ids, min(tokens, 2), use_cache, sampling)
    timing = None
    if check:  # cached and recomputed runs interleaved, CHECK_ROUNDS pairs: a busy machine hits both alike
        from .timing import compare

        err_console.print(
            _(
                "[dim]--check: timing up to {rounds} pairs of a cached and a recomputed run, one after the "
                "other (no new pair after {budget:.0f} s)…[/dim]"
            ).format(rounds=CHECK_ROUNDS, budget=CHECK_BUDGET_S),
            highlight=False,
        )
        timing = compare(
            lambda: _timed_generate(model, ids, tokens, True, sampling),
            lambda: _timed_generate(model, ids, tokens, False, sampling),
            rounds=CHECK_ROUNDS,
            budget_s=CHECK_BUDGET_S,
            on_run=_progress,
        )
        secs = timing.median_seconds()
        results = {True: (timing.first_values[0], secs[0]), False: (timing.second_values[0], secs[1])}
    else:
        results = {use_cache: _timed_generate(model, ids, tokens, use_cache, sampling) for use_cache in modes}
    out, _secs = results[modes[0]]
    # The prompt bold, the continuation plain; both are user/model text, never parsed as markup.
    # (Text(prompt, style="bold") + Text(...) would make the whole line bold: the base style is kept.)
    console.print(Text.assemble((prompt, "bold"), tok.decode(out)), highlight=False)
    console.print(f"[dim]{sampling.describe()}[/dim]", highlight=False)
    for use_cache in modes:
        n_out, secs = results[use_cache]
        rate = len(n_out) / secs if secs > 0 else float("inf")
        line = (
            _("{n} tokens in {secs:.3f} s = [bold]{rate:.1f} tokens/s[/bold] with KV cache")
            if use_cache
            else _("{n} tokens in {secs:.3f} s = [bold]{rate:.1f} tokens/s[/bold] without cache (recompute)")
        )
        console.print(line.format(n=len(n_out), secs=secs, rate=rate), highlight=False)
    if check:
        cached, uncached = results[True][0], results[False][0]
        if cached != uncached:
            first = next(i for i, (a, b) in enumerate(zip(cached, uncached, strict=True)) if a != b)
            console.print(
                _(
                    "[bold red]FAIL[/bold red]: cached and uncached generation differ (first at token "
                    "{first})"
                ).format(first=first)
            )
            raise typer.Exit(1)
        console.print(_timing_verdict(timing), highlight=False)


def _generate_many(
    model, tok, prompts: list[str], tokens: int, sampling, no_cache: bool, check: bool
) -> None:
    """Several prompts decoded together (ragged KV caches); --check: each against its own uncached run."""
    from rich.text import Text

    from ..decoder import generate, generate_batch, sequence_sampling

    ids = []
    for i, p in enumerate(prompts, start=1):
        if not p:
            raise UsageError(_("--prompt {i} must not be empty").format(i=i))
        try:
            ids.append(tok.encode(p))
        except ValueError as e:
            raise UsageError(_("--prompt {i}: {problem}").format(i=i, problem=e)) from None
        ctx = model.config.context
        if len(ids[-1]) + tokens > ctx:
            raise UsageError(
                _(
                    "--prompt {i} ({n} characters) + --tokens {tokens} exceed the model's context of {ctx} "
                    "positions"
                ).format(i=i, n=len(ids[-1]), tokens=tokens, ctx=ctx)
            )
    use_cache = not no_cache
    generate_batch(model, ids, min(tokens, 2), sampling=sampling, use_cache=use_cache)  # warm-up, untimed

    def batch() -> tuple[list[list[int]], float]:
        t0 = time.perf_counter()
        outs = generate_batch(model, ids, tokens, sampling=sampling, use_cache=use_cache)
        return outs, time.perf_counter() - t0

    def alone_runs() -> tuple[list[list[int]], float]:
        t0 = time.perf_counter()
        runs = [
            generate(model, x, tokens, sampling=sequence_sampling(sampling, i), use_cache=False).tolist()
            for i, x in enumerate(ids)
        ]
        return runs, time.perf_counter() - t0

    timing = None
    if check:  # the batch and the prompts one by one, interleaved: a busy machine hits both alike
        from .timing import compare

        timing = compare(batch, alone_runs, rounds=CHECK_ROUNDS, budget_s=CHECK_BUDGET_S)
        outs, alone = timing.first_values[0], timing.second_values[0]
        secs = timing.median_seconds()[0]
    else:
        outs, secs = batch()
    for p, out in zip(prompts, outs, strict=True):
        console.print(Text.assemble((p, "bold"), tok.decode(out)), highlight=False)
    line = sampling.describe()
    if not sampling.greedy:
        line += _(" (prompt i: seed + i − 1)")
    console.print(f"[dim]{line}[/dim]", highlight=False)
    total = sum(len(o) for o in outs)
    rate = total / secs if secs > 0 else float("inf")
    msg = (
        _(
            "{k} prompts, {n} tokens in {secs:.3f} s = [bold]{rate:.1f} tokens/s[/bold] decoded together with KV cache"
        )
        if use_cache
        else _(
            "{k} prompts, {n} tokens in {secs:.3f} s = [bold]{rate:.1f} tokens/s[/bold] together without cache"
        )
    )
    console.print(msg.format(k=len(prompts), n=total, secs=secs, rate=rate), highlight=False)
    if timing is None:
        return
    bad = [i for i, (a, b) in enumerate(zip(outs, alone, strict=True)) if a != b]
    for i in bad:
        first = next(j for j, (a, b) in enumerate(zip(outs[i], alone[i], strict=True)) if a != b)
        console.print(
            _(
                "[bold red]FAIL[/bold red]: prompt {i} decoded in the batch differs from its own uncached run "
                "(first at token {first})"
            ).format(i=i + 1, first=first)
        )
    if bad:
        raise typer.Exit(1)
    console.print(_batch_verdict(timing, len(prompts)), highlight=False)


def _batch_verdict(timing, k: int) -> str:
    """The PASS line of a batched ``--check``: the median ratio of the interleaved (batch, runs alone)
    pairs, or that the machine was too busy or too noisy to tell which is faster."""
    lo, hi = min(timing.ratios), max(timing.ratios)
    if timing.cut_short or timing.noisy:
        return _(
            "[bold green]PASS[/bold green]: every prompt decoded in the batch gives the tokens of its own "
            "uncached run; the machine was too busy to compare their speed (the {k} runs alone / the "
            "batch: {lo:.1f}× to {hi:.1f}× over {rounds} interleaved pairs)"
        ).format(k=k, lo=lo, hi=hi, rounds=timing.rounds)
    return _(
        "[bold green]PASS[/bold green]: every prompt decoded in the batch gives the tokens of its own "
        "uncached run; the {k} runs alone took {ratio:.1f}× the time of the batch (median of {rounds} "
        "interleaved pairs, {lo:.1f}× to {hi:.1f}×)"
    ).format(k=k, ratio=timing.median_ratio, rounds=timing.rounds, lo=lo, hi=hi)


generate_cmd.help_values = {"temperature": DEFAULT_TEMPERATURE, "top_k": DEFAULT_TOP_K}  # type: ignore[attr-defined]


def register(app: typer.Typer) -> None:
    app.command("generate", help=_HELP)(generate_cmd)
