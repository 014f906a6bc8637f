"""Reliability: shutdown, fork, and the in-flight cap.

* ``handle.shutdown()`` flushes metrics and spans and ends the spans of requests still in flight
  (status ERROR, ``llm.request.incomplete="shutdown"``); a second shutdown is harmless, and an
  engine that keeps publishing after shutdown neither raises nor produces more telemetry.
* A forked child gets working telemetry: it can keep using the parent's (even when another
  thread of the parent held the telemetry's lock at the moment of the fork) or build its own,
  and exits with a status the parent checks.
* The in-flight cap evicts the oldest request, counted as ``evicted``; its span ends marked.
* A collector that hangs holds up neither ``handle.shutdown()`` nor the process's exit for
  longer than the shutdown's bound, whatever the exporters' own timeouts.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any, TypedDict

import pytest
from opentelemetry.sdk.metrics.export import (
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from otel_llm import EventType, RequestEvent, TelemetryConfig, setup_telemetry
from otel_llm.hooks import HookBus
from tests.support.backends import backend, silent_collector, start_otlp_sink
from tests.support.otel_helpers import attrs

E = EventType


class Exporters(TypedDict):
    metrics_exporters: tuple[str, ...]
    traces_exporters: tuple[str, ...]


NO_EXPORTERS = Exporters(metrics_exporters=("none",), traces_exporters=("none",))
CHILD_TIMEOUT_S = 120  # a safety bound on a forked child (a few seconds' work): deadlock


class LastExport(MetricExporter):
    def __init__(self) -> None:
        super().__init__()
        self.data: Any = None
        self.exports = 0

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self.data = metrics_data
        self.exports += 1
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


def values(data: Any, name: str) -> dict[tuple, Any]:
    if data is None:
        return {}
    out = {
        tuple(sorted(p.attributes.items())): (p.value if hasattr(p, "value") else p.count)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == name
        for p in m.data.data_points
    }
    return {k: v for k, v in out.items() if v}  # counters declared at 0 are not events


def lifecycle(rid: str, t: float = 1.0, finish: bool = True) -> list[RequestEvent]:
    events = [
        RequestEvent(E.ARRIVED, rid, t, prompt_tokens=4, max_tokens=8),
        RequestEvent(E.SCHEDULED, rid, t),
        RequestEvent(E.TOKENS, rid, t + 0.5, num_tokens=1),
    ]
    if finish:
        events.append(RequestEvent(E.FINISHED, rid, t + 1, finish_reason="stop"))
    return events


def test_shutdown_flushes_ends_open_spans_and_is_idempotent(caplog: pytest.LogCaptureFixture) -> None:
    spans = InMemorySpanExporter()
    metrics = LastExport()
    handle = setup_telemetry(
        TelemetryConfig(model_name="m", **NO_EXPORTERS),
        extra_metric_readers=[PeriodicExportingMetricReader(metrics, export_interval_millis=600_000)],
        extra_span_processors=[BatchSpanProcessor(spans, schedule_delay_millis=600_000)],
        environ={},
    )
    bus = HookBus()
    bus.subscribe(handle.telemetry)
    bus.publish(lifecycle("done") + lifecycle("open-1", finish=False) + lifecycle("open-2", finish=False))
    assert spans.get_finished_spans() == ()  # batched, nothing exported yet
    handle.shutdown()

    finished = {attrs(s.attributes)["gen_ai.request.id"]: s for s in spans.get_finished_spans()}
    assert set(finished) == {"done", "open-1", "open-2"}, "shutdown must flush every span, open ones ended"
    assert finished["done"].status.status_code is StatusCode.UNSET
    for rid in ("open-1", "open-2"):
        assert finished[rid].status.status_code is StatusCode.ERROR
        assert attrs(finished[rid].attributes)["llm.request.incomplete"] == "shutdown"
    assert values(metrics.data, "vllm:request_success") == {
        (("engine", "0"), ("finished_reason", "stop"), ("model_name", "m")): 1
    }, "final metrics flushed"

    exports = metrics.exports
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    handle.shutdown()  # harmless
    handle.telemetry.shutdown()
    for i in range(200):  # the engine keeps running after the plugin shut down
        bus.publish(lifecycle(f"late-{i}"))
        bus.publish_step(None)  # type: ignore[arg-type]  # garbage on purpose: not StepStats
    assert bus.errors == {}
    assert len(spans.get_finished_spans()) == 3 and metrics.exports == exports
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(noisy) <= 5, [r.getMessage() for r in noisy]  # at most a line, not one per event


def test_in_flight_cap_evicts_the_oldest_request_counted_and_marked():
    spans = InMemorySpanExporter()
    reader = InMemoryMetricReader()
    handle = setup_telemetry(
        TelemetryConfig(model_name="m", max_inflight_requests=3, **NO_EXPORTERS),
        extra_metric_readers=[reader],
        extra_span_processors=[BatchSpanProcessor(spans, schedule_delay_millis=600_000)],
        environ={},
    )
    telemetry = handle.telemetry
    telemetry.on_events([RequestEvent(E.ARRIVED, f"r{i}", float(i), prompt_tokens=1) for i in range(5)])
    telemetry.flush()  # apply the kept batch now, to look at the tracker
    assert list(telemetry.tracker.inflight) == ["r2", "r3", "r4"]
    telemetry.on_events(
        [RequestEvent(E.FINISHED, "r0", 9.0, finish_reason="stop")]  # its request is gone
        + [RequestEvent(E.FINISHED, f"r{i}", 9.0, finish_reason="stop") for i in (2, 3, 4)]
    )
    dropped = {dict(k)["reason"]: v for k, v in values(reader.get_metrics_data(), "otel_llm.dropped_events").items()}
    assert dropped == {"evicted": 2, "duplicate_finish": 1}
    assert sum(values(reader.get_metrics_data(), "vllm:request_success").values()) == 3
    handle.shutdown()
    finished = {attrs(s.attributes)["gen_ai.request.id"]: s for s in spans.get_finished_spans()}
    assert set(finished) == {f"r{i}" for i in range(5)}
    for rid in ("r0", "r1"):
        assert finished[rid].status.status_code is StatusCode.ERROR
        assert attrs(finished[rid].attributes)["llm.request.incomplete"] == "evicted"


def _wait_child(pid: int, timeout: float) -> int:
    """The child's exit code, once it exits (its pidfd becomes readable), within ``timeout`` s."""
    pidfd = os.pidfd_open(pid)
    try:
        exited, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    if not exited:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError(f"forked child {pid} did not exit within {timeout}s (deadlock?)")
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _in_child(body) -> int:
    """Fork; run ``body()`` in the child (its return value is the exit code); the parent gets the code."""
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 99
        try:
            signal.alarm(CHILD_TIMEOUT_S)  # a deadlocked child dies instead of hanging
            code = body()
        except BaseException:  # noqa: BLE001 - the forked child reports any failure as its exit code
            import traceback

            traceback.print_exc()
            code = 98
        finally:
            os._exit(code)
    return _wait_child(pid, CHILD_TIMEOUT_S + 30)


@pytest.mark.parametrize("lock_held_at_fork", [False, True], ids=["idle", "lock_held_by_another_thread"])
def test_forked_child_keeps_working_telemetry(lock_held_at_fork):
    reader = InMemoryMetricReader()
    handle = setup_telemetry(TelemetryConfig(model_name="m", **NO_EXPORTERS), extra_metric_readers=[reader], environ={})
    telemetry = handle.telemetry
    telemetry.on_events(lifecycle("parent-1"))
    release = threading.Event()
    holder = None
    if lock_held_at_fork:  # another engine thread is inside on_events when the fork happens
        acquired = threading.Event()

        def hold() -> None:
            with telemetry.metrics.lock:
                acquired.set()
                release.wait(CHILD_TIMEOUT_S + 60)

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()
        assert acquired.wait(10)

    def child() -> int:
        for i in range(10):
            telemetry.on_events(lifecycle(f"child-{i}"))
        got = sum(values(reader.get_metrics_data(), "vllm:request_success").values())
        if got != 11:  # the parent's one, inherited, plus the child's ten
            return 3
        own = setup_telemetry(
            TelemetryConfig(
                model_name="child", metrics_exporters=("prometheus",), traces_exporters=("none",), prometheus_port=0
            ),
            environ={},
        )
        own.telemetry.on_events(lifecycle("own-1"))
        with urllib.request.urlopen(f"http://127.0.0.1:{own.prometheus_port}/metrics", timeout=5) as resp:
            body = resp.read().decode()
        own.shutdown()
        handle.shutdown()
        if 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="child"' not in body:
            return 4
        return 0

    try:
        code = _in_child(child)
    finally:
        release.set()
        if holder is not None:
            holder.join(10)
    assert code == 0, f"child exited with {code}"
    # The parent is unaffected by the child's work.
    telemetry.on_events(lifecycle("parent-2"))
    assert sum(values(reader.get_metrics_data(), "vllm:request_success").values()) == 2
    handle.shutdown()


# Longer than any bound below, so that no timeout of the SDK's ends the wait in these tests (and
# a whole number: SDK 1.28 reads it with int()).
HUNG_EXPORT_TIMEOUT_S = "60"


def test_shutdown_with_a_hung_collector_returns_within_its_bound(clean_env, caplog):
    with silent_collector() as endpoint:
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        clean_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", HUNG_EXPORT_TIMEOUT_S)
        handle = setup_telemetry(
            TelemetryConfig(model_name="m", metrics_exporters=("otlp",), traces_exporters=("otlp",))
        )
        bus = HookBus()
        bus.subscribe(handle.telemetry)
        bus.publish(lifecycle("done"))
        start = time.monotonic()
        handle.shutdown(timeout_millis=1000)
        elapsed = time.monotonic() - start
    # Two stages (spans, then metrics) of at most 1 s each. Unbounded, the span processor's
    # shutdown waits for the export's 60 s timeout (SDK 1.45: 30 s; 1.28: then retries for up
    # to a minute more).
    assert elapsed < 10, elapsed
    late = [r.getMessage() for r in caplog.records if "did not finish" in r.getMessage()]
    assert [m.split(" did not", 1)[0] for m in late] == [
        "otel_llm: TracerProvider.shutdown",
        "otel_llm: MeterProvider.shutdown",
    ], late
    # The exports still waiting on the collector are counted lost: the process that shuts down
    # exits next, and their threads with it.
    assert handle.accounting is not None
    lost = handle.accounting.dropped_so_far()
    assert lost["spans_export_failed"] == 1 and lost["metric_points_export_failed"] > 0, lost
    said = [r.getMessage() for r in caplog.records if "not delivered" in r.getMessage()]
    assert len(said) == 1 and "spans_export_failed=1" in said[0], said


def test_shutdown_with_the_collector_down_says_what_was_lost(clean_env, caplog):
    """A collector that is down (its port bound, nothing listening: every connection refused):
    the shutdown's exports fail, and one line says what was lost, as counted."""
    with socket.socket() as down:
        down.bind(("127.0.0.1", 0))
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{down.getsockname()[1]}")
        clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        clean_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
        handle = setup_telemetry(
            TelemetryConfig(model_name="m", metrics_exporters=("otlp",), traces_exporters=("otlp",))
        )
        bus = HookBus()
        bus.subscribe(handle.telemetry)
        bus.publish(lifecycle("a") + lifecycle("b", t=2.0))
        caplog.set_level(logging.WARNING, logger="otel_llm")
        handle.shutdown(timeout_millis=5000)
    assert handle.accounting is not None
    lost = handle.accounting.dropped_so_far()
    assert lost["spans_export_failed"] == 2
    assert lost["metric_points_export_failed"] > 0
    lines = [r.getMessage() for r in caplog.records if "not delivered" in r.getMessage()]
    assert lines == [
        "otel_llm: not delivered since start-up (otel_llm.dropped_events by reason): "
        f"metric_points_export_failed={lost['metric_points_export_failed']}, spans_export_failed=2"
    ]


# A process that publishes a request's events and exits without shutting anything down.
EXIT_WITHOUT_SHUTDOWN = """
from otel_llm import EventType, RequestEvent, TelemetryConfig, setup_telemetry
from otel_llm.hooks import HookBus

handle = setup_telemetry(TelemetryConfig(model_name="m", metrics_exporters=("none",), traces_exporters=("otlp",)))
bus = HookBus()
bus.subscribe(handle.telemetry)
bus.publish([
    RequestEvent(EventType.ARRIVED, "r", 1.0, prompt_tokens=4, max_tokens=8),
    RequestEvent(EventType.FINISHED, "r", 2.0, finish_reason="stop"),
])
print("exiting", flush=True)
"""


def _exit_without_shutdown(endpoint: str, export_timeout_s: str = "10") -> tuple[float, str]:
    """Seconds from the child's last line to its exit, and its stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_EXPORTER_OTLP_TIMEOUT=export_timeout_s,
    )
    child = subprocess.Popen(
        [sys.executable, "-c", EXIT_WITHOUT_SHUTDOWN],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "exiting\n"
        start = time.monotonic()
        _, err = child.communicate(timeout=CHILD_TIMEOUT_S)
        elapsed = time.monotonic() - start
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == 0, err[-3000:]
    return elapsed, err


def test_exit_without_shutdown_delivers_what_is_pending():
    with backend("otlp sink"), start_otlp_sink("grpc") as sink:
        _exit_without_shutdown(sink.endpoint)
        # The request's span was still among the events kept for the next step: the handle's
        # shutdown at exit ends and exports it.
        ids = [a.value.string_value for s in sink.spans() for a in s.attributes if a.key == "gen_ai.request.id"]
    assert ids == ["r"]


def test_exit_with_a_hung_collector_waits_at_most_the_shutdown_bound():
    from otel_llm.export.handle import SHUTDOWN_TIMEOUT_MILLIS

    with silent_collector() as endpoint:
        elapsed, err = _exit_without_shutdown(endpoint, HUNG_EXPORT_TIMEOUT_S)
    # The handle's shutdown at exit: one stage of export (spans) of at most the bound (10 s).
    # The SDK's own exit handler would wait 30 s (1.45) or minutes (1.28) for the hung export.
    assert elapsed < SHUTDOWN_TIMEOUT_MILLIS / 1e3 + 15, (elapsed, err[-3000:])
    assert "TracerProvider.shutdown did not finish within 10.0 s" in err, err[-3000:]
