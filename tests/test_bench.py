"""Smoke test of ``selfattention bench`` (tiny sizes; no timing is asserted)."""

from __future__ import annotations

import json

from selfattention.bench import BenchConfig, run_bench, to_markdown
from selfattention.cli import main


def test_bench_cli_quick_writes_json_and_markdown_and_no_partial_file(tmp_path):
    code = main(["bench", "--quick", "--sizes", "64", "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "bench.md"]
    result = json.loads((tmp_path / "bench.json").read_text())
    impls = {(r["variant"], r["pass"], r["impl"]) for r in result["rows"]}
    for variant in ("dense", "causal"):
        for pss in ("fwd", "fwd+bwd"):
            assert {(variant, pss, name) for name in ("reference", "tiled", "sdpa")} <= impls
    for variant in ("window", "documents"):
        assert {(variant, "fwd", "tiled"), (variant, "fwd", "sdpa")} <= impls
    assert ("stats", "fwd", "tiled") in impls
    tiled = [r for r in result["rows"] if r["impl"] == "tiled"]
    assert all(r["ratio_vs_sdpa"] > 0 and r["median_s"] > 0 for r in tiled)
    assert all(r["kernel"] == "vendor" and r["strategy"] for r in tiled)
    assert {r["strategy"] for r in tiled} >= {"single", "causal", "window", "documents"}
    assert result["meta"]["matmul_peak_gflops"] > 0
    table = (tmp_path / "bench.md").read_text()
    assert "| 64 | 2 | causal | fwd+bwd |" in table and "tiled/SDPA" in table and "tiled/flex" in table


def test_skipped_peers_and_the_reference_limit_are_reported():
    cfg = BenchConfig(
        sizes=(96,),
        heads=1,
        head_dim=8,
        variants=("causal",),
        passes=("fwd+bwd",),
        repeats=1,
        reference_max_t=32,
        peak_size=64,
        flex=True,
    )
    result = run_bench(cfg, progress=False)
    names = {r["impl"] for r in result["rows"]}
    assert names == {"tiled", "sdpa"}  # no reference above reference_max_t; flex has no CPU backward
    assert any("no CPU backward" in s for s in result["meta"]["skipped"])
    assert "Left out: flex" in to_markdown(result)


def test_bad_sizes_is_a_usage_error(capsys):
    assert main(["bench", "--sizes", "12,abc"]) == 2
    assert "--sizes" in capsys.readouterr().err
    assert main(["bench", "--variants", "dense,blocks"]) == 2
    assert "--variants" in capsys.readouterr().err


def test_bench_contended_reports_both_ratios_and_leaves_no_spinner(tmp_path):
    code = main(
        ["bench", "--quick", "--sizes", "64", "--variants", "causal,stats", "--passes", "fwd",
         "--repeats", "1", "--contended", "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    tiled = [r for r in result["rows"] if r["impl"] == "tiled"]
    assert {r["variant"] for r in tiled} == {"causal", "stats"}
    for r in tiled:
        assert r["median_s_contended"] > 0 and r["ratio_vs_sdpa_contended"] > 0
        assert abs(r["contention_vs_sdpa"] - r["ratio_vs_sdpa_contended"] / r["ratio_vs_sdpa"]) < 1e-9
    table = (tmp_path / "bench.md").read_text()
    assert "tiled/SDPA busy" in table and "| 64 | 2 | causal | fwd |" in table.split("Contended")[1]


def test_spinner_runs_only_when_busy_and_dies_on_close():
    import os
    import time

    from selfattention.bench import Spinner

    def cpu_s(pid):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    with Spinner(limit_s=30) as sp:
        pid = sp.proc.pid
        time.sleep(0.3)
        paused = cpu_s(pid)
        time.sleep(0.3)
        assert cpu_s(pid) - paused < 0.05  # stopped: no CPU time
        sp.busy(True)
        time.sleep(0.5)
        assert cpu_s(pid) - paused > 0.05  # running
    assert sp.proc.poll() is not None  # killed and reaped


def test_visible_fraction_is_the_share_of_pairs_the_mask_lets_through():
    """The fraction the GFLOP/s are scaled by, against a count of the True entries of an independent mask
    (T = 100 is no multiple of the 8 documents nor of the window 7)."""
    import torch

    from selfattention.bench_cases import visible_fraction

    t = 100
    q = torch.arange(t)[:, None]
    kv = torch.arange(t)[None, :]
    ids = torch.clamp(torch.arange(t) // (t // 8), max=7)  # 8 documents of 12, the last one takes the rest
    oracle = {
        "dense": torch.ones(t, t, dtype=torch.bool),
        "causal": q >= kv,
        "stats": q >= kv,
        "window": (q >= kv) & (q - kv < 7),
        "documents": ids[:, None] == ids[None, :],
    }
    for variant, mask in oracle.items():
        spec = {"t": t, "variant": variant, "window": 7, "documents": 8}
        assert abs(visible_fraction(spec) - mask.sum().item() / t**2) < 1e-12, variant
    assert visible_fraction({"t": 96, "variant": "documents", "documents": 8}) == 1 / 8


def test_case_masks_agree_with_each_other():
    """The dense bool mask SDPA gets and the mask_mod flex gets say the same for window and documents."""
    import torch

    from selfattention.bench_cases import case_masks

    t = 50
    q, kv = torch.arange(t)[:, None], torch.arange(t)[None, :]
    for variant in ("window", "documents"):
        kw, dense, mod = case_masks({"t": t, "variant": variant, "window": 6, "documents": 4})
        assert kw and dense.shape == (t, t)
        assert torch.equal(dense, mod(0, 0, q, kv)), variant
        assert 0 < dense.float().mean() < 1


def test_table_formatters():
    from selfattention.bench_table import fmt_ratio, fmt_seconds

    assert [fmt_seconds(x) for x in (None, 0.0123, 0.9994, 1.0, 12.345)] == [
        "—",
        "12.3 ms",
        "999.4 ms",
        "1.00 s",
        "12.35 s",
    ]
    assert [fmt_ratio(x) for x in (None, 0.0, 1.005, 2.5)] == ["—", "0.00", "1.00", "2.50"]


def test_the_split_modules_are_reexported_and_the_child_entry_point_stays():
    import subprocess
    import sys

    from selfattention import bench, bench_cases, bench_measure, bench_table

    assert bench.Spinner is bench_measure.Spinner
    assert bench.matmul_peak_gflops is bench_measure.matmul_peak_gflops
    assert bench.to_markdown is bench_table.to_markdown and bench.write_results is bench_table.write_results
    assert bench.VARIANTS is bench_cases.VARIANTS
    proc = subprocess.run([sys.executable, "-m", "selfattention.bench"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--child SPEC" in proc.stdout
