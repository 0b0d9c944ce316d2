"""The serving KV cache, measured in one process against its peers on the same tensors.

1. **Decode step** at context T (default 4096; H = 8 query and key/value heads, D = 64, float32, B = 1):
   ``flash_attn_with_kvcache`` vs ``torch.nn.functional.scaled_dot_product_attention`` on the same cache
   views, and vs this machine's **copy bandwidth** measured in the same run (a decode step reads K and V
   once: at best it runs as fast as copying them). Reported: time / SDPA's, and the fraction of the copy
   bandwidth the step reaches for the bytes of K and V it reads.
2. **Paged vs contiguous**: the same keys in a page pool (page size 16 and 256; pages in order, and
   shuffled), through ``block_table``, B = 1 and B = 8 sequences; time / the contiguous cache's.
3. **Batched decoding**: 8 prompts of lengths 10 … 2000 (evenly spaced), N new tokens each, on a randomly
   initialised decoder (timing does not depend on the weights): ``generate_batch`` (ragged caches) vs 8
   sequential ``generate`` runs and vs padding every prompt to the longest (the lockstep cache with a
   padding mask). Tokens/s of each and both ratios.

    .venv/bin/python benchmarks/kvcache_bench.py                 # full sizes (a few minutes on 2 cores)
    .venv/bin/python benchmarks/kvcache_bench.py --small         # seconds: develop / smoke-test

Medians of interleaved repeats (each peer once per round, the order rotated every round), so drifts of a
shared machine and cache warmth hit all alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from selfattention.decoder import Decoder, DecoderConfig, generate, generate_batch
from selfattention.flash_kvcache import flash_attn_with_kvcache

ROOT = Path(__file__).resolve().parents[1]
I32 = torch.int32


def interleaved(fns: dict, rounds: int, inner: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, the functions taking turns round after round."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():  # warm-up
        f()
    items = list(fns.items())
    for r in range(rounds):
        # rotate the order every round: each peer follows each other one equally often (a call that reads
        # what the previous one just read finds it in the cache; a fixed order would favour one peer)
        for name, f in items[r % len(items) :] + items[: r % len(items)]:
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            times[name].append((time.perf_counter() - t0) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def decode_step(T: int, H: int, D: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(1, T + 16, H, D, generator=g)
    vc = torch.randn(1, T + 16, H, D, generator=g)
    q = torch.randn(1, 1, H, D, generator=g)
    lens = torch.tensor([T], dtype=I32)
    qt, kt, vt = q.transpose(1, 2), kc[:, :T].transpose(1, 2), vc[:, :T].transpose(1, 2)
    dk, dv = torch.empty_like(kc[:, :T]), torch.empty_like(vc[:, :T])
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
    ref = F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)
    err = (out - ref).abs().max().item()

    def copy():
        dk.copy_(kc[:, :T])
        dv.copy_(vc[:, :T])

    t = interleaved(
        {
            "flash_attn_with_kvcache": lambda: flash_attn_with_kvcache(
                q, kc, vc, cache_seqlens=lens, causal=True
            ),
            "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt),
            "copy K,V": copy,
        },
        rounds,
        inner=10,
    )
    nbytes = 2 * T * H * D * 4
    row = {
        "T": T,
        "H": H,
        "D": D,
        "ms": {k: v * 1e3 for k, v in t.items()},
        "vs_sdpa": t["flash_attn_with_kvcache"] / t["sdpa"],
        "copy_GBps": nbytes / t["copy K,V"] / 1e9,
        "step_GBps": nbytes / t["flash_attn_with_kvcache"] / 1e9,
        "sdpa_GBps": nbytes / t["sdpa"] / 1e9,
        "max_abs_diff_vs_sdpa": err,
    }
    row["fraction_of_copy_bw"] = row["step_GBps"] / row["copy_GBps"]
    return row


def _pool(kc: torch.Tensor, page: int, shuffle: bool, seed: int = 0):
    """The contiguous cache (B, S, H, D) as a pool of pages + block table (pages in order or shuffled)."""
    b, s, h, d = kc.shape
    per = s // page
    n = b * per
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if shuffle else torch.arange(n)
    table = order.view(b, per)
    pool = torch.empty(n, page, h, d)
    pool[table.flatten()] = kc.reshape(b, per, page, h, d).flatten(0, 1)
    return pool, table.to(I32)


def paged(T: int, H: int, D: int, batch: int, rounds: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    S = T + 256
    kc, vc = torch.randn(batch, S, H, D, generator=g), torch.randn(batch, S, H, D, generator=g)
    q = torch.randn(batch, 1, H, D, generator=g)
    lens = torch.full((batch,), T, dtype=I32)
    fns = {"contiguous": lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)}
    want = fns["contiguous"]()
    errs = {}
    for page in (16, 256):
        for shuffle in (False, True):
            kp, table = _pool(kc, page, shuffle)
            vp, _ = _pool(vc, page, shuffle)
            name = f"page {page}{' shuffled' if shuffle else ''}"
            fns[name] = lambda kp=kp, vp=vp, table=table: flash_attn_with_kvcache(
                q, kp, vp, cache_seqlens=lens, block_table=table, causal=True
            )
            errs[name] = (fns[name]() - want).abs().max().item()
    t = interleaved(fns, rounds, inner=5)
    return [
        {
            "B": batch,
            "T": T,
            "layout": k,
            "ms": v * 1e3,
            "vs_contiguous": v / t["contiguous"],
            "max_abs_diff": errs.get(k, 0.0),
        }
        for k, v in t.items()
    ]


def batched(lengths: list[int], new: int, rounds: int, d_model: int, layers: int) -> dict:
    cfg = DecoderConfig(
        vocab_size=96, context=max(lengths) + new + 1, d_model=d_model, num_heads=8, num_layers=layers
    )
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]
    b = len(prompts)
    t_max = max(lengths)

    @torch.inference_mode()
    def padded():  # every prompt left-padded to the longest, lockstep cache + padding mask
        ids = torch.zeros(b, t_max, dtype=torch.int64)
        real = torch.zeros(b, t_max, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, t_max - len(p) :] = torch.tensor(p)
            real[i, t_max - len(p) :] = True
        caches = model.new_caches(b, t_max + new)
        logits = model(ids, caches, real)[:, -1]
        one = torch.ones(b, 1, dtype=torch.bool)
        for i in range(new):
            nxt = logits.argmax(-1)
            if i + 1 < new:
                logits = model(nxt[:, None], caches, one)[:, -1]

    fns = {
        "batched (ragged cache)": lambda: generate_batch(model, prompts, new),
        "8 sequential runs": lambda: [generate(model, p, new) for p in prompts],
        "padded to the longest": padded,
    }
    same = generate_batch(model, prompts, new) == [generate(model, p, new).tolist() for p in prompts]
    t = interleaved(fns, rounds)
    tokens = b * new
    rates = {k: tokens / v for k, v in t.items()}
    return {
        "lengths": lengths,
        "new_tokens": new,
        "model": f"{layers} layers, d_model {d_model}, 8 heads",
        "seconds": t,
        "tokens_per_s": rates,
        "batched_vs_sequential": rates["batched (ragged cache)"] / rates["8 sequential runs"],
        "batched_vs_padded": rates["batched (ragged cache)"] / rates["padded to the longest"],
        "batched_tokens_equal_sequential": same,
    }


def _print_decode(d: dict, T: int) -> None:
    print(f"\n1. decode step, context {T}, H = 8, D = 64, B = 1, float32")
    for k, v in d["ms"].items():
        print(f"   {k:26s} {v:8.3f} ms")
    print(
        f"   vs SDPA: {d['vs_sdpa']:.2f}× (target ≤ 1.1)   copy bandwidth {d['copy_GBps']:.1f} GB/s, the step reads "
        f"K,V at {d['step_GBps']:.1f} GB/s = {d['fraction_of_copy_bw']:.2f} of it (target ≥ 0.8); SDPA "
        f"{d['sdpa_GBps']:.1f} GB/s; max |Δ| vs SDPA {d['max_abs_diff_vs_sdpa']:.1e}"
    )


def _print_paged(rows: list[dict]) -> None:
    print("\n2. paged vs contiguous (flash_attn_with_kvcache, one decode step)")
    for r in rows:
        print(
            f"   B = {r['B']}, T = {r['T']:5d}  {r['layout']:20s} {r['ms']:8.3f} ms  {r['vs_contiguous']:.2f}× contiguous"
            f"  (max |Δ| {r['max_abs_diff']:.1e})"
        )


def _print_batched(bt: dict, lengths: list[int], new: int) -> None:
    print(f"\n3. batched decoding, prompts of lengths {lengths}, {new} new tokens each ({bt['model']})")
    for k, v in bt["tokens_per_s"].items():
        print(f"   {k:24s} {v:8.1f} tokens/s   ({bt['seconds'][k]:.3f} s)")
    print(
        f"   batched / sequential = {bt['batched_vs_sequential']:.2f}×, batched / padded = {bt['batched_vs_padded']:.2f}×;"
        f" batched tokens identical to the sequential runs: {bt['batched_tokens_equal_sequential']}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="small sizes (seconds)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--parts", default="1,2,3", help="which measurements (1 decode, 2 paged, 3 batched)")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "kvcache_bench.json")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    T = 512 if a.small else a.context
    rounds = 3 if a.small else a.rounds
    lengths = [10, 40, 70, 100] if a.small else [round(10 + i * (2000 - 10) / 7) for i in range(8)]
    new = 4 if a.small else a.new_tokens
    print(
        f"kvcache benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads (a shared machine)"
    )
    parts = {int(x) for x in a.parts.split(",")}
    d, rows, bt = {}, [], {}
    if 1 in parts:
        d = decode_step(T, 8, 64, rounds)
        _print_decode(d, T)
    if 2 in parts:
        for batch in (1, 8):
            rows += paged(T if batch == 1 else T // 2, 8, 64, batch, rounds)
        _print_paged(rows)
    if 3 in parts:
        bt = batched(lengths, new, max(1, rounds // 5), 256 if not a.small else 64, 4 if not a.small else 2)
        _print_batched(bt, lengths, new)
    meta = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "command": "python benchmarks/kvcache_bench.py" + (" --small" if a.small else ""),
        "note": "shared machine (about 9 engineers on 2 cores): medians of interleaved rounds",
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"meta": meta, "decode": d, "paged": rows, "batched": bt}, indent=2) + "\n")
    print(f"\nwrote {a.json}")


if __name__ == "__main__":
    main()
