"""Ring attention on N local processes (gloo, 127.0.0.1) against the single-process paths.

Measures, per rank: forward and forward+backward time (median), peak extra resident memory (VmHWM after
resetting it, minus VmRSS before the call: the working memory of the call, inputs excluded), bytes
sent, time waiting for messages, with the send/receive of the next block overlapped with the current
block's compute (``overlap=True``) and not (``overlap=False``). The single-process rows run the same
problem with all threads: the spec (``reference``, materialises the T×T scores), the tiled path
(``selfattention.tiled.tiled_attention``) and torch SDPA. Every configuration runs in fresh processes.

    .venv/bin/python benchmarks/distributed_bench.py --seq-len 4096 --world-sizes 1 2 4
    .venv/bin/python benchmarks/distributed_bench.py --seq-len 4096 --causal --layout zigzag

Writes a markdown table to stdout and, with ``--json PATH``, the raw numbers. On a 2-core machine N
ranks share the same two cores, so no speed-up is possible; the point is memory per rank (≈ 1/N),
the communication volume, and what the measured compute rate and loopback bandwidth imply for N
machines (printed at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

MiB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _peak_extra(fn) -> tuple[float, object]:
    """Peak resident bytes above the current ones while ``fn`` runs (Linux: resets VmHWM first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    result = fn()
    return (_status("VmHWM") - before) / MiB, result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(cfg: dict, t_q: int, t_k: int, seed: int, grad: bool):
    g = torch.Generator().manual_seed(seed)
    b, h, d = cfg["batch"], cfg["heads"], cfg["head_dim"]
    q = torch.randn(b, h, t_q, d, generator=g)
    k = torch.randn(b, h, t_k, d, generator=g)
    v = torch.randn(b, h, t_k, d, generator=g)
    return tuple(x.requires_grad_(grad) for x in (q, k, v))


def _median_time(fn, repeats: int, sync=lambda: None) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ring_worker(rank: int, world: int, port: int, cfg: dict, outdir: str) -> None:
    from selfattention import distributed as sd

    torch.set_num_threads(max(1, cfg["threads"] // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sd.init_distributed("gloo", timeout=300, rank=rank, world_size=world)
    t = len(sd.sequence_positions(cfg["seq_len"], world, rank, cfg["layout"]))
    kw = dict(is_causal=cfg["causal"], layout=cfg["layout"], block_size=cfg["block_size"])
    barrier = sd.dist.barrier
    res: dict = {"rank": rank, "local_len": t}
    q, k, v = _inputs(cfg, t, t, seed=rank, grad=False)
    res["input_mib"] = sum(x.numel() * x.element_size() for x in (q, k, v)) / MiB
    # warm up on a tiny problem (lazy initialisation, gloo pair set-up), then measure memory on a fresh
    # heap (the parent set MALLOC_MMAP_THRESHOLD_, so freed tensors leave the resident set)
    small = len(sd.sequence_positions(8 * world, world, rank, cfg["layout"]))
    qs, ks, vs = _inputs(cfg, small, small, seed=rank, grad=True)
    sd.ring_attention(qs, ks, vs, **kw).sum().backward()
    with torch.no_grad():
        barrier()
        mem_stats = sd.RingStats()
        res["fwd_peak_mib"], _ = _peak_extra(lambda: sd.ring_attention(q, k, v, stats=mem_stats, **kw))
        res["fwd_bytes"] = mem_stats.bytes_sent
    if cfg["backward"]:
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        dout = torch.randn_like(q)
        barrier()
        mem_stats = sd.RingStats()
        res["fwdbwd_peak_mib"], _ = _peak_extra(
            lambda: sd.ring_attention(qg, kg, vg, stats=mem_stats, **kw).backward(dout)
        )
        res["fwdbwd_bytes"] = mem_stats.bytes_sent
    for overlap in () if cfg["memory_only"] else (True, False):
        tag = "overlap" if overlap else "no_overlap"
        with torch.no_grad():
            sd.ring_attention(q, k, v, overlap=overlap, **kw)  # warm-up
            stats = sd.RingStats()
            fwd = _median_time(
                lambda overlap=overlap, stats=stats: sd.ring_attention(
                    q, k, v, overlap=overlap, stats=stats, **kw
                ),
                cfg["repeats"],
                barrier,
            )  # noqa: B023
        res[f"fwd_s_{tag}"] = fwd
        res[f"fwd_wait_s_{tag}"] = stats.wait_s / cfg["repeats"]
        res[f"fwd_compute_s_{tag}"] = stats.compute_s / cfg["repeats"]
        res["fwd_bytes"] = stats.bytes_sent // cfg["repeats"]
        res["fwd_messages"] = stats.messages // cfg["repeats"]
        res["tiles_computed"] = stats.tiles_computed // cfg["repeats"]
        res["tiles_skipped"] = stats.tiles_skipped // cfg["repeats"]
        if cfg["backward"]:
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            dout = torch.randn_like(q)
            stats = sd.RingStats()

            def fb(qg=qg, kg=kg, vg=vg, dout=dout, stats=stats, overlap=overlap):
                sd.ring_attention(qg, kg, vg, overlap=overlap, stats=stats, **kw).backward(dout)

            fb()
            stats.__init__()
            res[f"fwdbwd_s_{tag}"] = _median_time(fb, cfg["repeats"], barrier)
            res[f"fwdbwd_wait_s_{tag}"] = stats.wait_s / cfg["repeats"]
            res["fwdbwd_bytes"] = stats.bytes_sent // cfg["repeats"]
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    sd.dist.destroy_process_group()


def _single_worker(path: str, cfg: dict, outfile: str) -> None:
    import selfattention as sa
    from selfattention.tiled import tiled_attention

    torch.set_num_threads(cfg["threads"])
    fns = {
        "reference": lambda q, k, v: sa.scaled_dot_product_attention(q, k, v, is_causal=cfg["causal"]),
        "tiled": lambda q, k, v: tiled_attention(q, k, v, is_causal=cfg["causal"]),
        "torch": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=cfg["causal"]
        ),
    }
    fn = fns[path]
    t = cfg["seq_len"]
    q, k, v = _inputs(cfg, t, t, seed=0, grad=False)
    res: dict = {"path": path, "input_mib": sum(x.numel() * x.element_size() for x in (q, k, v)) / MiB}
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    qs, ks, vs = _inputs(cfg, 8, 8, seed=1, grad=True)
    fn(qs, ks, vs).sum().backward()  # warm-up on a tiny problem
    with torch.no_grad():
        res["fwd_peak_mib"], _ = _peak_extra(lambda: fn(q, k, v))
    if cfg["backward"]:
        res["fwdbwd_peak_mib"], _ = _peak_extra(lambda: fn(qg, kg, vg).backward(dout))
    if not cfg["memory_only"]:
        with torch.no_grad():
            fn(q, k, v)
            res["fwd_s_overlap"] = _median_time(lambda: fn(q, k, v), cfg["repeats"])
        if cfg["backward"]:
            res["fwdbwd_s_overlap"] = _median_time(lambda: fn(qg, kg, vg).backward(dout), cfg["repeats"])
    with open(outfile, "w") as f:
        json.dump(res, f)


def _run_single(path: str, cfg: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        p = mp.get_context("spawn").Process(target=_single_worker, args=(path, cfg, out))
        p.start()
        p.join()
        if p.exitcode != 0:
            return {"path": path, "error": f"exit code {p.exitcode}"}
        with open(out) as f:
            return json.load(f)


def _run_ring(world: int, cfg: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_ring_worker, args=(world, _free_port(), cfg, d), nprocs=world, join=True)
        out = []
        for r in range(world):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out


def _fmt(x, unit="") -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.3g}{unit}"
    return f"{x}{unit}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--layout", choices=["contiguous", "zigzag"], default="contiguous")
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-backward", dest="backward", action="store_false")
    ap.add_argument("--baselines", nargs="*", default=["reference", "tiled", "torch"])
    ap.add_argument("--memory-only", action="store_true", help="measure memory and bytes, skip the timings")
    ap.add_argument("--json", help="write the raw numbers here")
    cfg = vars(ap.parse_args(argv))
    # Large tensors get their own mmap and go back to the OS when freed, so that the peak resident
    # memory of a call measures what it allocated (glibc otherwise keeps freed memory in its heap).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    json_path = cfg.pop("json")

    singles, rings = [], {}
    for path in cfg["baselines"]:
        print(f"single process: {path} …", file=sys.stderr, flush=True)
        singles.append(_run_single(path, cfg))
    for n in cfg["world_sizes"]:
        print(f"ring on {n} process(es) …", file=sys.stderr, flush=True)
        rings[n] = _run_ring(n, cfg)

    t, b, h, d = cfg["seq_len"], cfg["batch"], cfg["heads"], cfg["head_dim"]
    print(
        f"\nT={t}, B={b}, H={h}, D={d}, float32, causal={cfg['causal']}, layout={cfg['layout']}, "
        f"block_size={cfg['block_size']}, {cfg['threads']} threads in all (ring: {cfg['threads']}//N per rank)\n"
    )
    print(
        "| path | ranks | inputs MiB per rank | peak extra MiB fwd | inputs + extra fwd | peak extra fwd+bwd | "
        "sent MiB per rank fwd | fwd+bwd | fwd s (overlap / none) | wait s fwd (overlap / none) | "
        "fwd+bwd s (overlap / none) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in singles:
        if "error" in s:
            print(f"| {s['path']} | 1 | {s['error']} | | | | | | | | |")
            continue
        print(
            f"| {s['path']} | 1 | {_fmt(s['input_mib'])} | {_fmt(s['fwd_peak_mib'])} | "
            f"{_fmt(s['input_mib'] + s['fwd_peak_mib'])} | {_fmt(s.get('fwdbwd_peak_mib'))} | 0 | 0 | {_fmt(s.get('fwd_s_overlap'))} | – | {_fmt(s.get('fwdbwd_s_overlap'))} |"
        )
    for n, ranks in rings.items():

        def mx(key, ranks=ranks):
            vals = [r.get(key) for r in ranks]
            return None if any(x is None for x in vals) else max(vals)

        print(
            f"| ring | {n} | {_fmt(mx('input_mib'))} | {_fmt(mx('fwd_peak_mib'))} | "
            f"{_fmt(max(r['input_mib'] + r['fwd_peak_mib'] for r in ranks))} | {_fmt(mx('fwdbwd_peak_mib'))} | "
            f"{_fmt(mx('fwd_bytes') / MiB)} | "
            f"{_fmt(mx('fwdbwd_bytes') / MiB if mx('fwdbwd_bytes') is not None else None)} | "
            f"{_fmt(mx('fwd_s_overlap'))} / {_fmt(mx('fwd_s_no_overlap'))} | "
            f"{_fmt(mx('fwd_wait_s_overlap'))} / {_fmt(mx('fwd_wait_s_no_overlap'))} | "
            f"{_fmt(mx('fwdbwd_s_overlap'))} / {_fmt(mx('fwdbwd_s_no_overlap'))} |"
        )
    print("\n(max over ranks; peak extra = working memory of the call above the inputs already held)")
    base = next((s for s in singles if s.get("path") == "torch" and "error" not in s), None)
    if base is not None and not cfg["memory_only"]:
        for n, ranks in rings.items():
            for key, name in (("fwd_s_overlap", "forward"), ("fwdbwd_s_overlap", "forward+backward")):
                ring_s = max((r.get(key) or 0.0) for r in ranks)
                if base.get(key) and ring_s:
                    print(
                        f"ring N={n} ({max(1, cfg['threads'] // n)} thread(s) per rank) / single-process torch SDPA "
                        f"({cfg['threads']} threads), {name}: {ring_s / base[key]:.2f}"
                    )

    # What the numbers imply for N machines: a ring step overlaps the transfer of one key/value block
    # (T/N rows × 2·D values × 4 bytes) with the block's compute ((T/N)² · 4·D flops, ×0.5 causal).
    big = None if cfg["memory_only"] else max((n for n in rings if n > 1), default=None)
    if big is not None:
        r0 = max(rings[big], key=lambda r: r["fwd_compute_s_overlap"])
        local = r0["local_len"]
        flops = 4 * local * t * d * h * b * (0.5 if cfg["causal"] else 1.0)
        rate = flops / r0["fwd_compute_s_overlap"]
        steps = big - 1
        block_bytes = r0["fwd_bytes"] / max(1, steps)
        wait_none = r0["fwd_wait_s_no_overlap"] / max(1, steps)
        bw = block_bytes / wait_none if wait_none > 0 else float("inf")
        rows = 2 * rate / bw * (2 if cfg["causal"] else 1)
        print(
            f"\nmeasured with N={big}: compute {rate / 1e9:.1f} GFLOP/s per rank ({max(1, cfg['threads'] // big)} thread(s)), "
            f"one block of {block_bytes / MiB:.2f} MiB: {wait_none * 1e3:.1f} ms waiting per step without overlap "
            f"(transfer plus waiting for the slowest rank: {bw / 1e9:.2f} GB/s as a lower bound).\nCommunication is hidden by the overlap when a rank's block has at least "
            f"2·F/BW rows = {rows:.0f} rows at these rates (per step: T/N·8·D bytes vs (T/N)²·4·D flops); "
            "over 10 Gbit/s Ethernet (1.25 GB/s) at this compute rate: "
            f"{2 * rate / 1.25e9 * (2 if cfg['causal'] else 1):.0f} rows."
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {"config": cfg, "single": singles, "ring": {str(n): r for n, r in rings.items()}}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
