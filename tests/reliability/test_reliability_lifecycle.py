"""Reliability: shutdown, fork, and the in-flight cap.

* ``handle.shutdown()`` flushes metrics and spans and ends the spans of requests still in flight
  (status ERROR, ``llm.request.incomplete="shutdown"``); a second shutdown is harmless, and an
  engine that keeps publishing after shutdown neither raises nor produces more telemetry.
* A forked child gets working telemetry: it can keep using the parent's (even when another
  thread of the parent held the telemetry's lock at the moment of the fork) or build its own,
  and exits with a status the parent checks.
* The in-flight cap evicts the oldest request, counted as ``evicted``; its span ends marked.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
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
        assert finished[rid].attributes["llm.request.incomplete"] == "evicted"


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
