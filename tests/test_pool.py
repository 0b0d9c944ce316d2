"""kernels/pool.py: jobs on single-threaded workers, results in order, the caller's threads untouched."""

from __future__ import annotations

import threading

import pytest
import torch

from selfattention.kernels import pool


def test_results_in_job_order_on_single_threaded_workers():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []

        def job(i):
            seen.append((threading.current_thread().name, torch.get_num_threads(), torch.is_grad_enabled()))
            return torch.full((3,), float(i)).sum().item()

        assert list(pool.run(job, range(7))) == [3.0 * i for i in range(7)]
        assert all(name.startswith("selfattention-sweep") for name, _, _ in seen)
        assert all(n == 1 and not grad for _, n, grad in seen)
        assert torch.get_num_threads() == 2  # the caller keeps its count
    finally:
        torch.set_num_threads(before)


def test_one_thread_runs_inline_and_errors_propagate():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        names = list(pool.run(lambda i: threading.current_thread().name, range(3)))
        assert names == [threading.current_thread().name] * 3
    finally:
        torch.set_num_threads(before)

    def bad(i):
        raise ValueError(f"job {i}")

    with pytest.raises(ValueError, match="job"):
        list(pool.run(bad, range(3)))


def test_a_forked_child_gets_its_own_workers():
    import os

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        list(pool.run(lambda i: i, range(4)))  # the parent's workers exist
        pid = os.fork()
        if pid == 0:  # child: must not wait for the parent's (absent) threads
            ok = list(pool.run(lambda i: i * 2, range(4))) == [0, 2, 4, 6]
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(before)
