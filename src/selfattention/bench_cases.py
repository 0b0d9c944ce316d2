"""The cases of ``selfattention bench``: what each variant lets a query see, the implementations timed on
it, and the child process that measures one case (``python -m selfattention.bench --child SPEC``).

A case is a JSON-able spec (a dict: ``t``, ``heads``, ``head_dim``, ``batch``, ``variant``, ``pass``,
``window``, ``documents``, ``top_k``, ``repeats``, ``reference_max_t``, ``flex``, ``block_q``, ``block_k``,
``threads``, ``contended``; see :func:`selfattention.bench.run_bench`). Variants: ``dense``, ``causal``,
``window`` (sliding window), ``documents`` (packed documents of T/``documents`` tokens), and the
statistics ``stats`` (log-sum-exp, entropy, top-k keys, column sums) and ``stats0`` (no top-k), causal.

:func:`measure_case` first measures **memory** (:func:`~selfattention.bench_measure.peak_extra_mib`: that
call is also the warm-up, and flex's compile), then **time**: ``repeats`` rounds that call every
implementation in turn (interleaved, so a noisy neighbour slows them alike); the median is reported. With
``contended`` every round times each implementation twice, once with a
:class:`~selfattention.bench_measure.Spinner` stopped and once with it running.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from .bench_measure import Spinner, peak_extra_mib

__all__ = [
    "CAUSAL_VARIANTS",
    "MASKED_VARIANTS",
    "STATS_VARIANTS",
    "VARIANTS",
    "case_masks",
    "implementations",
    "measure_case",
    "visible_fraction",
]

VARIANTS = ("dense", "causal", "window", "documents", "stats", "stats0")
STATS_VARIANTS = ("stats", "stats0")
"""The statistics cases: timed against SDPA's causal forward."""
CAUSAL_VARIANTS = ("causal", *STATS_VARIANTS)
MASKED_VARIANTS = ("window", "documents")
"""The cases SDPA gets as a dense (T, T) bool mask (minutes a call at T = 16384: one sample)."""


def visible_fraction(spec: dict) -> float:
    """The fraction of the T × T (query, key) pairs the case's mask lets through (1.0 for dense)."""
    t, variant = spec["t"], spec["variant"]
    if variant == "dense":
        return 1.0
    if variant in CAUSAL_VARIANTS:
        return (t + 1) / (2 * t)
    if variant == "window":
        w = min(spec["window"], t)
        return (w * t - w * (w - 1) / 2) / t**2
    n = spec["documents"]
    size = t // n
    last = t - (n - 1) * size  # the last document takes the rest, as in case_masks
    return ((n - 1) * size**2 + last**2) / t**2  # 1 / n when n divides T


def case_masks(spec: dict):
    """(tiled kwargs, dense bool mask or None, flex mask_mod or None) of the case's visibility."""
    import torch

    from . import masks

    t, variant = spec["t"], spec["variant"]
    if variant == "dense":
        return {}, None, None
    if variant in CAUSAL_VARIANTS:
        return {"is_causal": True}, None, lambda b, h, q, kv: q >= kv
    if variant == "window":
        w = spec["window"]
        return (
            {"window": w},
            masks.sliding_window_mask(t, window=w),
            lambda b, h, q, kv: (q >= kv) & (q - kv < w),
        )
    ids = torch.arange(spec["documents"]).repeat_interleave(t // spec["documents"])
    ids = torch.cat([ids, ids.new_full((t - ids.numel(),), spec["documents"] - 1)])
    return {"document_ids": ids}, masks.document_mask(ids), lambda b, h, q, kv: ids[q] == ids[kv]


def implementations(spec: dict) -> tuple[dict[str, Any], dict[str, str]]:
    """name → callable(q, k, v) for one case, and the reasons peers are left out."""
    import torch
    import torch.nn.functional as tnf

    from . import functional
    from .tiled import tiled_attention, tiled_attention_with_stats

    t, variant, bwd = spec["t"], spec["variant"], spec["pass"] == "fwd+bwd"
    blocks = {"block_q": spec.get("block_q"), "block_k": spec.get("block_k")}
    kw, dense_mask, mask_mod = case_masks(spec)
    out: dict[str, Any] = {}
    missing: dict[str, str] = {}
    if variant in STATS_VARIANTS:  # stats0: output, entropy and column sums, no top-k
        top_k = spec["top_k"] if variant == "stats" else 0
        out["tiled"] = lambda q, k, v: tiled_attention_with_stats(q, k, v, top_k=top_k, **kw, **blocks)
        out["sdpa"] = lambda q, k, v: tnf.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out, missing
    if t <= spec["reference_max_t"] and dense_mask is None:
        out["reference"] = lambda q, k, v: functional.scaled_dot_product_attention(q, k, v, **kw)
    out["tiled"] = lambda q, k, v: tiled_attention(q, k, v, **kw, **blocks)
    if dense_mask is None:
        out["sdpa"] = lambda q, k, v: tnf.scaled_dot_product_attention(q, k, v, is_causal=variant == "causal")
    else:
        out["sdpa"] = lambda q, k, v: tnf.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask)
    if mask_mod is not None and spec["flex"]:
        if bwd:
            missing["flex"] = "flex_attention has no CPU backward"
        else:
            try:
                from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            except ImportError as e:
                missing["flex"] = f"flex_attention unavailable in torch {torch.__version__}: {e}"
            else:
                block_mask = create_block_mask(mask_mod, None, None, t, t, device="cpu")
                compiled = torch.compile(flex_attention)
                out["flex"] = lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
    return out, missing


def measure_case(spec: dict) -> None:
    """Measure one case; print one JSON line per implementation (the child process's whole work)."""
    import torch

    from .tiled import describe

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    t, h, d, b = spec["t"], spec["heads"], spec["head_dim"], spec["batch"]
    bwd = spec["pass"] == "fwd+bwd"
    q, k, v = (torch.randn(b, h, t, d, requires_grad=bwd) for _ in range(3))
    impls, missing = implementations(spec)
    kw, _, _ = case_masks(spec)
    plan = describe(q, k, v, **kw, block_q=spec.get("block_q"), block_k=spec.get("block_k"))

    def call(fn):
        out = fn(q, k, v)
        out = out[0] if isinstance(out, tuple) else out
        if bwd:
            out.backward(torch.ones_like(out))
            q.grad = k.grad = v.grad = None

    memory, first = {}, {}
    for name, fn in impls.items():  # the memory call doubles as the warm-up (and flex's compile)
        t0 = time.perf_counter()
        memory[name] = peak_extra_mib(lambda fn=fn: call(fn))
        first[name] = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in impls}
    busy_times: dict[str, list[float]] = {name: [] for name in impls}
    repeats = spec["repeats"]
    if repeats == 0:  # memory-only run: the one call is the time sample
        times = {name: [first[name]] for name in impls}
    # SDPA given a dense (T, T) bool mask at T = 16384 takes minutes a round: its warm-up call is its one
    # sample (the tiled path and flex still get every round)
    once = {"sdpa"} if spec["variant"] in MASKED_VARIANTS and repeats else set()
    for name in once:
        times[name] = [first[name]]
    contended = bool(spec.get("contended")) and repeats > 0
    spinner = Spinner() if contended else None
    try:
        names = list(impls)
        for r in range(repeats):
            for mode in ("quiet", "busy") if contended else ("quiet",):
                if spinner is not None:
                    spinner.busy(mode == "busy")
                # the order rotates every round: the first op after a long kernel runs on emptied caches,
                # so a fixed order would charge that to whoever always comes second
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    fn = impls[name]
                    samples = (busy_times if mode == "busy" else times)[name]
                    if name in once and (mode == "quiet" or samples):  # the slow peer: one busy sample
                        continue
                    t0 = time.perf_counter()
                    call(fn)
                    samples.append(time.perf_counter() - t0)
    finally:
        if spinner is not None:
            spinner.close()
    for name in impls:
        med = statistics.median(times[name])
        row = {
            **{key: spec[key] for key in ("t", "heads", "head_dim", "batch", "variant", "pass")},
            "impl": name,
            "median_s": med,
            "times_s": times[name],
            "extra_mib": memory[name],
            "visible_fraction": visible_fraction(spec),
            "threads": torch.get_num_threads(),
        }
        if busy_times[name]:
            row["median_s_contended"] = statistics.median(busy_times[name])
            row["times_s_contended"] = busy_times[name]
        if name == "flex":
            row["compile_s"] = max(0.0, first[name] - med)
        if name == "tiled":
            row.update(kernel=plan.kernel, reason=plan.reason, strategy=plan.strategy, calls=plan.calls)
        print(json.dumps(row), flush=True)
    for name, why in missing.items():
        print(
            json.dumps(
                {
                    **{key: spec[key] for key in ("t", "heads", "variant", "pass")},
                    "impl": name,
                    "missing": why,
                }
            )
        )
