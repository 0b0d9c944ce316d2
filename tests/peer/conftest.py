"""The subset of flash-attn's adapted test file that `make test` runs (≲ 60 s on 2 cores).

``FLASH_PEER_FULL=1`` keeps every parametrization of the original file. Otherwise, for each test function
and each parameter, only the values in :data:`SMALL` are kept (or the first value, when the test has none
of them); parameters not named here keep all their values (causal, local, alibi, dropout, softcap, swaps).
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch

SMALL = {
    "dtype": {torch.bfloat16},
    "deterministic": {False},
    "d": {59},
    "seqlen": {97, 17},
    "seqlen_q": {113, 1, 3},
    "seqlen_k": {203, 239, 799},
    "mha_type": {"gqa"},
    "kvpacked": {False},
}


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FLASH_PEER_FULL") == "1":
        return
    here = os.path.dirname(__file__)
    mine = [it for it in items if str(it.fspath).startswith(here) and hasattr(it, "callspec")]
    values: dict[tuple[str, str], list] = defaultdict(list)
    for it in mine:
        for name, val in it.callspec.params.items():
            if val not in values[(it.originalname, name)]:
                values[(it.originalname, name)].append(val)
    allowed = {}
    for (fn, name), vals in values.items():
        if name in SMALL:
            keep = [v for v in vals if v in SMALL[name]]
            allowed[(fn, name)] = keep or vals[:1]
    drop = []
    for it in mine:
        params = it.callspec.params
        if any(
            (it.originalname, n) in allowed and v not in allowed[(it.originalname, n)]
            for n, v in params.items()
        ):
            drop.append(it)
    if drop:
        gone = set(map(id, drop))
        config.hook.pytest_deselected(items=drop)
        items[:] = [it for it in items if id(it) not in gone]
