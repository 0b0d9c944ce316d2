"""Starting and joining a process group for ring attention (env://, torchrun, or explicit rank/world)."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist


class DistributedInitError(RuntimeError):
    """The process group could not be formed (a rank did not join in time, or the master is unreachable)."""


# ----------------------------------------------------------------------------------------------------
# Process group set-up
# ----------------------------------------------------------------------------------------------------


def init_distributed(
    backend: str | None = None,
    timeout: float = 60.0,
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> tuple[int, int]:
    """Join the default process group from torchrun's environment; returns ``(rank, world_size)``.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by ``torchrun``; pass
    ``rank``/``world_size`` to override the first two). ``backend=None`` picks ``"nccl"`` when CUDA is
    available (and sets this process's GPU from ``LOCAL_RANK``), else ``"gloo"``.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or None (automatic).
        timeout: seconds to wait for every rank to join, and for any later collective or send/receive.

    Raises:
        DistributedInitError: not every rank joined within ``timeout`` seconds, or the master address
            could not be reached — with the address, the rank and the world size in the message, instead
            of a hang.
        ValueError: a missing or malformed environment variable, or ``timeout`` not positive.
    """
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    env = os.environ
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in env:
            raise ValueError(f"{name} is not set; start the processes with torchrun, or set it yourself")
    try:
        rank = int(env["RANK"]) if rank is None else rank
        world_size = int(env["WORLD_SIZE"]) if world_size is None else world_size
    except KeyError as e:
        raise ValueError(f"{e.args[0]} is not set; start the processes with torchrun, or pass it") from None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(env.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    where = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    start = time.monotonic()
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
    except dist.DistError as e:
        waited = time.monotonic() - start
        raise DistributedInitError(
            f"rank {rank} of {world_size}: the process group at {where} did not form within "
            f"{timeout:g} s (waited {waited:.1f} s): {e}. Check that all {world_size} processes were "
            "started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and that the port is reachable."
        ) from e
    return rank, world_size
