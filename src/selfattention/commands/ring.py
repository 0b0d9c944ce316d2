"""``selfattention ring``: ring attention on N local processes (gloo, 127.0.0.1), checked against the spec.

Spawns ``--world-size`` processes on this machine, gives each its slice of one random sequence, runs
:func:`selfattention.distributed.ring_attention` forward and backward, and prints per rank the rows it
holds, the bytes it sent, the tiles it computed and skipped, and the largest difference of the
reassembled output and gradients from single-process attention (float64 spec). For several machines use
``torchrun`` with ``examples/ring_attention.py`` (see docs/long-sequences.md).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

import typer
from rich.table import Table

from ..i18n import N_, _
from . import UsageError, console

#: Largest difference of output, dQ, dK, dV (float32 ring vs float64 spec) that passes.
TOLERANCE = 1e-4
#: the layouts' names as shown (``--layout`` takes the English ones)
LAYOUT_NAMES = {"contiguous": N_("contiguous"), "zigzag": N_("zigzag")}


def _runs(positions: list[int]) -> str:
    """Sorted sequence positions as runs, "0–499" or "0–249, 750–999" (zig-zag)."""
    runs: list[list[int]] = []
    for p in sorted(positions):
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(f"{a}–{b}" if b > a else str(a) for a, b in runs)


def _worker(rank: int, world: int, port: int, cfg: dict, outdir: str) -> None:
    import torch

    from .. import distributed as sd

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sd.init_distributed("gloo", timeout=cfg["timeout"], rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)  # the same global sequence on every rank
        shape = (1, cfg["heads"], cfg["seq_len"], cfg["head_dim"])
        full = [torch.randn(shape, generator=g) for _i in range(4)]
        q, k, v, grad = (sd.shard_sequence(t, world, rank, cfg["layout"]) for t in full)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        stats = sd.RingStats()
        t0 = time.perf_counter()
        out = sd.ring_attention(
            q, k, v, is_causal=cfg["causal"], layout=cfg["layout"], block_size=cfg["block_size"], stats=stats
        )
        out.backward(grad)
        seconds = time.perf_counter() - t0
        torch.save(
            {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "stats": stats, "s": seconds},
            os.path.join(outdir, f"{rank}.pt"),
        )
    finally:
        sd.dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def register(app: typer.Typer) -> None:
    @app.command(
        "ring",
        help=N_("Ring (sequence-parallel) attention on N local processes, checked against one process."),
    )
    def ring(
        world_size: int = typer.Option(2, "--world-size", "-n", help=N_("processes (ranks) on this machine")),
        seq_len: int = typer.Option(
            1000, "--seq-len", help=N_("global sequence length T (need not be a multiple of N)")
        ),
        heads: int = typer.Option(4, "--heads", help=N_("attention heads H")),
        head_dim: int = typer.Option(64, "--head-dim", help=N_("head_dim D of each head")),
        causal: bool = typer.Option(
            False, "--causal", help=N_("causal attention (each query sees its past)")
        ),
        layout: str = typer.Option("contiguous", "--layout", help=N_("contiguous or zigzag")),
        block_size: int = typer.Option(256, "--block-size", help=N_("tile rows inside a rank")),
        timeout: float = typer.Option(60.0, "--timeout", help=N_("seconds to wait for the ranks to join")),
    ) -> None:
        import torch
        import torch.multiprocessing as mp

        from .. import distributed as sd
        from ..functional import scaled_dot_product_attention

        if not 1 <= world_size <= 64:
            raise UsageError(_("--world-size must be between 1 and 64, got {value}").format(value=world_size))
        for name, value in (("--seq-len", seq_len), ("--heads", heads), ("--head-dim", head_dim)):
            if value < 1:
                raise UsageError(_("{name} must be at least 1, got {value}").format(name=name, value=value))
        if seq_len > 8192:
            raise UsageError(
                _("--seq-len {value}: the check needs the whole sequence in one process; use ≤ 8192").format(
                    value=seq_len
                )
            )
        if layout not in sd.LAYOUTS:
            raise UsageError(
                _("--layout must be one of {choices}, got {value!r}").format(
                    choices=", ".join(sd.LAYOUTS), value=layout
                )
            )
        if block_size < 1 or timeout <= 0:
            raise UsageError(_("--block-size and --timeout must be positive"))
        cfg = dict(
            seq_len=seq_len,
            heads=heads,
            head_dim=head_dim,
            causal=causal,
            layout=layout,
            block_size=block_size,
            timeout=timeout,
        )
        with tempfile.TemporaryDirectory() as d:
            with console.status(_("ring attention on {n} process(es) …").format(n=world_size)):
                mp.spawn(_worker, args=(world_size, _free_port(), cfg, d), nprocs=world_size, join=True)
            parts = [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world_size)]

        g = torch.Generator().manual_seed(0)
        shape = (1, heads, seq_len, head_dim)
        q, k, v, grad = (torch.randn(shape, generator=g).double() for _i in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        ref = scaled_dot_product_attention(q, k, v, is_causal=causal)
        ref.backward(grad)
        err = {}
        for key, want in (("out", ref.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            got = sd.unshard_sequence([p[key] for p in parts], layout).double()
            err[key] = (got - want).abs().max().item()

        table = Table(
            title=_("ring attention, T={T}, H={H}, D={D}, causal: {causal}, {layout} layout").format(
                T=seq_len,
                H=heads,
                D=head_dim,
                causal=_("yes") if causal else _("no"),
                layout=_(LAYOUT_NAMES[layout]),
            ),
            pad_edge=False,
        )
        for col in (
            _("rank"),
            _("rows"),
            _("positions"),
            _("sent MiB"),
            _("messages"),
            _("tiles run"),
            _("skipped"),
            _("fwd+bwd s"),
        ):
            # the positions header is one word: never truncated ("positio…"); the others may wrap
            table.add_column(col, justify="right", min_width=len(col) if col == _("positions") else None)
        for r, p in enumerate(parts):
            pos = sd.sequence_positions(seq_len, world_size, r, layout)
            st = p["stats"]
            table.add_row(
                str(r),
                str(len(pos)),
                _runs(pos.tolist()),
                f"{st.bytes_sent / 2**20:.3f}",
                str(st.messages),
                str(st.tiles_computed),
                str(st.tiles_skipped),
                f"{p['s']:.3f}",
            )
        console.print(table)
        console.print(
            _("max |ring − single process| (float32 vs float64 spec): {diffs}").format(
                diffs=_(", ").join(f"{k} {v:.1e}" for k, v in err.items())
            ),
            highlight=False,
        )
        worst = max(err, key=err.__getitem__)
        if err[worst] > TOLERANCE:
            console.print(
                _(
                    "[bold red]FAIL[/bold red]: {what} differs by {diff:.1e} > {tol:.0e} from the "
                    "single-process result"
                ).format(what=worst, diff=err[worst], tol=TOLERANCE),
                highlight=False,
            )
            raise typer.Exit(1)
        console.print(
            _(
                "[bold green]PASS[/bold green]: output and gradients within {tol:.0e} of the single-process "
                "result (largest: {what} {diff:.1e})"
            ).format(what=worst, diff=err[worst], tol=TOLERANCE),
            highlight=False,
        )
