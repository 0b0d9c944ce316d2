"""How ``selfattention bench`` measures: one call's peak extra memory, the machine's matmul peak, and the
background load of ``--contended``.

**Memory**: freed heap is returned to the OS (``malloc_trim``), the peak-RSS mark is reset
(``/proc/self/clear_refs``), one call runs, and peak extra memory = VmHWM − VmRSS before the call
(:func:`peak_extra_mib`). **Peak**: the float32 GFLOP/s of one large matmul (:func:`matmul_peak_gflops`),
the ceiling the benchmark's GFLOP/s are read against. **Contended**: a :class:`Spinner` — one process
spinning on one core (pinned to the last CPU where the OS allows it; it exits by itself after
:data:`SPIN_LIMIT_S` and is killed at the end), stopped (SIGSTOP) and let run (SIGCONT) between passes.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = ["SPIN_LIMIT_S", "Spinner", "matmul_peak_gflops", "peak_extra_mib"]


def _rss_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def _trim() -> None:
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_extra_mib(fn: Callable[[], object]) -> float | None:
    """Peak resident memory of one call of ``fn`` above what was resident before it, in MiB.

    ``fn`` is called once either way; None where there is no ``/proc/self/status`` to read (not Linux)."""
    if not os.path.exists("/proc/self/status"):
        fn()
        return None
    _trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    before = _rss_kib("VmRSS")
    fn()
    return max(0, _rss_kib("VmHWM") - before) / 1024


def matmul_peak_gflops(n: int = 4096, repeats: int = 3) -> float:
    """float32 GFLOP/s of one n × n × n matmul on this machine (median of ``repeats``)."""
    import torch

    a = torch.randn(n, n)
    b = torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


SPIN_LIMIT_S = 3600.0
"""Seconds after which a spinner stops by itself (one left behind by a killed run does not spin forever)."""

_SPIN = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"


class Spinner:
    """A child process spinning on one core (the background load of ``--contended``), paused at start.

    ``busy(True)`` lets it run, ``busy(False)`` stops it (SIGSTOP); :meth:`close` kills it. Use as a
    context manager so that it dies with the measurement."""

    def __init__(self, limit_s: float = SPIN_LIMIT_S) -> None:
        import signal

        self._signal = signal
        self.proc = subprocess.Popen([sys.executable, "-c", _SPIN.format(limit=float(limit_s))])
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(cpus) > 1:
            try:
                os.sched_setaffinity(self.proc.pid, {cpus[-1]})
            except OSError:
                pass
        self.busy(False)

    def busy(self, on: bool) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, self._signal.SIGCONT if on else self._signal.SIGSTOP)
            if on:
                time.sleep(0.05)  # let the scheduler see it

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> Spinner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
