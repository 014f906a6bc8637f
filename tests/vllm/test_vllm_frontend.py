"""vLLM's Rust frontend calls no stat-logger plugin: the plugin's general entry point (run in
vLLM's Python processes) says so, once, naming the variable."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def fresh(monkeypatch):
    from otel_llm.integrations.vllm import frontend

    monkeypatch.setattr(frontend, "_warned", [])
    monkeypatch.delenv("OTEL_LLM_VLLM_DEEP_HOOK", raising=False)


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "Rust frontend" in r.getMessage()
    ]


def test_rust_frontend_is_named_once(fresh, monkeypatch, caplog):
    from otel_llm.integrations.vllm.deep_hook import register

    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    with caplog.at_level(logging.WARNING):
        register()
        register()  # vLLM may load general plugins more than once in a process
    (line,) = _warnings(caplog)
    assert "VLLM_USE_RUST_FRONTEND=1" in line and "/metrics" in line


@pytest.mark.parametrize("value", [None, "0", "no"])
def test_python_frontend_says_nothing(fresh, monkeypatch, caplog, value):
    from otel_llm.integrations.vllm.deep_hook import register

    if value is None:
        monkeypatch.delenv("VLLM_USE_RUST_FRONTEND", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", value)
    with caplog.at_level(logging.WARNING):
        register()
    assert _warnings(caplog) == []
