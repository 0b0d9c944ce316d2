"""Ring (sequence-parallel) attention across processes: each holds 1/N of the sequence.

One machine, 4 processes on CPU (gloo):

    torchrun --nproc-per-node 4 examples/ring_attention.py --seq-len 4096 --causal --layout zigzag

Several machines (run on each, with its own --node-rank; the endpoint is the first machine):

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 \\
        --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 --rdzv-id ring1 examples/ring_attention.py

GPUs: the same command; with CUDA available every process takes GPU ``LOCAL_RANK`` and the backend is
NCCL. Each rank makes its slice of a random sequence (the same global sequence on every rank, from one
seed), runs the ring forward and backward, and — with ``--check`` — compares with single-process
attention on the full sequence (which needs the whole sequence in one process: keep it small).
"""

from __future__ import annotations

import argparse
import time

import torch

import selfattention as sa
from selfattention import distributed as sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--seq-len", type=int, default=1000, help="global sequence length T (need not be a multiple of N)"
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--layout", choices=sd.LAYOUTS, default="contiguous")
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--check", action="store_true", help="compare with single-process attention on rank 0")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for every rank to join")
    args = ap.parse_args()

    rank, world = sd.init_distributed(timeout=args.timeout)  # reads torchrun's RANK, WORLD_SIZE, MASTER_*
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)  # the same global sequence on every rank; a real model would shard its input
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    q_full, k_full, v_full, g_full = (torch.randn(shape) for _ in range(4))
    # this rank's rows (B, H, T_local, D); T_local differs by one between ranks when N does not divide T
    q, k, v, grad = (
        sd.shard_sequence(t, world, rank, args.layout).to(device) for t in (q_full, k_full, v_full, g_full)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    stats = sd.RingStats()
    t0 = time.perf_counter()
    out = sd.ring_attention(
        q, k, v, is_causal=args.causal, layout=args.layout, block_size=args.block_size, stats=stats
    )
    out.backward(grad)  # collective: every rank runs the backward ring
    elapsed = time.perf_counter() - t0
    print(
        f"rank {rank}/{world}: rows {sd.sequence_positions(args.seq_len, world, rank, args.layout)[:3].tolist()}…"
        f" ({q.shape[-2]} of {args.seq_len}), forward+backward {elapsed:.3f} s, sent "
        f"{stats.bytes_sent / 2**20:.2f} MiB in {stats.messages} messages, waited {stats.wait_s:.3f} s, "
        f"tiles computed {stats.tiles_computed}, skipped {stats.tiles_skipped}",
        flush=True,
    )

    if args.check:
        full_out = sd.gather_sequence(out.detach(), layout=args.layout)
        full_dq = sd.gather_sequence(q.grad, layout=args.layout)
        if rank == 0:
            qr, kr, vr = (t.clone().double().requires_grad_() for t in (q_full, k_full, v_full))
            ref = sa.scaled_dot_product_attention(qr, kr, vr, is_causal=args.causal)
            ref.backward(g_full.double())
            err_out = (full_out.cpu().double() - ref).abs().max().item()
            err_dq = (full_dq.cpu().double() - qr.grad).abs().max().item()
            print(f"max |ring - single process|: output {err_out:.2e}, dQ {err_dq:.2e}")
    sd.dist.destroy_process_group()


if __name__ == "__main__":
    main()
