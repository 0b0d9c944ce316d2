"""Per-call cost of the tiled engine against torch SDPA on the same tensors, in one process.

Plain ``tiled_attention`` calls (dense and causal, no grad and forward+backward) at small and medium T, the
KV-cache decode step (``flash_attn_with_kvcache`` and a :class:`~selfattention.kv_cache.KVCache` read) at
context 4096, each as a ratio to SDPA measured in the same rounds: interleaved, the order rotated every
round, medians. The per-call overhead (microseconds above SDPA) is what this measures at small sizes.

    .venv/bin/python benchmarks/overhead_bench.py --rounds 200 --threads 1
    .venv/bin/python benchmarks/overhead_bench.py --small        # seconds: develop / smoke-test
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from selfattention.backends import scaled_dot_product_attention
from selfattention.flash_kvcache import flash_attn_with_kvcache
from selfattention.kv_cache import KVCache
from selfattention.tiled import tiled_attention

CLOCK = time.perf_counter


def interleaved(fns: dict, rounds: int, inner: int) -> dict[str, float]:
    """Median seconds per call of each function, taking turns round after round (order rotated)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
        f()
    items = list(fns.items())
    for r in range(rounds):
        for name, f in items[r % len(items) :] + items[: r % len(items)]:
            t0 = CLOCK()
            for _ in range(inner):
                f()
            times[name].append((CLOCK() - t0) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def plain(shape: tuple[int, ...], causal: bool, grad: bool, rounds: int, inner: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).requires_grad_(grad) for _ in range(3))
    do = torch.randn(*shape, generator=g)

    def run(fn):
        if not grad:
            with torch.no_grad():
                return lambda: fn(q, k, v, is_causal=causal)
        return lambda: torch.autograd.backward(fn(q, k, v, is_causal=causal), do)

    if not grad:
        fns = {
            "tiled": lambda: _nograd(tiled_attention, q, k, v, causal),
            "sdpa": lambda: _nograd(F.scaled_dot_product_attention, q, k, v, causal),
        }
    else:
        fns = {"tiled": run(tiled_attention), "sdpa": run(F.scaled_dot_product_attention)}
    return interleaved(fns, rounds, inner)


def _nograd(fn, q, k, v, causal):
    with torch.no_grad():
        return fn(q, k, v, is_causal=causal)


def decode(T: int, H: int, D: int, rounds: int, inner: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(1, T + 16, H, D, generator=g)
    vc = torch.randn(1, T + 16, H, D, generator=g)
    q = torch.randn(1, 1, H, D, generator=g)
    lens = torch.tensor([T], dtype=torch.int32)
    qt, kt, vt = q.transpose(1, 2), kc[:, :T].transpose(1, 2), vc[:, :T].transpose(1, 2)
    cache = KVCache(1, H, D, capacity=T + 16)
    cache.update(kt[:, :, : T - 1].contiguous(), vt[:, :, : T - 1].contiguous())
    k_all, v_all, vis = cache.update(kt[:, :, T - 1 :].contiguous(), vt[:, :, T - 1 :].contiguous())

    def kvcache_read():  # the attention of one decode step on what the cache returned (views + Visibility)
        return scaled_dot_product_attention(qt, k_all, v_all, vis, backend="tiled")

    fns = {
        "flash_attn_with_kvcache": lambda: _nograd_call(
            lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
        ),
        "KVCache+tiled": lambda: _nograd_call(kvcache_read),
        "sdpa": lambda: _nograd_call(lambda: F.scaled_dot_product_attention(qt, kt, vt)),
        "sdpa on the KVCache views": lambda: _nograd_call(
            lambda: F.scaled_dot_product_attention(qt, k_all, v_all)
        ),
    }
    return interleaved(fns, rounds, inner)


def _nograd_call(f):
    with torch.no_grad():
        return f()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true")
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--parts", default="plain,decode")
    p.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall time, or this thread's CPU time (with --threads 1: what other load on a shared machine "
        "does not add)",
    )
    a = p.parse_args()
    global CLOCK
    CLOCK = time.thread_time if a.clock == "thread" else time.perf_counter
    if a.threads:
        torch.set_num_threads(a.threads)
    rounds = 5 if a.small else a.rounds
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, rounds {rounds} x {a.inner}, "
        f"clock {a.clock}"
    )
    parts = a.parts.split(",")
    if "plain" in parts:
        sizes = [(1, 8, 64, 64)] if a.small else [(1, 8, 64, 64), (1, 8, 256, 64), (1, 8, 1024, 64)]
        for shape in sizes:
            for causal in (False, True):
                for grad in (False, True):
                    t = plain(shape, causal, grad, rounds, a.inner)
                    print(
                        f"plain {shape} {'causal' if causal else 'dense '} {'grad   ' if grad else 'no-grad'}: "
                        f"tiled {t['tiled'] * 1e6:8.1f} us  sdpa {t['sdpa'] * 1e6:8.1f} us  "
                        f"ratio {t['tiled'] / t['sdpa']:.3f}"
                    )
    if "decode" in parts:
        T = 256 if a.small else 4096
        t = decode(T, 8, 64, rounds, a.inner)
        s, sc = t["sdpa"], t["sdpa on the KVCache views"]
        print(
            f"decode T={T} H=8 D=64 (flash layout (B, T, H, D)): sdpa {s * 1e6:.1f} us; "
            f"flash_attn_with_kvcache {t['flash_attn_with_kvcache'] * 1e6:.1f} us "
            f"({t['flash_attn_with_kvcache'] / s:.3f}x)"
        )
        print(
            f"decode T={T} H=8 D=64 (KVCache layout (B, H, T, D)): sdpa {sc * 1e6:.1f} us; "
            f"KVCache+tiled {t['KVCache+tiled'] * 1e6:.1f} us ({t['KVCache+tiled'] / sc:.3f}x)"
        )


if __name__ == "__main__":
    main()
