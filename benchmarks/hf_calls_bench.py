"""Single attention calls of selfattention.hf against transformers' own attention functions, in one process.

Two figures that the model benchmark (benchmarks/hf_bench.py) does not show:

* a T5-shaped call (B = 1, 4 heads of 32, a dense (1, H, T, T) position bias, two padded keys):
  forward + backward with the bias requiring grad, and the forward without grad, ours / transformers'
  ``sdpa_attention_forward`` (the bias-gradient route runs the engine's exact kernel, which returns dS);
* a gpt-oss-shaped call (4 heads of 16, window 128): ours with ``s_aux`` sinks / ours without them (the
  sinks cost one rescale by the log-sum-exp; the materialising route took 11–19× here).

Medians of 5 calls after one warm-up, one thread::

    PYTHONPATH=src .venv/bin/python benchmarks/hf_calls_bench.py
"""

from __future__ import annotations

import statistics
import time
import types

import torch


def _median(fn, n: int = 5) -> float:
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _module(causal: bool, groups: int = 1):
    m = types.SimpleNamespace(is_causal=causal, training=False, num_key_value_groups=groups)
    m.config = None
    return m


def t5_rows(seq_lens=(256, 1024)) -> None:
    from transformers import masking_utils as mu
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import selfattention.hf as hf

    module = _module(False)
    print("| T5-shaped call | T | ours ms | sdpa ms | ours / sdpa |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for t in seq_lens:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 4, t, 32, generator=g, requires_grad=True) for _ in range(3))
        bias = torch.randn(1, 4, t, t, generator=g, requires_grad=True)
        pad = torch.ones(1, t, dtype=torch.bool)
        pad[0, -2:] = False
        fn = mu.bidirectional_mask_function
        lazy = hf.attention_mask(1, t, t, mask_function=fn, attention_mask=pad)
        dense = mu.sdpa_mask(1, t, t, mask_function=fn, attention_mask=pad, allow_is_causal_skip=False)

        def run(impl, mask, grad, q=q, k=k, v=v, bias=bias):
            with torch.set_grad_enabled(grad):
                out, _ = impl(module, q, k, v, mask, scaling=1.0, position_bias=bias)
                if grad:
                    out.sum().backward()

        for grad in (True, False):
            a = _median(lambda: run(hf.attention_forward, lazy, grad))  # noqa: B023
            b = _median(lambda: run(sdpa_attention_forward, dense, grad))  # noqa: B023
            what = "fwd+bwd, bias grad" if grad else "forward, no grad"
            print(f"| {what} | {t} | {1e3 * a:.1f} | {1e3 * b:.1f} | {a / b:.2f} |", flush=True)


def sink_rows(seq_lens=(2048, 8192)) -> None:
    from transformers import masking_utils as mu

    import selfattention.hf as hf

    module = _module(True)
    print("| gpt-oss-shaped call | T | with sinks ms | without ms | with / without |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for t in seq_lens:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 4, t, 16, generator=g) for _ in range(3))
        sinks = torch.randn(4, generator=g)
        lazy = hf.attention_mask(1, t, t, mask_function=mu.sliding_window_causal_mask_function(128))
        with torch.no_grad():
            w = _median(lambda: hf.attention_forward(module, q, k, v, lazy, scaling=0.25, s_aux=sinks))  # noqa: B023
            wo = _median(lambda: hf.attention_forward(module, q, k, v, lazy, scaling=0.25))  # noqa: B023
        print(f"| window 128, s_aux | {t} | {1e3 * w:.1f} | {1e3 * wo:.1f} | {w / wo:.2f} |", flush=True)


def main() -> int:
    import os

    import selfattention.hf as hf

    hf.register()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    t5_rows()
    sink_rows()
    print(f"load average at start/end: {load:.2f} / {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
