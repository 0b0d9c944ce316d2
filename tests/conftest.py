"""Shared test setup: every test starts in English, whatever the machine's locale says; shared fixtures.

The CLI picks its language from ``--lang`` or the locale (``LANGUAGE``, ``LC_ALL``, ``LC_MESSAGES``,
``LANG``); tests that check English output must not turn Chinese on a machine with ``LANG=zh_CN.UTF-8``.
Tests of the Chinese interface set the variables themselves (``monkeypatch.setenv``).
"""

from __future__ import annotations

import sys

import pytest
import torch

from selfattention import i18n


@pytest.fixture(autouse=True)
def _english_by_default(monkeypatch):
    for var in ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG"):
        monkeypatch.delenv(var, raising=False)
    i18n.set_language("en")
    yield
    i18n.set_language("en")
    cli = sys.modules.get("selfattention.cli")
    if cli is not None:  # typer's panel titles follow the language of the last command run
        cli._typer_words()


@pytest.fixture(scope="module")
def hf_registered():
    """selfattention registered as a transformers attention backend, torch at one thread for the module."""
    from selfattention import hf

    hf.register()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["script", "python", "fused"])
def small_stat_tiles(request, monkeypatch):
    """The statistics sweep's job scripted and in plain Python, with tiles small enough for several key
    chunks, top-k spans and head groups at test sizes (the one-pass path for dense and causal problems
    switched off); and ``fused``: that one-pass path (:mod:`selfattention.kernels.stats_fused`) on, with
    row tiles of 8 rows, the sweep scripted for the problems it does not take."""
    from selfattention.kernels import stats, stats_fused, stats_tile

    fns = (stats_tile.row_tile, stats_tile.row_topk)
    if request.param != "python":
        fns = tuple(stats_tile.compiled(fn) for fn in fns)
    monkeypatch.setattr(stats_tile, "_COMPILED", dict(zip(("row_tile", "row_topk"), fns, strict=True)))
    if request.param == "fused":
        monkeypatch.setattr(stats_fused, "ROWS", 8)
    else:
        monkeypatch.setattr(stats_fused, "MAX_ROW_TILE", 0)
    monkeypatch.setattr(stats, "_ROWS", 8)
    monkeypatch.setattr(stats, "_COLS", 48)
    monkeypatch.setattr(stats, "_SPAN", 2)
    monkeypatch.setattr(stats, "_TILE", 8 * 48 * 2)  # two key heads per job at most
    return request.param
