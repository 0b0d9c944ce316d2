"""Shared test setup: every test starts in English, whatever the machine's locale says.

The CLI picks its language from ``--lang`` or the locale (``LANGUAGE``, ``LC_ALL``, ``LC_MESSAGES``,
``LANG``); tests that check English output must not turn Chinese on a machine with ``LANG=zh_CN.UTF-8``.
Tests of the Chinese interface set the variables themselves (``monkeypatch.setenv``).
"""

from __future__ import annotations

import sys

import pytest

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
