"""vLLM's Rust frontend calls no stat-logger plugin: the plugin's general entry point (run in every
vLLM process) starts the engine-core stream's consumer in ``vllm serve``'s own process (no
multiprocessing parent) and the hand-over in the processes it starts; under the Python frontend,
neither."""

from __future__ import annotations

import logging
import multiprocessing
import os
from typing import Any, Iterator

import pytest

from otel_llm.integrations.vllm import cause_channel, engine_tap, frontend, stream_channel
from otel_llm.integrations.vllm.stream_consumer import StreamConsumer


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[list[Any]]:
    started: list[Any] = []
    monkeypatch.setattr(frontend, "_started", started)
    monkeypatch.delenv("OTEL_LLM_VLLM_DEEP_HOOK", raising=False)
    monkeypatch.delenv(cause_channel.ENV, raising=False)
    yield started
    for part in started:
        if isinstance(part, StreamConsumer):
            part.close()
    engine_tap.uninstall()
    os.environ.pop(cause_channel.ENV, None)


def test_in_vllm_serves_process_the_consumer_starts_once(fresh, monkeypatch, caplog):
    from otel_llm.integrations.vllm.deep_hook import register

    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    with caplog.at_level(logging.INFO, logger="otel_llm.integrations.vllm.frontend"):
        register()
        register()  # vLLM may load general plugins more than once in a process
    [consumer] = fresh
    assert isinstance(consumer, StreamConsumer)
    path = os.environ[cause_channel.ENV]  # made here: the engine cores inherit it
    assert os.path.exists(os.path.join(path, stream_channel.SOCKET_NAME))
    [line] = [r.getMessage() for r in caplog.records]
    assert "VLLM_USE_RUST_FRONTEND=1: recording vLLM's engine-core stream in this process" in line


def test_in_an_engine_core_the_hand_over_attaches(fresh, monkeypatch, tmp_path):
    from vllm.v1.engine.core import EngineCore

    from otel_llm.integrations.vllm.deep_hook import register

    original = EngineCore.add_request
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    monkeypatch.setenv(cause_channel.ENV, str(tmp_path))  # inherited from vllm serve's process
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    register()
    assert fresh == [engine_tap] and EngineCore.add_request is not original


@pytest.mark.parametrize("value", [None, "0", "no"])
def test_python_frontend_starts_neither(fresh, monkeypatch, value):
    from vllm.v1.engine.core import EngineCore

    from otel_llm.integrations.vllm.deep_hook import register

    if value is None:
        monkeypatch.delenv("VLLM_USE_RUST_FRONTEND", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", value)
    original = EngineCore.add_request
    register()
    assert fresh == [] and EngineCore.add_request is original and cause_channel.ENV not in os.environ


def test_vllm_serve_started_by_a_python_supervisor_still_runs_the_consumer(fresh, monkeypatch):
    """A multiprocessing parent (a supervisor) but no channel folder inherited: vllm serve's own."""
    from otel_llm.integrations.vllm.deep_hook import register

    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    register()
    [consumer] = fresh
    assert isinstance(consumer, StreamConsumer)
