"""Sliding windows of several sizes through ``tiled_attention(window=W, is_causal=True)``: forward and forward
+ backward, beside SDPA's causal forward at T = 4096 in the same rounds (for before/after comparisons: run
it with ``PYTHONPATH`` on each tree, one after the other).

Usage::

    OMP_NUM_THREADS=2 PYTHONPATH=src .venv/bin/python benchmarks/window_bench.py 16384:512 16384:64 1000:512
    OMP_NUM_THREADS=2 PYTHONPATH=src .venv/bin/python benchmarks/window_bench.py --kernel   # fused-kernel shapes
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings

import torch

from selfattention.tiled import tiled_attention

H, D = 8, 64
_OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _medians(fns: dict, rounds: int) -> dict:
    for fn in fns.values():
        fn()
    ts = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            t = time.perf_counter()
            fn()
            ts[n].append(time.perf_counter() - t)
    return {n: statistics.median(x) for n, x in ts.items()}


def windows(cases: list[tuple[int, int]], rounds: int) -> None:
    q4, k4, v4 = (torch.randn(1, H, 4096, D) for _ in range(3))
    fns = {"sdpa causal T=4096 fwd": lambda: _OP(q4, k4, v4, 0.0, True, scale=D**-0.5)}
    for t, w in cases:
        q, k, v = (torch.randn(1, H, t, D, requires_grad=True) for _ in range(3))

        def fwd(q=q, k=k, v=v, w=w):
            with torch.no_grad():
                tiled_attention(q, k, v, window=w, is_causal=True)

        def fwd_bwd(q=q, k=k, v=v, w=w):
            for x in (q, k, v):
                x.grad = None
            tiled_attention(q, k, v, window=w, is_causal=True).sum().backward()

        fns[f"T={t} W={w} fwd"] = fwd
        fns[f"T={t} W={w} fwd+bwd"] = fwd_bwd
    med = _medians(fns, rounds)
    ref = med["sdpa causal T=4096 fwd"]
    for n, m in med.items():
        print(f"{n:28s} {m * 1e3:9.1f} ms   {m / ref:6.2f}× SDPA causal T=4096 fwd")


def kernel_shapes(rounds: int, t: int = 16384, w: int = 512) -> None:
    """The fused forward alone on stacked window bands (rows × keys per band), against SDPA causal with the
    same visible pairs: the kernel's own rate on the shapes the plan hands it."""
    q, k, v = (torch.randn(1, H, t, D) for _ in range(3))
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    tp = 4064
    qp, kp, vp = (torch.randn(1, H, tp, D) for _ in range(3))
    fns = {"mm": lambda: a @ b, "sdpa causal": lambda: _OP(qp, kp, vp, 0.0, True, scale=D**-0.5)}
    work = {"sdpa causal": (H * tp * (tp + 1) // 2, 0)}
    for rows, cols in ((32, 543), (32, 544), (64, 576), (128, 639), (128, 640), (256, 768)):
        back = w - 1
        n = (t - back) // rows
        qv = q[0, :, back : back + n * rows].unflatten(1, (n, rows))
        kb = k[0, :, : (n - 1) * rows + cols].unfold(1, cols, rows).transpose(-1, -2)
        vb = v[0, :, : (n - 1) * rows + cols].unfold(1, cols, rows).transpose(-1, -2)
        i, j = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
        lo = cols - rows - back  # the first key column of row 0's window
        ok = (j >= i + lo) & (j <= i + lo + back)
        bias = torch.zeros(rows, cols).masked_fill(~ok, -math.inf)[None, None]
        name = f"band {rows} x {cols}"
        fns[name] = lambda qv=qv, kb=kb, vb=vb, bias=bias: _OP(
            qv, kb, vb, 0.0, False, attn_mask=bias, scale=0.125
        )
        work[name] = (H * n * rows * w, H * n * rows * cols)
    med = _medians(fns, rounds)
    rate = 2 * 2048**3 / med["mm"]
    print(f"float32 matmul rate {rate / 1e9:.0f} GFLOP/s; fractions of it (4·D per pair)")
    for name, (vis, comp) in work.items():
        s = f"{name:16s} {med[name] * 1e3:8.1f} ms   visible {4 * D * vis / med[name] / rate:5.2f}"
        if comp:
            s += f"   computed {4 * D * comp / med[name] / rate:5.2f}"
        print(s)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "cases", nargs="*", default=["16384:512", "16384:64", "16384:256", "16384:1000", "1000:512"]
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernel", action="store_true", help="the fused kernel alone on band shapes")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, rounds {args.rounds} (medians)")
    if args.kernel:
        kernel_shapes(args.rounds)
    else:
        windows([tuple(int(x) for x in c.split(":")) for c in args.cases], args.rounds)


if __name__ == "__main__":
    main()
