"""Adversarial learner code for ``selfattention.grade`` (the breaker's pass): correct implementations in
unusual styles must pass, misbehaving code (``sys.exit``, a missing import, a flood of prints, an endless
loop) must become a finding, never the end of the grader."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from selfattention.grade import fit, grade, grade_file


def _stable_by_hand(q, k, v, mask=None):
    s = q @ k.T / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.max(dim=-1, keepdim=True).values
    e = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    z = e.sum(-1, keepdim=True)
    return torch.where(z > 0, e / z.clamp_min(1e-30), torch.zeros_like(e)) @ v


def _float64_indexed_fill(q, k, v, mask=None):
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.T * q.shape[-1] ** -0.5
    if mask is not None:
        s[~mask] = float("-inf")
    return torch.nan_to_num(torch.softmax(s, -1), nan=0.0) @ v


def _in_place_ops(q, k, v, mask=None):
    s = q.matmul(k.t())
    s.div_(q.size(1) ** 0.5)
    if mask is not None:
        s.masked_fill_(mask.logical_not(), -1e9)
    w = s.softmax(-1)
    if mask is not None:
        w.mul_(mask.any(-1, keepdim=True))
    return w @ v


def _returns_out_and_weights(q, k, v, mask=None):
    s = q @ k.T / q.shape[-1] ** 0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    w = torch.nan_to_num(torch.softmax(s, -1))
    return w @ v, w


def _numpy(q, k, v, mask=None):
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    s = q @ k.T / np.sqrt(q.shape[1])
    if mask is not None:
        s = np.where(np.asarray(mask), s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    m[~np.isfinite(m)] = 0
    e = np.exp(s - m)
    z = e.sum(axis=1, keepdims=True)
    return np.divide(e, z, out=np.zeros_like(e), where=z > 0) @ v


@pytest.mark.parametrize(
    "fn", [_stable_by_hand, _float64_indexed_fill, _in_place_ops, _returns_out_and_weights, _numpy]
)
def test_correct_sdpa_in_unusual_styles_passes(fn):
    report = grade(fn, task="sdpa")
    assert report.passed and report.codes == [], report.codes


class _BiasedModule(torch.nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.W_query = torch.nn.Linear(d_in, d_out, bias=True)
        self.W_key = torch.nn.Linear(d_in, d_out, bias=True)
        self.W_value = torch.nn.Linear(d_in, d_out, bias=True)

    def forward(self, x):
        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)
        return torch.softmax(q @ k.T / k.shape[-1] ** 0.5, dim=-1) @ v


def test_module_with_biased_linears_passes():
    assert grade(_BiasedModule, task="module").passed


def test_numpy_simple_attention_passes():
    def simple_attention(X):
        X = np.array(X)
        s = X @ X.T
        e = np.exp(s - s.max(1, keepdims=True))
        return (e / e.sum(1, keepdims=True)) @ X

    assert grade(simple_attention).passed


def test_sys_exit_in_a_probe_is_a_finding_not_the_end_of_the_grader():
    def simple_attention(X):
        sys.exit(3)

    report = grade(simple_attention)  # before the fix: SystemExit escaped and ended the process
    assert report.codes == ["exception"] and "SystemExit: 3" in report.findings[0].detail
    assert not report.passed


def test_sys_exit_while_loading_and_a_missing_import(tmp_path):
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(0)\ndef simple_attention(X):\n    return X\n", encoding="utf-8")
    assert "SystemExit: 0" in grade_file(exits, task="simple").findings[0].detail
    missing = tmp_path / "missing.py"
    missing.write_text(
        "import not_a_module_xyz_123\ndef simple_attention(X):\n    return X\n", encoding="utf-8"
    )
    report = grade_file(missing, task="simple")
    assert report.codes == ["exception"] and "not_a_module_xyz_123" in report.findings[0].detail


def test_prints_go_to_stderr_and_an_endless_loop_is_cut(tmp_path, capsys, monkeypatch):
    noisy = tmp_path / "noisy.py"
    noisy.write_text(
        "import torch\nprint('loading ' * 1000)\ndef simple_attention(X):\n"
        "    print('x' * 10000)\n    return torch.softmax(X @ X.T, -1) @ X\n",
        encoding="utf-8",
    )
    assert grade_file(noisy).passed
    assert capsys.readouterr().out == ""  # stdout may carry the JSON report
    monkeypatch.setattr(fit, "TIME_LIMIT", 0.5)

    def simple_attention(X):
        while True:
            pass

    import time

    start = time.perf_counter()
    report = grade(simple_attention)
    assert report.codes == ["exception"] and "TimeLimitExceeded" in report.findings[0].detail
    # cut once, not once per probe (4 × TIME_LIMIT before; CLI breaker run)
    assert time.perf_counter() - start < 2 * 0.5 + 1.0


def test_an_additive_causal_mask_is_correct_even_where_every_key_is_visible():
    # before the fix: the all-zero additive mask of (1, 5) read as a 0/1 mask with nothing visible, and a
    # correct additive causal_mask came out "unrecognised"
    def causal_mask(q_len, k_len):
        keep = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
        return torch.zeros(q_len, k_len).masked_fill(~keep, float("-inf"))

    report = grade(causal_mask)
    assert report.passed and report.codes == [], report.codes

    def top_left(q_len, k_len):
        keep = torch.ones(q_len, k_len, dtype=torch.bool).tril()
        return torch.zeros(q_len, k_len).masked_fill(~keep, float("-inf"))

    assert grade(top_left, task="causal").codes == ["causal_top_left"]

    def nothing_visible_01(q_len, k_len):  # a 0/1 mask of zeros still means nothing is visible
        return torch.zeros(q_len, k_len)

    assert not grade(nothing_visible_01, task="causal").passed


def test_a_learner_that_modifies_its_inputs_is_told():
    def scaled_dot_product_attention(q, k, v, mask=None):
        q /= q.shape[-1] ** 0.5
        s = q @ k.T
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.nan_to_num(torch.softmax(s, -1)) @ v

    report = grade(scaled_dot_product_attention)
    assert not report.passed and report.codes == ["mutates_input"]


def test_os_exit_and_base_exceptions_are_findings(tmp_path):
    """``os._exit(0)`` in the learner's code ended the grader with exit 0 and no report (an autograder read
    success); a bare ``BaseException`` printed the grader's own traceback (CLI breaker run)."""
    import os

    real = os._exit

    def hard(X):
        os._exit(0)

    def base(X):
        raise BaseException("boom")

    for fn, text in ((hard, "os._exit(0) called"), (base, "BaseException: boom")):
        report = grade(fn, task="simple")
        assert report.codes == ["exception"] and text in report.findings[0].detail and not report.passed
    assert os._exit is real
    loads = tmp_path / "loads.py"
    loads.write_text("import os\nos._exit(0)\ndef simple_attention(X):\n    return X\n", encoding="utf-8")
    assert "os._exit(0) called" in grade_file(loads, task="simple").findings[0].detail


def test_a_nested_list_result_is_the_output_and_data_writes_are_mutations():
    """``out.tolist()`` is graded as the output (it was read as (output, weights, …): wrong shape); writing
    through ``.data`` or numpy changes the caller's tensor without moving torch's version counter."""

    def as_list(X):
        return (torch.softmax(X @ X.T, dim=-1) @ X).tolist()

    assert grade(as_list, task="simple").passed

    def through_data(q, k, v, mask=None):
        q.data.div_(math.sqrt(q.shape[-1]))
        s = q @ k.transpose(-2, -1)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0) @ v

    def through_numpy(q, k, v, mask=None):
        q.numpy()[...] /= math.sqrt(q.shape[-1])
        s = q @ k.transpose(-2, -1)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0) @ v

    for fn in (through_data, through_numpy):
        report = grade(fn, task="sdpa")
        assert "mutates_input" in report.codes and not report.passed, fn.__name__
