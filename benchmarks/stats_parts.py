"""Where the time of ``tiled_attention_with_stats`` goes, against SDPA's causal forward, in one process.

Usage: ``.venv/bin/python benchmarks/stats_parts.py [T] [rounds]`` (default 4096, 3; H = 8, D = 64, causal,
float32). Interleaved rounds; prints median ms and the ratio to SDPA of:

* the engine's forward (output + log-sum-exp), and the same with values [v | k] (the entropy's
  Σ_j α_ij k_j from the output's own call — the fused CPU kernel pads q and k to 128 for it);
* column sums as the log-sum-exp of the transposed problem with −ℓ folded in (one fused call of width 65);
* the statistics sweep (top-4, entropy, column sums) as shipped (row tiles on single-threaded workers),
  and its ops run directly with torch's threads (the old way: every op a parallel region).
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from selfattention.kernels import engine, pool, stats, vendor
from selfattention.visibility import Visibility


def transposed_column_sums(q, k, lse, scale):
    """c_j = Σ_i exp(s_ij − ℓ_i) as one fused call: queries [k, 1], keys [scale·q, −ℓ], both reversed."""
    neg = torch.where(lse == -math.inf, -1e30, -lse)
    keys = torch.cat([q * scale, neg[..., None]], -1).flip(-2)
    queries = torch.cat([k, k.new_ones((*k.shape[:-1], 1))], -1).flip(-2)
    _, l = vendor.forward(queries, keys, keys, None, True, 1.0)
    return torch.exp(l.flip(-1))


def main() -> None:
    t = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, t, 64) for _ in range(3))
    prob = engine.make_problem(q, k, v, Visibility(t, t, is_causal=True), 0.125)
    _, lse = engine.forward(q, k, v, prob)
    vk = torch.cat([v, k], -1)

    def direct():  # the sweep with its ops on torch's threads, no workers
        real = pool.run
        pool.run = lambda fn, jobs: iter([fn(j) for j in jobs])
        try:
            return stats.sweep(q, k, lse, prob, 4, True)
        finally:
            pool.run = real

    fns = {
        "sdpa causal fwd": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "engine forward": lambda: engine.forward(q, k, v, prob),
        "forward, values [v|k]": lambda: engine.forward(q, k, vk, prob),
        "column sums, transposed call": lambda: transposed_column_sums(q, k, lse, 0.125),
        "sweep top-4 (workers)": lambda: stats.sweep(q, k, lse, prob, 4, True),
        "sweep top-4 (direct ops)": direct,
    }
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["sdpa causal fwd"])
    for name in fns:
        med = statistics.median(times[name])
        print(f"{name:32s} {med * 1000:8.1f} ms  {med / base:5.2f}x")


if __name__ == "__main__":
    main()
