"""vLLM's Rust frontend calls no stat-logger plugin: the plugin's general entry point (run in every
vLLM process) starts the engine-core stream's consumer in ``vllm serve``'s own process (the one
that makes the channel folder) and the hand-over in the processes it starts, whoever starts them
(multiprocessing, Ray); under the Python frontend, neither."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any, Iterator

import pytest

from otel_llm.integrations.vllm.channels import cause_channel, stream_channel
from otel_llm.integrations.vllm.engine_core import engine_tap
from otel_llm.integrations.vllm.frontend import engine_workers, frontend
from otel_llm.integrations.vllm.frontend.stream_consumer import StreamConsumer


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Iterator[list[Any]]:
    started: list[Any] = []
    monkeypatch.setattr(frontend, "_started", started)
    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "0")  # the frontend's parts alone (the deep hook has its tests)
    monkeypatch.delenv(cause_channel.ENV, raising=False)
    yield started
    for part in started:
        if isinstance(part, StreamConsumer):
            part.close()
    engine_tap.uninstall()
    engine_workers.uninstall()
    os.environ.pop(cause_channel.ENV, None)


def test_in_vllm_serves_process_the_consumer_starts_once(fresh, monkeypatch, caplog):
    from otel_llm.integrations.vllm.frontend.deep_hook import register

    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    with caplog.at_level(logging.INFO, logger="otel_llm.integrations.vllm.frontend.frontend"):
        register()
        register()  # vLLM may load general plugins more than once in a process
    [consumer] = fresh
    assert isinstance(consumer, StreamConsumer)
    path = os.environ[cause_channel.ENV]  # made here: the engine cores inherit it
    assert os.path.exists(os.path.join(path, stream_channel.SOCKET_NAME))
    [line] = [r.getMessage() for r in caplog.records]
    assert "VLLM_USE_RUST_FRONTEND=1: recording vLLM's engine-core stream in this process" in line


def _folder_made_by(path: Any, pid: int) -> str:
    (path / cause_channel.OWNER).write_text(str(pid))
    return str(path)


def test_in_an_engine_core_the_hand_over_attaches(fresh, monkeypatch, tmp_path):
    """A process that inherits the folder of a live vllm serve is one it started, with or without a
    multiprocessing parent (Ray's data-parallel workers have none)."""
    from vllm.v1.engine.core import EngineCore

    from otel_llm.integrations.vllm.frontend.deep_hook import register

    original = EngineCore.add_request
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    monkeypatch.setenv(cause_channel.ENV, _folder_made_by(tmp_path, os.getppid()))  # vllm serve's, running
    register()
    assert fresh == [engine_tap] and EngineCore.add_request is not original


def test_a_folder_left_by_a_serve_that_ended_is_not_taken_for_this_serves(fresh, monkeypatch, tmp_path):
    """The variable left in an environment by a vllm serve that has ended: this process is a new
    vllm serve, with a folder of its own."""
    from otel_llm.integrations.vllm.frontend.deep_hook import register

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    monkeypatch.setenv(cause_channel.ENV, _folder_made_by(tmp_path, int(ended.stdout)))
    register()
    [consumer] = fresh
    assert isinstance(consumer, StreamConsumer)
    path = os.environ[cause_channel.ENV]
    assert path != str(tmp_path) and os.path.exists(os.path.join(path, stream_channel.SOCKET_NAME))


@pytest.mark.parametrize("value", [None, "0", "no"])
def test_python_frontend_starts_neither(fresh, monkeypatch, value):
    from vllm.v1.engine.core import EngineCore

    from otel_llm.integrations.vllm.frontend.deep_hook import register

    if value is None:
        monkeypatch.delenv("VLLM_USE_RUST_FRONTEND", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", value)
    original = EngineCore.add_request
    register()
    assert fresh == [] and EngineCore.add_request is original and cause_channel.ENV not in os.environ


def test_vllm_serve_started_by_a_python_supervisor_still_runs_the_consumer(fresh, monkeypatch):
    """A multiprocessing parent (a supervisor) but no channel folder inherited: vllm serve's own."""
    import multiprocessing

    from otel_llm.integrations.vllm.frontend.deep_hook import register

    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    register()
    [consumer] = fresh
    assert isinstance(consumer, StreamConsumer)
