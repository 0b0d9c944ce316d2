"""The generic block plan (a plain mask_mod) in row chunks on single-threaded workers vs in one thread's order.

A sliding window written as a plain function (nothing for the engine to recognise: blocks classified full
/ partial / skipped, ~100 kernel calls, tiles and merges per forward at T = 4096) through
``selfattention.flex_attention``, with the chunked path (kernels/row_chunks.py) and with it switched off,
against torch SDPA with the same dense bool mask; quiet and with one core kept busy by
:class:`selfattention.bench.Spinner`, in interleaved rounds of one process (medians).

    PYTHONPATH=src .venv/bin/python benchmarks/row_chunks_bench.py              # forward, T = 4096
    PYTHONPATH=src .venv/bin/python benchmarks/row_chunks_bench.py --backward   # forward + backward
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from selfattention import create_block_mask, flex_attention
from selfattention.bench import Spinner
from selfattention.kernels import row_chunks


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args(argv)
    t, w = args.t, args.window
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, t, 64, requires_grad=args.backward) for _ in range(3))

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w)

    bm = create_block_mask(window, None, None, t, t)
    i = torch.arange(t)
    dense = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < w)

    def run(fn):
        out = fn()
        if args.backward:
            out.sum().backward()

    chunked = row_chunks.chunked

    def in_order():
        row_chunks.chunked = lambda *a: None
        try:
            run(lambda: flex_attention(q, k, v, block_mask=bm))
        finally:
            row_chunks.chunked = chunked

    contenders = {
        "row chunks": lambda: run(lambda: flex_attention(q, k, v, block_mask=bm)),
        "in order": in_order,
        "sdpa (bool mask)": lambda: run(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)),
    }
    for fn in contenders.values():
        fn()
    times = {(n, m): [] for n in contenders for m in ("quiet", "busy")}
    with Spinner() as spin:
        for _ in range(args.rounds):
            for mode in ("quiet", "busy"):
                spin.busy(mode == "busy")
                time.sleep(0.05)
                for name, fn in contenders.items():
                    t0 = time.perf_counter()
                    fn()
                    times[(name, mode)].append(time.perf_counter() - t0)
            spin.busy(False)
    pass_ = "forward + backward" if args.backward else "forward"
    print(
        f"T = {t}, window {w}, H = {args.heads}, D = 64, float32, {pass_}, {torch.get_num_threads()} threads"
    )
    print("| path | quiet ms | busy ms | busy / quiet | / sdpa quiet | / sdpa busy |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    med = {key: statistics.median(ts) * 1e3 for key, ts in times.items()}
    for name in contenders:
        qm, bm_ = med[(name, "quiet")], med[(name, "busy")]
        sq, sb = med[("sdpa (bool mask)", "quiet")], med[("sdpa (bool mask)", "busy")]
        print(f"| {name} | {qm:.1f} | {bm_:.1f} | {bm_ / qm:.2f} | {qm / sq:.2f} | {bm_ / sb:.2f} |")


if __name__ == "__main__":
    main()
