"""Tiled attention vs torch SDPA (and the reference): writes bench.json and bench.md.

Usage (what the README's table came from):

    .venv/bin/python benchmarks/tiled_bench.py --out benchmarks/results

Same as ``selfattention bench``; any of its options may be passed (``--quick``, ``--sizes``, ...).
"""

from __future__ import annotations

import sys

from selfattention.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
