"""The subset of flash-attn's adapted test file (test_flash_attn.py; other files in tests/peer are left
alone) that `make test` runs (≲ 60 s on 2 cores).

``FLASH_PEER_FULL=1`` keeps every parametrization of the original file (about 204 000 cases: hours on
CPU); ``FLASH_PEER_SAMPLE=N`` keeps a fixed pseudo-random sample of N of them (by a hash of the test id:
the same N give the same cases) — a wider check than the subset, in minutes. Otherwise each parametrize
list of the file is cut before the cases are generated: for every parameter named in :data:`SMALL` only
those values are kept (or the first value, when a test has none of them); parameters not named here keep
all their values (causal, local, alibi, dropout, softcap, swaps, mha types).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

_FILE = "test_flash_attn.py"

SMALL = {
    "dtype": {torch.bfloat16},
    "deterministic": {False},
    "d": {59},
    "seqlen": {97, 17},
    "seqlen_q": {113, 1, 3},
    "seqlen_k": {203, 239, 799},
    "mha_type": {"gqa"},
    "kvpacked": {False},
    "paged_kv_block_size": {None, 256},
}


def _keep(names: list[str], value) -> bool:
    vals = value if len(names) > 1 else (value,)
    return all(n not in SMALL or v in SMALL[n] for n, v in zip(names, vals, strict=True))


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    if os.environ.get("FLASH_PEER_FULL") == "1" or os.environ.get("FLASH_PEER_SAMPLE"):
        return
    if (
        metafunc.definition.path.name != _FILE
    ):  # only flash-attn's adapted file (peers of others may live here)
        return
    marks = metafunc.definition.own_markers
    for i, mark in enumerate(marks):
        if mark.name != "parametrize":
            continue
        argnames, values = mark.args[0], list(mark.args[1])
        names = [n.strip() for n in argnames.split(",")] if isinstance(argnames, str) else list(argnames)
        kept = [v for v in values if _keep(names, v)] or values[:1]
        marks[i] = type(mark)(mark.name, (argnames, kept, *mark.args[2:]), mark.kwargs, _ispytest=True)


def pytest_collection_modifyitems(config, items):
    n = os.environ.get("FLASH_PEER_SAMPLE")
    if not n or os.environ.get("FLASH_PEER_FULL") == "1":
        return
    mine = [it for it in items if it.path.name == _FILE]
    ranked = sorted(mine, key=lambda it: zlib.crc32(it.nodeid.encode()))
    drop = {id(it) for it in ranked[int(n) :]}
    config.hook.pytest_deselected(items=[it for it in items if id(it) in drop])
    items[:] = [it for it in items if id(it) not in drop]
