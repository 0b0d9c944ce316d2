"""Speed of selfattention.hf inside transformers models, as a ratio to transformers' own sdpa and eager.

Tiny random-weight models built from configs (no download): BERT (encoder), Llama with grouped-query
heads (decoder, causal), T5 (relative position bias), Mistral and Qwen2 with a small sliding window (32)
and gpt-oss (attention sinks, window 32; transformers has no sdpa path for it: eager is its peer),
hidden 128, 2 layers, 4 heads of head_dim 32 (2 key/value heads where the architecture has them). One
process; the three attention implementations run on the **same** model object in interleaved rounds
(the order rotates every round), so the machine's load hits them alike; a round's sample of one
implementation is the median of ``--calls`` (default 5) forwards in a row, the figure is the median of the
rounds, and the ratios are taken against the other implementations of the same rounds. (One forward of a
2-layer model at T = 256 takes 3–6 ms; on a virtual machine whose speed varies between runs, one call per
sample gave ours / sdpa anywhere in 1.02–1.20 for the same code, five calls per sample 1.01–1.09.)

    .venv/bin/python benchmarks/hf_bench.py --seq-lens 256 2048 --rounds 15 --threads 1
    .venv/bin/python benchmarks/hf_bench.py --json out/hf_bench.json
    .venv/bin/python benchmarks/hf_bench.py --models t5 mistral qwen2 gpt_oss --seq-lens 256
    .venv/bin/python benchmarks/hf_bench.py --memory            # peak memory, one process per figure
    .venv/bin/python benchmarks/hf_bench.py --models t5 --backward   # forward + backward (training)
    .venv/bin/python benchmarks/hf_bench.py --seq-lens 256 --contended  # also with one core kept busy

``--memory`` prints peak memory (growth of the process's peak resident set during the first call, in a
fresh process per figure; the time is the second call's): a Mistral with window 128 at T = 8192 under sdpa and ours, and one
gpt-oss-shaped attention call (4 heads of 16, window 128, s_aux sinks per head, then per-query sinks (1, H, T, 1)) through the materialising route
(a (B, H, T, T + 1) float mask with a sink column: the route before the lazy masks, which the weights
path still takes) and through the lazy mask on the engine (out · σ(lse − sink)).

Forward passes (``torch.no_grad()``), or with ``--backward`` forward + backward of the last hidden state's
sum in eval mode (every parameter's gradient: T5's relative position bias requires grad, which sends
transformers' sdpa to its math path); batch 1, float32, no padding (transformers passes no mask and
``is_causal`` alone describes the decoder).

``--contended``: every round runs each implementation twice, quiet and while
:class:`selfattention.bench.Spinner` (``selfattention bench --contended``'s background load, one process
spinning on one core) runs, and prints both ratios and contended / quiet. With the default ``--threads 1``
the measured process uses one core; ``--threads 2`` shows what a busy core does to two-thread kernels.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
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
    common["max_position_embeddings"] = 16384
    torch.manual_seed(seed)
    window = 128 if kind == "mistral_long" else 32
    if kind == "bert":
        return tf.BertModel(tf.BertConfig(**common)).eval()
    if kind == "llama":
        return tf.LlamaModel(tf.LlamaConfig(**common, num_key_value_heads=2)).eval()
    if kind in ("mistral", "mistral_long"):
        return tf.MistralModel(
            tf.MistralConfig(**common, num_key_value_heads=2, sliding_window=window)
        ).eval()
    if kind == "qwen2":
        cfg = tf.Qwen2Config(**common, num_key_value_heads=2, use_sliding_window=True, sliding_window=window,
                             max_window_layers=0, layer_types=["sliding_attention"] * 2)  # fmt: skip
        return tf.Qwen2Model(cfg).eval()
    if kind == "gpt_oss":
        cfg = tf.GptOssConfig(**{**common, "intermediate_size": 128}, num_key_value_heads=2, head_dim=32,
                              num_local_experts=2, num_experts_per_tok=1, sliding_window=window,
                              layer_types=["sliding_attention", "full_attention"])  # fmt: skip
        model = tf.GptOssModel(cfg).eval()
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
        return model
    if kind == "t5":
        cfg = tf.T5Config(vocab_size=1000, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
                          relative_attention_num_buckets=32, pad_token_id=0, decoder_start_token_id=0)  # fmt: skip
        return tf.T5Model(cfg).eval()
    raise ValueError(f"unknown model {kind!r}")


MODELS = ("bert", "llama", "t5", "mistral", "qwen2", "gpt_oss")
NO_SDPA = {"gpt_oss"}  # transformers runs gpt-oss' sinks on eager only


def _inputs(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    if model.config.model_type == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids}
    return {"input_ids": ids}


def time_forward(
    model: torch.nn.Module, impl: str, ids: torch.Tensor, backward: bool = False, calls: int = 1
) -> float:
    """Seconds of one forward (``torch.no_grad()``), or of forward + backward of the last hidden state's
    sum (``backward``: every parameter gets its gradient, T5's relative position bias included): the
    median of ``calls`` timed calls in a row.

    The implementation is switched before each sample (the rounds interleave them) and one untimed forward
    follows the switch: a model's first call after ``set_attn_implementation`` pays for the switch
    (measured at T = 256: +0.15 ms for ours, 4 % of a BERT forward; a user sets it once)."""
    model.set_attn_implementation(impl)
    with torch.no_grad():
        model(**_inputs(model, ids))
    times = []
    for _ in range(calls):
        if backward:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            model(**_inputs(model, ids)).last_hidden_state.sum().backward()
        else:
            with torch.no_grad():
                start = time.perf_counter()
                model(**_inputs(model, ids))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ratio(times: dict[str, list[float]], peer: str) -> float:
    """The median of the per-round ratios ours / peer (robust to a slow round that hit one of them)."""
    if peer not in times or not times[peer]:
        return math.nan
    return statistics.median(a / b for a, b in zip(times["selfattention"], times[peer], strict=True))


def bench(
    kind: str,
    seq_len: int,
    rounds: int,
    warmup: int,
    backward: bool = False,
    contended: bool = False,
    calls: int = 1,
) -> dict:
    """One model at one length: every implementation on the same model, interleaved rounds. With
    ``contended`` every round runs each implementation twice, once quiet and once while
    :class:`selfattention.bench.Spinner` keeps one core busy, so both ratios come from the same minutes."""
    model = build(kind)
    ids = torch.randint(1, 1000, (1, seq_len), generator=torch.Generator().manual_seed(1))
    impls = tuple(i for i in IMPLS if not (i == "sdpa" and kind in NO_SDPA))
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    busy: dict[str, list[float]] = {impl: [] for impl in impls}
    spinner = None
    if contended:
        from selfattention.bench import Spinner

        spinner = Spinner()
    try:
        for r in range(warmup + rounds):
            order = impls[r % len(impls) :] + impls[: r % len(impls)]
            for mode in ("quiet", "busy") if contended else ("quiet",):
                if spinner is not None:
                    spinner.busy(mode == "busy")
                for impl in order:
                    t = time_forward(model, impl, ids, backward, calls)
                    if r >= warmup:
                        (busy if mode == "busy" else times)[impl].append(t)
    finally:
        if spinner is not None:
            spinner.close()
    med = {impl: statistics.median(ts) for impl, ts in times.items()}
    med.setdefault("sdpa", math.nan)
    row = {
        "model": kind,
        "seq_len": seq_len,
        "pass": "fwd+bwd" if backward else "fwd",
        "median_s": med,
        "ours_over_sdpa": _ratio(times, "sdpa"),
        "ours_over_eager": _ratio(times, "eager"),
        "rounds": rounds,
        "calls": calls,
    }
    if contended:
        row["median_s_contended"] = {impl: statistics.median(ts) for impl, ts in busy.items()}
        row["ours_over_sdpa_contended"] = _ratio(busy, "sdpa")
        row["ours_over_eager_contended"] = _ratio(busy, "eager")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--memory", action="store_true", help="peak memory figures instead (see the doc)")
    parser.add_argument("--peak", nargs=3, default=None, help=argparse.SUPPRESS)  # one figure, in a child
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[256, 2048])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--calls",
        type=int,
        default=5,
        help="timed calls in a row per implementation and round; a sample is their median (1: one call)",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)"
    )
    parser.add_argument(
        "--backward", action="store_true", help="time forward + backward (gradients) instead of forward"
    )
    parser.add_argument(
        "--contended",
        action="store_true",
        help="also time every round with one core kept busy (selfattention.bench.Spinner); use --threads 2",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--backend",
        default=None,
        choices=["torch", "tiled", "reference"],
        help="run selfattention.hf on this backend instead of its default (selfattention.hf.BACKEND)",
    )
    args = parser.parse_args(argv)
    if args.peak is not None:
        print(peak_child(*args.peak))
        return 0
    if args.memory:
        return memory_table(args.threads)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import selfattention.hf as sahf

    sahf.register()
    if args.backend is not None:
        sahf.BACKEND = args.backend
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]
    rows = []
    passes = "forward + backward" if args.backward else "forward"
    print(f"selfattention.hf backend = {sahf.BACKEND!r}; torch {torch.__version__}, {args.threads} thread(s), "
          f"{passes}, {args.rounds} rounds of {args.calls} calls")  # fmt: skip
    if args.contended:
        print("quiet and contended (a spinner keeps one core busy in every other pass of each round):")
        print("| model | T | sdpa ms | selfattention ms | ours / sdpa | ours / eager | busy: sdpa ms "
              "| busy: selfattention ms | busy: ours / sdpa | busy: ours / eager | busy / quiet (sdpa) |")  # fmt: skip
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    else:
        print("| model | T | sdpa ms | eager ms | selfattention ms | ours / sdpa | ours / eager |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind in args.models:
        for seq_len in args.seq_lens:
            row = bench(kind, seq_len, args.rounds, args.warmup, args.backward, args.contended, args.calls)
            rows.append(row)
            m = row["median_s"]
            if args.contended:
                b = row["median_s_contended"]
                base = row["ours_over_sdpa"] if kind not in NO_SDPA else row["ours_over_eager"]
                loaded = (
                    row["ours_over_sdpa_contended"]
                    if kind not in NO_SDPA
                    else row["ours_over_eager_contended"]
                )
                print(
                    f"| {kind} | {seq_len} | {1e3 * m['sdpa']:.2f} | {1e3 * m['selfattention']:.2f} | "
                    f"{row['ours_over_sdpa']:.3f} | {row['ours_over_eager']:.3f} | "
                    f"{1e3 * b.get('sdpa', math.nan):.2f} | {1e3 * b['selfattention']:.2f} | "
                    f"{row['ours_over_sdpa_contended']:.3f} | {row['ours_over_eager_contended']:.3f} | "
                    f"{loaded / base:.3f} |",
                    flush=True,
                )
                continue
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


def _rss_peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def peak_child(what: str, route: str, seq_len: str) -> str:
    """One figure in this (fresh) process: seconds and peak-RSS growth (MiB) of the measured call."""
    import selfattention.hf as sahf

    sahf.register()
    torch.set_num_threads(1)
    t = int(seq_len)
    if what == "model":
        model = build("mistral_long")
        ids = torch.randint(1, 1000, (1, t), generator=torch.Generator().manual_seed(1))
        model.set_attn_implementation(route)
        run = lambda: model(input_ids=ids)  # noqa: E731
    else:  # one gpt-oss-shaped call: 4 heads of 16, window 128, sinks
        from transformers import masking_utils as mu

        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 4, t, 16, generator=g) for _ in range(3))
        sinks = torch.randn(4, generator=g)
        per_query = what == "call_per_query"  # (B, H, Tq, 1): a sink logit per query
        if per_query:
            sinks = torch.randn(1, 4, t, 1, generator=g)
        sink_arg = {"sinks": sinks} if per_query else {"s_aux": sinks}
        module = type("M", (), {"is_causal": True, "training": False, "config": None})()
        fn = mu.sliding_window_causal_mask_function(128)
        if route == "dense":  # the materialising route: dense bool mask, sink column (inside recording())
            mask = mu.sdpa_mask(1, t, t, mask_function=fn, allow_is_causal_skip=False)
        else:
            mask = sahf.attention_mask(1, t, t, mask_function=fn)

        def run():
            if route == "dense":
                with sahf.recording():
                    return sahf.attention_forward(module, q, k, v, mask, scaling=0.25, **sink_arg)
            return sahf.attention_forward(module, q, k, v, mask, scaling=0.25, **sink_arg)

    with torch.no_grad():
        base = _rss_peak_mib()
        run()  # the first call: its peak is the figure (large blocks go back to the system when freed)
        peak = _rss_peak_mib() - base
        start = time.perf_counter()
        run()  # the second, warm: its time is the figure
        sec = time.perf_counter() - start
    return json.dumps({"seconds": sec, "peak_mib": peak})


def memory_table(threads: int) -> int:
    def child(*a: str) -> dict:
        out = subprocess.run([sys.executable, __file__, "--threads", str(threads), "--peak", *a],
                             check=True, capture_output=True, text=True).stdout  # fmt: skip
        return json.loads(out.strip().splitlines()[-1])

    print("peak memory: growth of the process's peak RSS during the first call, a fresh process per figure")
    print("(inputs and model built before); time: the second call")
    print("| what | T | peer | peer MiB | peer ms | ours MiB | ours ms | ours / peer time |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for what, peer, ours, lens in (
        ("gpt-oss call, sinks, window 128", "dense", "lazy", (2048, 4096, 8192)),
        ("the same, per-query sinks (1, H, T, 1)", "dense", "lazy", (2048, 8192)),
        ("Mistral, window 128, 2 layers", "sdpa", "selfattention", (8192,)),
    ):
        for t in lens:
            kind = "model" if peer != "dense" else "call_per_query" if "per-query" in what else "call"
            p = child(kind, peer, str(t))
            o = child(kind, ours, str(t))
            print(f"| {what} | {t} | {peer} | {p['peak_mib']:.0f} | {1e3 * p['seconds']:.1f} | "
                  f"{o['peak_mib']:.0f} | {1e3 * o['seconds']:.1f} | {o['seconds'] / p['seconds']:.2f} |",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
