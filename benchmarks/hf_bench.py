"""Speed of selfattention.hf inside transformers models, as a ratio to transformers' own sdpa and eager.

Tiny random-weight models built from configs (no download): BERT (encoder) and Llama with grouped-query
heads (decoder, causal), hidden 128, 2 layers, 4 heads of head_dim 32 (Llama: 2 key/value heads). One
process; the three attention implementations run on the **same** model object in interleaved rounds
(the order rotates every round), so the machine's load hits them alike; the figure is the median of the
rounds, and the ratios are taken against the other implementations of the same rounds.

    .venv/bin/python benchmarks/hf_bench.py --seq-lens 256 2048 --rounds 15 --threads 1
    .venv/bin/python benchmarks/hf_bench.py --json out/hf_bench.json

Forward passes only (``torch.no_grad()``, batch 1, float32, no padding: transformers passes no mask and
``is_causal`` alone describes the decoder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

IMPLS = ("sdpa", "eager", "selfattention")


def build(kind: str, seed: int = 0) -> torch.nn.Module:
    import transformers as tf

    common = dict(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    if kind == "bert":
        return tf.BertModel(tf.BertConfig(**common)).eval()
    if kind == "llama":
        return tf.LlamaModel(tf.LlamaConfig(**common, num_key_value_heads=2)).eval()
    raise ValueError(f"unknown model {kind!r}")


def time_forward(model: torch.nn.Module, impl: str, ids: torch.Tensor) -> float:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        start = time.perf_counter()
        model(input_ids=ids)
        return time.perf_counter() - start


def bench(kind: str, seq_len: int, rounds: int, warmup: int) -> dict:
    model = build(kind)
    ids = torch.randint(1, 1000, (1, seq_len), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for r in range(warmup + rounds):
        order = IMPLS[r % 3 :] + IMPLS[: r % 3]
        for impl in order:
            t = time_forward(model, impl, ids)
            if r >= warmup:
                times[impl].append(t)
    med = {impl: statistics.median(ts) for impl, ts in times.items()}
    # per-round ratios, then their median: robust to a slow round that hit one implementation
    ratio_sdpa = statistics.median(a / b for a, b in zip(times["selfattention"], times["sdpa"], strict=True))
    ratio_eager = statistics.median(
        a / b for a, b in zip(times["selfattention"], times["eager"], strict=True)
    )
    return {
        "model": kind,
        "seq_len": seq_len,
        "median_s": med,
        "ours_over_sdpa": ratio_sdpa,
        "ours_over_eager": ratio_eager,
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["bert", "llama"], choices=["bert", "llama"])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[256, 2048])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--backend",
        default=None,
        choices=["torch", "tiled", "reference"],
        help="run selfattention.hf on this backend instead of its default (selfattention.hf.BACKEND)",
    )
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import selfattention.hf as sahf

    sahf.register()
    if args.backend is not None:
        sahf.BACKEND = args.backend
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    rows = []
    print(f"selfattention.hf backend = {sahf.BACKEND!r}; torch {torch.__version__}, {args.threads} thread(s)")
    print("| model | T | sdpa ms | eager ms | selfattention ms | ours / sdpa | ours / eager |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind in args.models:
        for seq_len in args.seq_lens:
            row = bench(kind, seq_len, args.rounds, args.warmup)
            rows.append(row)
            m = row["median_s"]
            print(
                f"| {kind} | {seq_len} | {1e3 * m['sdpa']:.2f} | {1e3 * m['eager']:.2f} | "
                f"{1e3 * m['selfattention']:.2f} | {row['ours_over_sdpa']:.3f} | {row['ours_over_eager']:.3f} |",
                flush=True,
            )
    load1 = os.getloadavg()[0]
    print(
        f"load average at start/end: {load0:.2f} / {load1:.2f}; {platform.processor() or platform.machine()}"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "backend": sahf.BACKEND,
                    "torch": torch.__version__,
                    "threads": args.threads,
                    "load": [load0, load1],
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
