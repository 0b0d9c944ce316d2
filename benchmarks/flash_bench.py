"""selfattention.flash against torch SDPA on the same problems, one process, interleaved rounds.

Problems (float32, CPU):

* varlen: 8 causal sequences of lengths 100 … 4000 (evenly spaced), H = 8, D = 64, packed as flash-attn
  wants (total, H, D) — ``flash_attn_varlen_func`` vs (a) the sum of one SDPA call per sequence (given
  contiguous (1, H, L, D) inputs, its best case) and (b) one SDPA call over the batch padded to the longest
  with a (B, 1, T, T) causal-and-padding mask; forward, and forward + backward;
* ``flash_attn_func`` vs SDPA on dense and causal (B, T, H, D) problems (SDPA gets (B, H, T, D)
  contiguous: the layout transpose is not timed), and a causal window (255, 0) vs the engine's window
  (``tiled_attention(window=256)``).

Each round times every variant once, in turn; the median of the rounds is reported with the ratio to
its peer (< 1 means ours is faster). Usage::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/flash_bench.py            # the real sizes
    .venv/bin/python benchmarks/flash_bench.py --quick                      # small sizes, for development
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from selfattention.flash import flash_attn_func, flash_attn_varlen_func
from selfattention.tiled import tiled_attention


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rounds(variants: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    for fn in variants.values():  # warm-up (plans, kernel self-checks)
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(_timed(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _report(title: str, med: dict[str, float], pairs: list[tuple[str, str]]) -> None:
    print(f"\n{title}")
    for name, t in med.items():
        print(f"  {name:<34} {t * 1e3:9.2f} ms")
    for ours, peer in pairs:
        print(f"  ratio {ours} / {peer}: {med[ours] / med[peer]:.3f}")


def varlen(lengths: list[int], h: int, d: int, rounds: int, backward: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    total, longest, b = sum(lengths), max(lengths), len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(total, h, d, generator=gen) for _ in range(3))
    seqs = [
        tuple(t[int(cu[i]) : int(cu[i + 1])].transpose(0, 1)[None].contiguous() for t in (q, k, v))
        for i in range(b)
    ]
    padded = [torch.zeros(b, h, longest, d) for _ in range(3)]
    for i, (qs, ks, vs) in enumerate(seqs):
        for dst, src in zip(padded, (qs, ks, vs), strict=True):
            dst[i, :, : src.shape[2]] = src[0]
    lens = torch.tensor(lengths)
    pos = torch.arange(longest)
    mask = (pos[None, :] <= pos[:, None])[None] & (pos[None, None, :] < lens[:, None, None])  # (B, T, T)
    mask = mask[:, None]
    if backward:
        for t in (q, k, v, *padded):
            t.requires_grad_()
        seqs = [tuple(t.requires_grad_() for t in s) for s in seqs]

    def run(out):
        if backward:
            out.sum().backward()

    def ours():
        run(flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True))

    def per_seq():
        for qs, ks, vs in seqs:
            run(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))

    def pad():
        run(F.scaled_dot_product_attention(*padded, attn_mask=mask))

    med = _rounds(
        {"flash_attn_varlen_func": ours, "SDPA per sequence (sum)": per_seq, "SDPA padded + mask": pad},
        rounds,
    )
    what = "forward + backward" if backward else "forward"
    _report(
        f"varlen {what}: {b} causal sequences {lengths}, H={h}, D={d}, total {total} tokens",
        med,
        [
            ("flash_attn_varlen_func", "SDPA per sequence (sum)"),
            ("flash_attn_varlen_func", "SDPA padded + mask"),
        ],
    )


def dense(batch: int, t: int, h: int, d: int, rounds: int, window: int) -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(batch, t, h, d, generator=gen) for _ in range(3))
    qs, ks, vs = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    variants = {
        "flash_attn_func": lambda: flash_attn_func(q, k, v),
        "SDPA": lambda: F.scaled_dot_product_attention(qs, ks, vs),
        "flash_attn_func causal": lambda: flash_attn_func(q, k, v, causal=True),
        "SDPA causal": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
        f"flash_attn_func window ({window - 1}, 0)": lambda: flash_attn_func(
            q, k, v, window_size=(window - 1, 0)
        ),
        f"tiled_attention window={window}": lambda: tiled_attention(qs, ks, vs, window=window),
    }
    med = _rounds(variants, rounds)
    _report(
        f"flash_attn_func forward: B={batch}, T={t}, H={h}, D={d}",
        med,
        [
            ("flash_attn_func", "SDPA"),
            ("flash_attn_func causal", "SDPA causal"),
            (f"flash_attn_func window ({window - 1}, 0)", f"tiled_attention window={window}"),
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (development)")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    if args.quick:
        lengths, rounds, t, window = [int(x) for x in torch.linspace(20, 400, 8).round().tolist()], 3, 512, 64
    else:
        lengths, rounds, t, window = (
            [int(x) for x in torch.linspace(100, 4000, 8).round().tolist()],
            5,
            4096,
            256,
        )
    rounds = args.rounds or rounds
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rounds} rounds (median)")
    torch.set_grad_enabled(False)
    varlen(lengths, 8, 64, rounds, backward=False)
    dense(2, t, 8, 64, rounds, window)
    torch.set_grad_enabled(True)
    varlen(lengths, 8, 64, rounds, backward=True)


if __name__ == "__main__":
    main()
