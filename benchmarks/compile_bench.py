"""Compiled forward of selfattention's attention against compiled torch SDPA, in one process.

Each backend (reference, torch, tiled) is compiled with ``torch.compile(fullgraph=True)`` (inductor), as is
``torch.nn.functional.scaled_dot_product_attention`` on the same inputs; the script prints the median time
of each and the ratio ours / SDPA (both compiled), and the eager ratio beside it. Interleaved rounds, so a
busy machine slows both sides alike.

    python benchmarks/compile_bench.py                       # T = 1024, H = 8, D = 64, causal and dense
    python benchmarks/compile_bench.py --seq 4096 --rounds 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as tnf

import selfattention as sa


def _time(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--backends", default="reference,torch,tiled")
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(a.batch, a.heads, a.seq, a.dim, generator=g) for _ in range(3))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, (B, H, T, D) = "
          f"({a.batch}, {a.heads}, {a.seq}, {a.dim}), float32, forward only, median of {a.rounds}")  # fmt: skip
    print(f"{'case':<22}{'eager ms':>10}{'compiled ms':>13}{'SDPA eager':>12}{'SDPA comp.':>12}"
          f"{'eager ratio':>13}{'compiled ratio':>16}")  # fmt: skip
    for causal in (True, False):
        sdpa = lambda q, k, v, c=causal: tnf.scaled_dot_product_attention(q, k, v, is_causal=c)  # noqa: E731
        torch._dynamo.reset()
        sdpa_c = torch.compile(sdpa, fullgraph=True)
        with torch.no_grad():
            sdpa_c(q, k, v)
            for backend in a.backends.split(","):

                def ours(q, k, v, b=backend, c=causal):
                    return sa.scaled_dot_product_attention(q, k, v, is_causal=c, backend=b)

                ours_c = torch.compile(ours, fullgraph=True)
                want = sdpa(q, k, v)
                err = (ours_c(q, k, v) - want).abs().max().item()
                ours(q, k, v)
                times: dict[str, list[float]] = {"oe": [], "oc": [], "se": [], "sc": []}
                for _ in range(a.rounds):  # interleaved
                    times["oe"].append(_time(ours, q, k, v))
                    times["oc"].append(_time(ours_c, q, k, v))
                    times["se"].append(_time(sdpa, q, k, v))
                    times["sc"].append(_time(sdpa_c, q, k, v))
                m = {key: statistics.median(ts) * 1e3 for key, ts in times.items()}
                name = f"{backend} {'causal' if causal else 'dense'}"
                print(f"{name:<22}{m['oe']:>10.2f}{m['oc']:>13.2f}{m['se']:>12.2f}{m['sc']:>12.2f}"
                      f"{m['oe'] / m['se']:>12.2f}x{m['oc'] / m['sc']:>15.2f}x   max|diff| {err:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
