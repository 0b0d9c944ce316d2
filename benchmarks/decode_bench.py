"""Per-token decode time with and without the KV cache, context 128 … 8192 (B = 1).

Without a cache, generating the token after a context of T tokens recomputes the whole sequence: every
layer's projections for T tokens and the T × T attention, O(T²). With the cache only the new token's
query, key and value are computed and it attends over the T cached keys: O(T). This script measures both
on the same randomly initialised model (timing does not depend on the weights) in one run, and writes a
JSON file, a markdown table and a log-log plot.

    .venv/bin/python benchmarks/decode_bench.py            # defaults below; ~1–2 minutes on 2 cores

Checks printed at the end: the cached step is ≥ 20× faster than recomputing at context 4096, and the
cached cost grows linearly (time(8192) / time(4096) well under the 4× of quadratic growth).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from selfattention.decoder import Decoder, DecoderConfig

ROOT = Path(__file__).resolve().parents[1]


def _median_time(fn, repeats: int):
    """(median seconds of ``repeats`` calls, the last call's result)."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


@torch.inference_mode()
def measure(model: Decoder, contexts: list[int], steps: int, repeats: int) -> list[dict]:
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, max(contexts) + steps), generator=gen)
    rows = []
    model(ids[:, :64])  # warm-up
    for T in contexts:
        # cached: prefill T tokens, then time single-token steps at contexts T .. T + steps - 1
        caches = model.new_caches(1, T + steps)
        model(ids[:, :T], caches)
        step_times, first = [], None
        for i in range(steps):
            tok = ids[:, T + i : T + i + 1]
            t0 = time.perf_counter()
            logits = model(tok, caches)[:, -1]
            _ = logits.argmax(-1)
            step_times.append(time.perf_counter() - t0)
            first = logits if first is None else first
        cached = statistics.median(step_times)
        # uncached: the same step is a full forward over all T + 1 tokens, keeping the last logits
        seq = ids[:, : T + 1]
        reps = repeats if T <= 2048 else max(1, repeats // 2)
        uncached, full = _median_time(lambda seq=seq: model(seq)[:, -1], reps)
        # sanity: both paths give the same logits for the token at position T
        err = (full - first).abs().max().item()
        rows.append(
            {
                "context": T,
                "cached_ms": cached * 1e3,
                "uncached_ms": uncached * 1e3,
                "speedup": uncached / cached,
                "max_abs_logit_diff": err,
            }
        )
        print(
            f"context {T:5d}: cached {cached * 1e3:8.2f} ms/token   recompute {uncached * 1e3:9.1f} ms/token   "
            f"{uncached / cached:7.1f}×   (cached vs full logits differ by {err:.1e})",
            flush=True,
        )
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "| context T | with KV cache (ms/token) | recompute, no cache (ms/token) | speed-up |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['context']} | {r['cached_ms']:.2f} | {r['uncached_ms']:.1f} | {r['speedup']:.0f}× |"
        )
    lines.append("")
    lines.append(
        f"Model: {meta['model']}; B = 1, float32, backend {meta['backend']!r}, {meta['threads']} threads, "
        f"torch {meta['torch']}. Median of {meta['steps']} cached steps per context; of {meta['repeats']} "
        "recomputations up to T = 2048, fewer above."
    )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.loglog(T, [r["uncached_ms"] for r in rows], "o-", label="recompute (no cache)", color="tab:red")
    ax.loglog(T, [r["cached_ms"] for r in rows], "o-", label="KV cache", color="tab:blue")
    # reference slopes through the last point: linear (cache) and quadratic (recompute)
    t1, c1, u1 = T[-1], rows[-1]["cached_ms"], rows[-1]["uncached_ms"]
    ax.loglog(T, [c1 * t / t1 for t in T], ":", color="tab:blue", alpha=0.6, label="∝ T (linear)")
    ax.loglog(T, [u1 * (t / t1) ** 2 for t in T], ":", color="tab:red", alpha=0.6, label="∝ T² (quadratic)")
    ax.set_xlabel("context length T (tokens)")
    ax.set_ylabel("time per generated token (ms)")
    ax.set_title(title, fontsize=10)
    ax.set_xticks(T)
    ax.set_xticklabels([str(t) for t in T])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="128,256,512,1024,2048,4096,8192")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--backend", default="tiled", help="attention backend (default: the decoder's own, tiled)")
    p.add_argument("--steps", type=int, default=16, help="cached single-token steps timed per context")
    p.add_argument("--repeats", type=int, default=3, help="recomputations timed per context")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "decode_bench.json")
    p.add_argument("--md", type=Path, default=ROOT / "benchmarks" / "results" / "decode_bench.md")
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "decode_bench.png")
    args = p.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    backend = None if args.backend in ("none", "reference") else args.backend
    cfg = DecoderConfig(
        vocab_size=96,
        context=max(contexts) + args.steps + 1,
        d_model=args.d_model,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        num_layers=args.layers,
        backend=backend,
    )
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    n_params = sum(p.numel() for p in model.parameters())
    desc = (
        f"{cfg.num_layers} layers, d_model {cfg.d_model}, {cfg.num_heads} heads"
        + (f" ({cfg.num_kv_heads} KV heads)" if cfg.num_kv_heads else "")
        + f", {n_params / 1e6:.1f} M parameters"
    )
    print(f"decode benchmark: {desc}; backend {args.backend}; {torch.get_num_threads()} threads", flush=True)
    rows = measure(model, contexts, args.steps, args.repeats)
    meta = {
        "model": desc,
        "backend": args.backend,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "steps": args.steps,
        "repeats": args.repeats,
        "command": "python benchmarks/decode_bench.py",
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    args.md.parent.mkdir(parents=True, exist_ok=True)
    args.md.write_text(markdown(rows, meta))
    plot(rows, args.plot, f"Per-token decode time, {desc}")
    print(markdown(rows, meta))
    by_t = {r["context"]: r for r in rows}
    if 4096 in by_t:
        s = by_t[4096]["speedup"]
        print(
            f"at context 4096 a cached step is {s:.0f}× faster than recomputing ({'≥' if s >= 20 else '<'} 20×)"
        )
    if 4096 in by_t and 8192 in by_t:
        c = by_t[8192]["cached_ms"] / by_t[4096]["cached_ms"]
        u = by_t[8192]["uncached_ms"] / by_t[4096]["uncached_ms"]
        print(f"doubling 4096 → 8192: cached ×{c:.2f} (linear ≤ 2), recompute ×{u:.2f} (quadratic → 4)")
    print(f"wrote {args.json}, {args.md}, {args.plot}")


if __name__ == "__main__":
    main()
