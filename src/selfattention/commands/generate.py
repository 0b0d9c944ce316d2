"""``selfattention generate``: greedy text from the small decoder, with or without the KV cache."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from . import UsageError, console


def _timed_generate(model, prompt_ids, tokens: int, use_cache: bool):
    from ..decoder import generate

    t0 = time.perf_counter()
    out = generate(model, prompt_ids, tokens, use_cache=use_cache)
    return out.tolist(), time.perf_counter() - t0


def generate_cmd(
    prompt: str = typer.Option("The ", "--prompt", "-p", help="Text to continue."),
    tokens: int = typer.Option(200, "--tokens", "-n", min=0, help="How many characters to generate."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Recompute the whole sequence for every token."),
    check: bool = typer.Option(
        False, "--check", help="Generate both ways, verify the tokens are identical, compare speed."
    ),
    checkpoint: Path = typer.Option(
        None,
        "--checkpoint",
        help="A .safetensors checkpoint (with its .json). Default: ~/.cache/selfattention/decoder.safetensors, "
        "trained on first use (about a minute).",
    ),
) -> None:
    """Continue --prompt greedily with the small decoder and print tokens/s. With the KV cache (default)
    each new token costs one single-token step; --no-cache recomputes everything; both give the same text."""
    from ..decoder import TRAIN_MAX_SECONDS, TRAIN_STEPS, CheckpointError, default_checkpoint, load_checkpoint
    from .train import train_with_progress

    path = Path(checkpoint) if checkpoint is not None else default_checkpoint()
    if path.suffix != ".safetensors":
        raise UsageError(f"--checkpoint must name a .safetensors file, got {path}")
    if not path.exists():
        if checkpoint is not None and path.with_suffix(".json").exists():
            raise UsageError(f"{path} is missing but its config {path.with_suffix('.json')} exists")
        console.print(f"[yellow]no checkpoint at {path}: training one first[/yellow]")
        train_with_progress(path, TRAIN_STEPS, TRAIN_MAX_SECONDS)
    try:
        model, tok, info = load_checkpoint(path)
    except (CheckpointError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    if not prompt:
        raise UsageError("--prompt must not be empty")
    try:
        ids = tok.encode(prompt)
    except ValueError as e:
        raise UsageError(f"--prompt: {e}") from None
    ctx = model.config.context
    if len(ids) + tokens > ctx:
        raise UsageError(
            f"--prompt ({len(ids)} characters) + --tokens {tokens} = {len(ids) + tokens} exceed the model's "
            f"context of {ctx} positions; use at most --tokens {max(0, ctx - len(ids))}"
        )

    modes = [True, False] if check else [not no_cache]
    results = {}
    for use_cache in modes:
        results[use_cache] = _timed_generate(model, ids, tokens, use_cache)
    out, _ = results[modes[0]]
    from rich.text import Text

    # The prompt bold, the continuation plain; both are user/model text, never parsed as markup.
    # (Text(prompt, style="bold") + Text(...) would make the whole line bold: the base style is kept.)
    console.print(Text.assemble((prompt, "bold"), tok.decode(out)), highlight=False)
    for use_cache in modes:
        n_out, secs = results[use_cache]
        rate = len(n_out) / secs if secs > 0 else float("inf")
        label = "with KV cache" if use_cache else "without cache (recompute)"
        console.print(f"{len(n_out)} tokens in {secs:.3f} s = [bold]{rate:.1f} tokens/s[/bold] {label}")
    if check:
        same = results[True][0] == results[False][0]
        speedup = results[False][1] / max(results[True][1], 1e-12)
        if not same:
            first = next(
                i for i, (a, b) in enumerate(zip(*(results[m][0] for m in modes), strict=True)) if a != b
            )
            raise UsageError(f"cached and uncached generation differ (first at token {first})")
        console.print(f"[green]identical tokens[/green] both ways; the cache was {speedup:.1f}× faster")


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_cmd)
