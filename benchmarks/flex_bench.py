"""selfattention.flex_attention vs torch's compiled flex_attention and SDPA with the same dense bool mask.

One process, interleaved rounds (each round times every contender once; the median is reported), ratios
against the peers of the same run. Cases (issue 17's targets; H = 8, D = 64, B = 1, float32):

* sliding window 256 (attention-gym's ``q_idx - kv_idx <= 256``, causal; once more as a plain function,
  which ``create_block_mask`` recognises as the same window, mods/recognise.py) and prefix-LM 512 at
  T = 4096:
  forward vs torch's ``torch.compile(flex_attention)`` (compile time reported apart), forward and
  forward+backward vs SDPA with the dense bool mask (flex has no backward on CPU);
* sliding window 512 at T = 16384: forward and forward+backward as a fraction of this machine's float32
  matmul rate (a 2048² matmul measured in the same run) over the visible pairs (work = 4·D·pairs·H for
  the forward, × 2.5 for forward+backward);
* score mods at T = 4096, causal: ALiBi (a bias tile of the fused kernel) and tanh softcap 30 (the
  score-mod kernel): forward vs compiled flex, and our forward+backward.

Usage::

    OMP_NUM_THREADS=2 PYTHONPATH=src .venv/bin/python benchmarks/flex_bench.py            # the real sizes
    OMP_NUM_THREADS=2 PYTHONPATH=src .venv/bin/python benchmarks/flex_bench.py --quick    # small sizes
    OMP_NUM_THREADS=2 PYTHONPATH=src .venv/bin/python benchmarks/flex_bench.py --window-only  # W = 512 rows
    OMP_NUM_THREADS=2 PYTHONPATH=src .venv/bin/python benchmarks/flex_bench.py --window-only --contended
"""

from __future__ import annotations

import os

# MKL's dynamic threading ran the 2048² reference matmul on one of the two threads in some processes and
# on both in others (108 vs 172 GFLOP/s measured here, 2026-12-02): with it off the rate is the machine's.
# Set before torch loads MKL; every contender of the run shares the setting. Override from the shell.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import selfattention as sa
from selfattention import mods


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _interleaved(contenders: dict, rounds: int) -> dict:
    for fn in contenders.values():  # warm-up
        fn()
    times = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):  # the order rotates: no contender always runs right after the same other one
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(_time(contenders[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _fwd_bwd(fn, q, k, v):
    def run():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).sum().backward()

    return run


def matmul_rate(rounds: int) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    t = _interleaved({"mm": lambda: a @ b}, rounds)["mm"]
    return 2 * 2048**3 / t


def case_vs_peers(name: str, mask_mod, t: int, h: int, d: int, rounds: int, compiled: bool) -> None:
    q, k, v = (torch.randn(1, h, t, d, requires_grad=True) for _ in range(3))
    ours_bm = sa.create_block_mask(mask_mod, None, None, t, t, device="cpu")
    dense = sa.create_mask(mask_mod, 1, 1, t, t, device="cpu")
    pairs = int(dense.sum()) * h

    def ours(q, k, v):
        return sa.flex_attention(q, k, v, block_mask=ours_bm)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

    with torch.no_grad():
        contenders = {"ours fwd": lambda: ours(q, k, v), "sdpa fwd": lambda: sdpa(q, k, v)}
        err = (ours(q, k, v) - sdpa(q, k, v)).abs().max().item()
        compile_s = None
        if compiled:
            torch_bm = torch_block_mask(mask_mod, None, None, t, t, device="cpu")
            flex_c = torch.compile(torch_flex)
            qd, kd, vd = (
                q.detach(),
                k.detach(),
                v.detach(),
            )  # torch's flex refuses inputs that require grad on CPU
            compile_s = _time(lambda: flex_c(qd, kd, vd, block_mask=torch_bm))
            err = max(err, (ours(q, k, v) - flex_c(qd, kd, vd, block_mask=torch_bm)).abs().max().item())
            contenders["torch flex (compiled) fwd"] = lambda: flex_c(qd, kd, vd, block_mask=torch_bm)
        fwd = _interleaved(contenders, rounds)
    bwd = _interleaved(
        {"ours fwd+bwd": _fwd_bwd(ours, q, k, v), "sdpa fwd+bwd": _fwd_bwd(sdpa, q, k, v)}, rounds
    )
    print(f"\n{name}: T={t}, H={h}, D={d}, visible pairs {pairs / (h * t * t):.3f} of T², max |Δ| {err:.2e}")
    for label, sec in {**fwd, **bwd}.items():
        print(f"  {label:28s} {sec * 1e3:9.1f} ms")
    if compiled:
        print(f"  torch flex compile time      {compile_s:9.1f} s (first call, apart)")
        print(f"  ours / compiled flex (fwd)   {fwd['ours fwd'] / fwd['torch flex (compiled) fwd']:9.2f}×")
    print(f"  ours / sdpa dense mask (fwd) {fwd['ours fwd'] / fwd['sdpa fwd']:9.2f}×")
    print(f"  ours / sdpa dense mask (f+b) {bwd['ours fwd+bwd'] / bwd['sdpa fwd+bwd']:9.2f}×")


def case_score_mod(
    name: str, score_mod, mask_mod, t: int, h: int, d: int, rounds: int, compiled: bool
) -> None:
    q, k, v = (torch.randn(1, h, t, d, requires_grad=True) for _ in range(3))
    bm = sa.create_block_mask(mask_mod, None, None, t, t, device="cpu")

    def ours(q, k, v):
        return sa.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)

    with torch.no_grad():
        contenders = {"ours fwd": lambda: ours(q, k, v)}
        if compiled:
            torch_bm = torch_block_mask(mask_mod, None, None, t, t, device="cpu")
            flex_c = torch.compile(torch_flex)
            qd, kd, vd = q.detach(), k.detach(), v.detach()
            compile_s = _time(lambda: flex_c(qd, kd, vd, score_mod=score_mod, block_mask=torch_bm))
            contenders["torch flex (compiled) fwd"] = lambda: flex_c(
                qd, kd, vd, score_mod=score_mod, block_mask=torch_bm
            )
        fwd = _interleaved(contenders, rounds)
    fb = _interleaved({"ours fwd+bwd": _fwd_bwd(ours, q, k, v)}, rounds)
    path = sa.flex.describe(q, k, v, score_mod=score_mod, block_mask=bm).path
    print(f"\n{name} ({path} path): T={t}, H={h}, D={d}")
    for label, sec in {**fwd, **fb}.items():
        print(f"  {label:28s} {sec * 1e3:9.1f} ms")
    if compiled:
        print(f"  torch flex compile time      {compile_s:9.1f} s (first call, apart)")
        print(f"  ours / compiled flex (fwd)   {fwd['ours fwd'] / fwd['torch flex (compiled) fwd']:9.2f}×")


def case_rate(
    name: str, mask_mod, t: int, h: int, d: int, rounds: int, rate: float, contended: bool = False
) -> None:
    """The window as a fraction of the matmul rate over its visible pairs, beside its peer: SDPA's causal
    kernel at the T with the same number of pairs (T = 16384, W = 512: ≈ 4096²/2), in the same rounds."""
    q, k, v = (torch.randn(1, h, t, d, requires_grad=True) for _ in range(3))
    bm = sa.create_block_mask(mask_mod, None, None, t, t, device="cpu")
    pairs = h * sum(_count_rows(mask_mod, i, min(t, i + 1024), t) for i in range(0, t, 1024))
    tp = int(round((2 * pairs / h) ** 0.5))  # causal T with as many visible pairs
    qp, kp, vp = (torch.randn(1, h, tp, d, requires_grad=True) for _ in range(3))

    def ours(q, k, v):
        return sa.flex_attention(q, k, v, block_mask=bm)

    def sdpa_causal(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def measure():
        with torch.no_grad():
            f = _interleaved({"ours": lambda: ours(q, k, v), "sdpa": lambda: sdpa_causal(qp, kp, vp)}, rounds)
        b = _interleaved({"ours": _fwd_bwd(ours, q, k, v), "sdpa": _fwd_bwd(sdpa_causal, qp, kp, vp)}, rounds)
        return f, b

    busy = None
    if contended:  # the same rounds with one core kept busy by a spinning child process
        from selfattention.bench import Spinner

        with Spinner() as spin:
            spin.busy(True)
            busy = measure()
    fwd, fb = measure()
    work = 4 * d * pairs
    peer = 4 * d * h * tp * (tp + 1) / 2
    print(
        f"\n{name}: T={t}, H={h}, D={d}; float32 matmul rate {rate / 1e9:.1f} GFLOP/s (2048² matmul, "
        f"MKL_DYNAMIC={os.environ.get('MKL_DYNAMIC')})"
    )
    print("  (fraction = work / time / matmul rate; work = 4·D·pairs forward, × 2.5 forward+backward)")
    for label, sec, w in (
        ("ours fwd", fwd["ours"], work),
        ("ours fwd+bwd", fb["ours"], 2.5 * work),
        (f"sdpa causal T={tp} fwd", fwd["sdpa"], peer),
        (f"sdpa causal T={tp} fwd+bwd", fb["sdpa"], 2.5 * peer),
    ):
        print(
            f"  {label:28s} {sec * 1e3:9.1f} ms   {w / sec / rate:5.2f} of the matmul rate over visible pairs"
        )
    print(f"  ours / sdpa causal (fwd)     {fwd['ours'] / fwd['sdpa']:9.2f}×")
    print(f"  ours / sdpa causal (f+b)     {fb['ours'] / fb['sdpa']:9.2f}×")
    if busy is not None:
        bf, bb = busy
        print("  one core kept busy (the same rounds, before the quiet ones): busy / quiet")
        for label, quiet, loaded in (
            ("ours fwd", fwd["ours"], bf["ours"]),
            ("ours fwd+bwd", fb["ours"], bb["ours"]),
            ("sdpa causal fwd", fwd["sdpa"], bf["sdpa"]),
            ("sdpa causal fwd+bwd", fb["sdpa"], bb["sdpa"]),
        ):
            print(f"  {label:28s} {loaded * 1e3:9.1f} ms   {loaded / quiet:5.2f}× quiet")
        print(
            f"  ours / sdpa causal busy (fwd, f+b)  {bf['ours'] / bf['sdpa']:.2f}×, {bb['ours'] / bb['sdpa']:.2f}×"
        )


def _count_rows(mask_mod, i0: int, i1: int, t: int) -> int:
    qi = torch.arange(i0, i1).view(1, 1, -1, 1)
    kv = torch.arange(t).view(1, 1, 1, -1)
    z = torch.zeros(1, dtype=torch.long).view(1, 1, 1, 1)
    return int(mask_mod(z, z, qi, kv).sum())


def _plain_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 256)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (T = 1024 and 2048) for development")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-compile", action="store_true", help="skip torch's compiled flex_attention")
    ap.add_argument("--window-only", action="store_true", help="only the sliding window 512 rate rows")
    ap.add_argument("--contended", action="store_true", help="window rows also with one core kept busy")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    rounds = args.rounds or (3 if args.quick else 5)
    t1, t2 = (1024, 2048) if args.quick else (4096, 16384)
    h, d = 8, 64
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, rounds {rounds} (medians)")
    rate = matmul_rate(rounds)
    if args.window_only:
        case_rate("sliding window 512", mods.sliding_window(511), t2, h, d, rounds, rate, args.contended)
        return
    case_vs_peers("sliding window 256", mods.sliding_window(256), t1, h, d, rounds, not args.no_compile)
    case_vs_peers("prefix-LM 512", mods.prefix_lm(512), t1, h, d, rounds, not args.no_compile)
    # the same window as a plain function (attention-gym's style): no structure to recognise, so the
    # generic plan of full / partial blocks (row chunks on single-threaded workers on CPU)
    case_vs_peers("sliding window 256, plain mask_mod", _plain_window, t1, h, d, rounds, not args.no_compile)
    case_rate("sliding window 512", mods.sliding_window(511), t2, h, d, rounds, rate, args.contended)
    c = not args.no_compile
    case_score_mod("ALiBi + causal", mods.alibi(mods.alibi_slopes(h)), mods.causal_mask, t1, h, d, rounds, c)
    case_score_mod("softcap 30 + causal", mods.softcap(30.0), mods.causal_mask, t1, h, d, rounds, c)


if __name__ == "__main__":
    main()
