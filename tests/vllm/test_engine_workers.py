"""A serve with several local engines: each engine after the first recorded in a process of its own
(``engine_workers``), through the real tap in real engine-core processes (:mod:`tap_engine`: vLLM's
``EngineCoreProc`` methods over its real scheduler), the real worker process, one Prometheus
endpoint in the serve and OTLP to a real receiver (``SpanReceiver``)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel_llm.integrations.vllm.frontend.engine_workers import start_workers
from otel_llm.integrations.vllm.frontend.stream_consumer import StreamConsumer
from otel_llm.testing.span_receiver import SpanReceiver, span_attributes
from tests.support.backends import free_port, wait_until

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The serve's consumer on providers from the environment, as in ``vllm serve``."""
    with SpanReceiver() as receiver:
        for key, value in {
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(free_port()),
            "OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=serve-w",
        }.items():
            monkeypatch.setenv(key, value)
        consumer = StreamConsumer(tempfile.mkdtemp(prefix="otel-llm-workers-")).start()
        consumer.receiver = receiver
        try:
            yield consumer
        finally:
            consumer.close()


def _run_engines(consumer: StreamConsumer, model_dir: str, counts: dict[int, int]) -> None:
    """Engine cores, one process each, ``counts[engine]`` requests each, run to their end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}
    engines = [
        subprocess.Popen(
            [sys.executable, str(HERE / "tap_engine.py"), consumer.folder, model_dir, str(engine), str(count)], env=env
        )
        for engine, count in counts.items()
    ]
    assert [e.wait(timeout=300) for e in engines] == [0] * len(engines)


def _recorded(consumer: StreamConsumer, total: int) -> tuple[dict[str, Any], str]:
    """The serve's endpoint once it counts ``total`` requests and the receiver holds their spans."""

    def scraped() -> Any:
        text = consumer._handles[0].prometheus.render()[0].decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        success = families.get("vllm:request_success")
        counted = success is not None and sum(s.value for s in success.samples if s.name.endswith("_total"))
        spans = len(consumer.receiver.named("llm_request"))
        return (families, text) if counted == total and spans == total else None

    return wait_until(scraped, 60, interval=0.1, what=f"{total} requests on /metrics and over OTLP")


def _spans_by_instance(receiver: SpanReceiver) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for span, instance in zip(receiver.spans, receiver.instances):
        if span.name == "llm_request":
            found.setdefault(instance, []).append(span_attributes(span)["gen_ai.request.id"])
    return {instance: sorted(ids) for instance, ids in found.items()}


def test_each_engine_after_the_first_is_recorded_in_a_process_of_its_own(serve: Any, model_dir: str) -> None:
    """Engine 0 on the serve's thread, engine 1 in its worker: one endpoint serves both engines'
    series (each family once, a ``target_info`` per engine), each engine pushes its own spans
    over OTLP as its own instance, and the worker ends cleanly when the serve closes."""
    start_workers(serve, [1])
    (worker,) = serve._workers
    _run_engines(serve, model_dir, {0: 4, 1: 3})
    families, text = _recorded(serve, 7)
    by_engine = {
        s.labels["engine"]: s.value for s in families["vllm:request_success"].samples if s.name.endswith("_total")
    }
    assert by_engine == {"0": 4, "1": 3}
    assert sorted(s.labels["service_instance_id"] for s in families["target_info"].samples) == [
        "serve-w-engine-0",
        "serve-w-engine-1",
    ]
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))  # each family once
    assert _spans_by_instance(serve.receiver) == {
        "serve-w-engine-0": [f"e0-r{i}" for i in range(4)],
        "serve-w-engine-1": [f"e1-r{i}" for i in range(3)],
    }
    assert sorted(serve._telemetry_by_index) == [0]  # engine 1 never reached the serve's own thread
    serve.close()
    assert worker.process.returncode == 0
    assert not os.path.exists(worker.path)


def test_a_worker_that_dies_hands_its_engine_to_the_serve(
    serve: Any, model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker is killed (a fault that cannot be caused otherwise): the serve says so once and
    removes its socket; its engine core's stream then goes to the serve's own consumer, which
    records it as that engine (same instance), and every scrape goes on."""
    caplog.set_level(logging.WARNING, logger="otel_llm.integrations.vllm")
    start_workers(serve, [1])
    (worker,) = serve._workers
    os.kill(worker.process.pid, signal.SIGKILL)
    wait_until(lambda: not os.path.exists(worker.path), 30, what="the dead worker's socket removed")
    _run_engines(serve, model_dir, {0: 2, 1: 3})
    families, _ = _recorded(serve, 5)
    by_engine = {
        s.labels["engine"]: s.value for s in families["vllm:request_success"].samples if s.name.endswith("_total")
    }
    assert by_engine == {"0": 2, "1": 3}
    assert _spans_by_instance(serve.receiver) == {
        "serve-w-engine-0": ["e0-r0", "e0-r1"],
        "serve-w-engine-1": ["e1-r0", "e1-r1", "e1-r2"],
    }
    said = [r for r in caplog.records if "recording process" in r.getMessage()]
    assert len(said) == 1 and "exit code -9" in said[0].getMessage()


def test_the_workers_start_where_vllm_launches_its_local_engines(serve: Any) -> None:
    """vLLM's own ``CoreEngineProcManager``, wrapped: asked for 3 local engines from index 4, it
    starts workers for 5 and 6 before vLLM's code runs (here it fails at once on a missing config,
    after the workers started: vLLM's own error, not ours)."""
    from vllm.v1.engine.utils import CoreEngineProcManager

    from otel_llm.integrations.vllm.frontend import engine_workers

    assert engine_workers.install(serve)
    try:
        with pytest.raises(AttributeError):
            CoreEngineProcManager(
                local_engine_count=3,
                start_index=4,
                local_start_index=0,
                vllm_config=None,
                local_client=True,
                handshake_address="",
                executor_class=None,
                log_stats=False,
            )
    finally:
        engine_workers.uninstall()
    assert [w.engine for w in serve._workers] == [5, 6]
    assert [os.path.basename(w.path) for w in serve._workers] == ["engine-stream-5", "engine-stream-6"]
    assert all(w.wait_ready(60) for w in serve._workers)


def test_a_stop_of_the_serve_reaches_the_workers_before_the_engines_are_killed(serve: Any, model_dir: str) -> None:
    """vLLM kills its data-parallel engine cores at once when the serve is asked to stop, before
    any goodbye: told of the stop first (``serve_stopping``), the serve's consumer and the
    workers end those engines' requests ``shutdown``: engine 1's, in its worker. Engine 0, killed
    before the stop (an OOM kill, say), ends its requests ``engine_dead``."""
    start_workers(serve, [1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}
    engines = {
        engine: subprocess.Popen(
            [sys.executable, str(HERE / "tap_engine.py"), serve.folder, model_dir, str(engine), str(count), "hold"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for engine, count in ((0, 2), (1, 3))
    }
    try:
        assert [engines[e].stdout.readline() for e in (0, 1)] == ["held\n", "held\n"]  # type: ignore[union-attr]
        engines[0].kill()
        wait_until(lambda: len(serve.receiver.named("llm_request")) == 2, 60, what="engine 0's 2 spans cut short")
        serve.serve_stopping()
        engines[1].kill()
        wait_until(lambda: len(serve.receiver.named("llm_request")) == 5, 60, what="engine 1's 3 spans cut short")
    finally:
        for process in engines.values():
            process.kill()
            process.wait()
    ends = {
        (instance, span_attributes(span)["llm.request.incomplete"])
        for span, instance in zip(serve.receiver.spans, serve.receiver.instances)
    }
    assert ends == {("serve-w-engine-0", "engine_dead"), ("serve-w-engine-1", "shutdown")}
    assert _spans_by_instance(serve.receiver) == {
        "serve-w-engine-0": ["e0-r0", "e0-r1"],
        "serve-w-engine-1": ["e1-r0", "e1-r1", "e1-r2"],
    }
