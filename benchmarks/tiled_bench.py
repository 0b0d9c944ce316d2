"""Tiled attention vs torch SDPA (and the reference): writes bench.json and bench.md.

Usage (what the README's table came from):

    .venv/bin/python benchmarks/tiled_bench.py --out benchmarks/results

Same as ``selfattention bench``; any of its options may be passed (``--quick``, ``--sizes``, ...).
``--contended`` adds a bounded background load (one spinning process on one core, started and killed by
the benchmark) and prints quiet and contended ratios side by side, e.g.

    .venv/bin/python benchmarks/tiled_bench.py --variants stats,causal --passes fwd --contended
"""

from __future__ import annotations

import sys

from selfattention.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
