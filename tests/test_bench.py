"""Smoke test of ``selfattention bench`` (tiny sizes; no timing is asserted)."""

from __future__ import annotations

import json

from selfattention.bench import BenchConfig, run_bench, to_markdown
from selfattention.cli import main


def test_bench_cli_quick_writes_json_and_markdown(tmp_path):
    code = main(
        ["bench", "--quick", "--sizes", "64", "--repeats", "1", "--long-t", "0", "--out", str(tmp_path)]
    )
    assert code == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    impls = {(r["variant"], r["pass"], r["impl"]) for r in result["rows"]}
    for variant in ("dense", "causal"):
        for pss in ("fwd", "fwd+bwd"):
            assert {(variant, pss, name) for name in ("reference", "tiled", "sdpa")} <= impls
    tiled = [r for r in result["rows"] if r["impl"] == "tiled"]
    assert all(r["ratio_vs_sdpa"] > 0 and r["median_s"] > 0 for r in tiled)
    assert result["meta"]["matmul_peak_gflops"] > 0
    table = (tmp_path / "bench.md").read_text()
    assert "| 64 | 2 | causal | fwd+bwd |" in table and "tiled/SDPA" in table


def test_window_variant_and_skipped_reference_are_reported():
    cfg = BenchConfig(
        sizes=(96,),
        heads=1,
        head_dim=8,
        variants=("window",),
        passes=("fwd",),
        window=16,
        window_min_t=0,
        repeats=1,
        reference_max_t=32,
        peak_size=64,
        long_t=None,
    )
    result = run_bench(cfg, progress=False)
    names = {r["impl"] for r in result["rows"]}
    assert names == {"tiled", "sdpa"}  # the reference is skipped above reference_max_t, and says so
    assert any("reference at T=96" in s for s in result["meta"]["skipped"])
    (row,) = [r for r in result["rows"] if r["impl"] == "tiled"]
    assert 0 < row["visible_fraction"] < 0.2
    assert "window 16" in to_markdown(result) and "(bool mask)" in to_markdown(result)


def test_bad_sizes_is_a_usage_error(capsys):
    assert main(["bench", "--sizes", "12,abc"]) == 2
    assert "--sizes" in capsys.readouterr().err
