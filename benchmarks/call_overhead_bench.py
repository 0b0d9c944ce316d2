"""One dense and one causal call at T = 1024 (H = 8, D = 64, float32): this library's tiled backend vs torch SDPA vs
the bare vendor op it calls, 30 interleaved rounds, medians (the per-call overhead around the kernel). The order
of the three rotates every round: the first op after a 10 ms kernel runs on caches the kernel emptied (tens of
µs more, measured here), so a contender that always follows the bare vendor op would pay that for it.

    .venv/bin/python benchmarks/call_overhead_bench.py
"""

import statistics
import time

import torch
import torch.nn.functional as F

import selfattention as sa

torch.manual_seed(0)
T = 1024
q, k, v = (torch.randn(1, 8, T, 64) for _ in range(3))
for causal in (False, True):
    fs = {
        "ours": lambda causal=causal: sa.scaled_dot_product_attention(
            q, k, v, is_causal=causal, backend="tiled"
        ),
        "sdpa": lambda causal=causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "vendor": lambda causal=causal: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=0.125
        ),
    }
    for f in fs.values():
        f()
        f()
    ts = {n: [] for n in fs}
    names = list(fs)
    for r in range(30):
        for n in names[r % 3 :] + names[: r % 3]:
            f = fs[n]
            t0 = time.perf_counter()
            f()
            ts[n].append(time.perf_counter() - t0)
    m = {n: statistics.median(x) * 1e3 for n, x in ts.items()}
    print(
        "causal" if causal else "dense",
        {n: round(x, 2) for n, x in m.items()},
        "ours/sdpa %.3f" % (m["ours"] / m["sdpa"]),
    )
