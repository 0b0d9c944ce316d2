"""Independent jobs of torch ops run on one thread each, so that a busy core delays one job, not every op.

Why: every torch op on CPU is an OpenMP parallel region, and a region ends only when its last thread does.
When another process keeps one of the cores busy, the thread scheduled there runs in time slices, and
each region waits for it — a kernel that is one region (torch SDPA) pays once, a sweep of many small ops
pays at every op (measured: a statistics sweep at T = 4096 took 4× as long with two threads as with one
on a loaded two-core machine). Here the caller's thread count of workers each run whole jobs with torch
limited to one thread on that worker; a job that waits on a busy core is taken over by nobody, but the
other worker keeps taking jobs from the queue, so the work balances itself.

The workers are a process-wide pool created on first use. ``torch.set_num_threads(1)`` on a worker sets
OpenMP's and MKL's count for that thread only, but also torch's default for threads created later, so the
caller's count is restored as torch's default right after the workers start.

:func:`serial` is the same cure for the few small ops around one big kernel call (a check of its result,
a merge): run on this thread alone, they never wait for a busy core (a 512 K-element ``sum`` takes 0.1 ms
on one thread, and 10 ms when its parallel region waits for a time slice).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["run", "scratch", "serial"]

T = TypeVar("T")
R = TypeVar("R")

_LOCK = threading.Lock()
_POOLS: dict[int, ThreadPoolExecutor] = {}


def _after_fork() -> None:  # a forked child (a DataLoader worker) has none of the parent's threads
    global _LOCK
    _LOCK = threading.Lock()
    _POOLS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _one_thread(ready: threading.Barrier) -> None:
    torch.get_num_threads()  # torch sets a new thread's count on its first query: let it happen first
    torch.set_num_threads(1)
    ready.wait()


def _pool(workers: int) -> ThreadPoolExecutor:
    with _LOCK:
        ex = _POOLS.get(workers)
        if ex is None:
            caller = torch.get_num_threads()
            ready = threading.Barrier(workers + 1)
            ex = ThreadPoolExecutor(workers, thread_name_prefix="selfattention-sweep")
            for _ in range(workers):  # start every worker now, each sets its own thread count
                ex.submit(_one_thread, ready)
            ready.wait()
            torch.set_num_threads(caller)  # torch's default for later threads: the caller's count again
            _POOLS[workers] = ex
        return ex


def run(fn: Callable[[T], R], jobs: Iterable[T]) -> Iterator[R]:
    """``fn(job)`` for every job, results in job order. With torch at one thread (or one job) the jobs run
    here, one after the other; otherwise on ``torch.get_num_threads()`` single-threaded workers. ``fn``
    must be safe to run concurrently (jobs write disjoint outputs)."""
    jobs = list(jobs)
    workers = min(torch.get_num_threads(), len(jobs))
    if workers <= 1:
        return iter([fn(job) for job in jobs])
    ex = _pool(torch.get_num_threads())
    # the caller's inference mode travels with the jobs: tensors made under it accept in-place ops only there
    inference = torch.is_inference_mode_enabled()
    futures = [ex.submit(_guarded, fn, job, inference) for job in jobs]
    return iter([f.result() for f in futures])


def _guarded(fn: Callable[[T], R], job: T, inference: bool) -> R:
    with torch.inference_mode(inference), torch.no_grad():  # (inference_mode(False) turns grad on)
        return fn(job)


@contextlib.contextmanager
def serial() -> Iterator[None]:
    """Run the torch ops of the ``with`` block on the calling thread alone (``torch.set_num_threads(1)``,
    restored on exit; the count is the calling thread's own, so other threads are unaffected). For short
    auxiliary ops, never for the big kernel calls. A no-op under ``torch.compile`` (it would break the
    graph) and where torch already runs one thread.

    >>> import torch
    >>> n = torch.get_num_threads()
    >>> with serial():
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == n
    True
    """
    n = torch.get_num_threads()
    if n <= 1 or torch.compiler.is_compiling():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


_LOCAL = threading.local()


def scratch(
    name: str, sizes: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Flat buffers of at least ``sizes`` elements, kept per thread under ``name`` (a worker's scratch tiles:
    a fresh multi-MiB tile per job costs page faults on every allocation, more than the ops on it). They
    only grow; any dtype or device change makes new ones. Made outside inference mode, so that calls made
    later under grad mode may write them.

    >>> a, b = scratch("doc", (4, 8), torch.float32, torch.device("cpu"))
    >>> a.numel() >= 4 and b.numel() >= 8, scratch("doc", (2, 2), torch.float32, torch.device("cpu"))[0] is a
    (True, True)
    """
    store = _LOCAL.__dict__.setdefault("scratch", {})
    bufs = store.get(name)
    same = (
        bufs is not None and len(bufs) == len(sizes) and bufs[0].dtype == dtype and bufs[0].device == device
    )
    if not same or any(b.numel() < n for b, n in zip(bufs, sizes, strict=True)):
        old = [b.numel() for b in bufs] if same else [0] * len(sizes)
        with torch.inference_mode(False):
            bufs = tuple(
                torch.empty(max(n, o), dtype=dtype, device=device) for n, o in zip(sizes, old, strict=True)
            )
        store[name] = bufs
    return bufs
