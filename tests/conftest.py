"""Shared fixtures."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No OTEL_* / ENGINE_STUB_* variable from the caller's environment; engine_stub loads no plugin.
    Returns the monkeypatch, to set the variables a test needs."""
    for key in list(os.environ):
        if key.startswith(("OTEL_", "ENGINE_STUB_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("ENGINE_STUB_PLUGINS", "")
    return monkeypatch
