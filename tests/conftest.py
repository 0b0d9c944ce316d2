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


@pytest.fixture(params=["script", "python"])
def small_stat_tiles(request, monkeypatch):
    """The statistics sweep's job scripted and in plain Python, with tiles small enough for several key
    chunks, top-k spans and head groups at test sizes."""
    from selfattention.kernels import stats, stats_tile

    fn = stats_tile.compiled() if request.param == "script" else stats_tile.row_tile
    monkeypatch.setattr(stats_tile, "_COMPILED", [fn])
    monkeypatch.setattr(stats, "_ROWS", 8)
    monkeypatch.setattr(stats, "_COLS", 48)
    monkeypatch.setattr(stats, "_SPAN", 2)
    monkeypatch.setattr(stats, "_TILE", 8 * 48 * 2)  # two key heads per job at most
    return request.param
