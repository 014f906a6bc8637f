"""Reliability: concurrent publishers, collectors and exporters.

Two threads publish two engines' worth of requests (disjoint ids) into the same telemetry
while a third collects in a tight loop and a PeriodicExportingMetricReader exports every few
milliseconds. At CHECKPOINTS points of its work, each publisher waits until a collection and an
export have each begun and ended since, so both run between the publishers' batches however fast
or slow the machine is. Checked: no deadlock (every wait and join has a timeout), no torn point
(count equals the sum of bucket counts in every collected or exported histogram point,
cumulative counts never go down), and exact totals (equal to a single-threaded run of the same
events).
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    HistogramDataPoint,
    InMemoryMetricReader,
    MetricExporter,
    MetricExportResult,
    PeriodicExportingMetricReader,
)

import otel_llm
from otel_llm import EngineTelemetry, EventType, RequestEvent, TelemetryConfig
from otel_llm.hooks import HookBus
from tests.support.otel_helpers import attrs

E = EventType
N_REQUESTS = 4000  # per thread
CHECKPOINTS = 8  # per publisher
JOIN_TIMEOUT = 120.0  # a safety bound: deadlock


def request_events(prefix: str, i: int) -> list[list[RequestEvent]]:
    """One request's events in engine-step batches; times are multiples of 1/4 (exact float sums)."""
    rid = f"{prefix}-{i}"
    t = float(i % 50)
    preemptions = i % 4
    steps = [
        [RequestEvent(E.ARRIVED, rid, t, prompt_tokens=10 + i % 7, max_tokens=32), RequestEvent(E.QUEUED, rid, t)],
        [RequestEvent(E.SCHEDULED, rid, t + 0.25)],
    ]
    for k in range(preemptions):
        steps.append([RequestEvent(E.PREEMPTED, rid, t + 0.5 + k, num_computed_tokens=16, reason="kv_cache_full")])
        steps.append([RequestEvent(E.SCHEDULED, rid, t + 0.75 + k)])
    end = t + 1 + preemptions
    steps.append([RequestEvent(E.FIRST_TOKEN, rid, end), RequestEvent(E.TOKENS, rid, end, num_tokens=1)])
    for k in range(1, 1 + i % 5):
        steps.append([RequestEvent(E.TOKENS, rid, end + 0.25 * k, num_tokens=1)])
    steps.append([RequestEvent(E.FINISHED, rid, end + 2, finish_reason=("stop", "length")[i % 2])])
    return steps


def engine_batches(prefix: str) -> list[list[RequestEvent]]:
    """Interleave 8 requests at a time, as a batching engine does, one list per engine step."""
    out: list[list[RequestEvent]] = []
    for start in range(0, N_REQUESTS, 8):
        per_request = [request_events(prefix, i) for i in range(start, min(start + 8, N_REQUESTS))]
        for k in range(max(len(r) for r in per_request)):
            out.append([e for r in per_request if k < len(r) for e in r[k]])
    return out


class Progress:
    """How many collections and exports have ended; publishers wait for more of them."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.done = {"collections": 0, "exports": 0}

    def one_more(self, kind: str) -> None:
        with self._changed:
            self.done[kind] += 1
            self._changed.notify_all()

    def wait_for_both(self) -> None:
        """Until a collection and an export have each begun and ended after this call."""
        with self._changed:
            seen = dict(self.done)  # the one under way may have read the data before this point
            ok = self._changed.wait_for(lambda: all(self.done[k] >= seen[k] + 2 for k in seen), JOIN_TIMEOUT)
        assert ok, f"no collection or export in {JOIN_TIMEOUT} s: deadlock ({self.done})"


class CheckingExporter(MetricExporter):
    """Checks every exported histogram point; reports each export to ``progress``."""

    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress
        self.problems: list[str] = []

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self.problems += torn_points(metrics_data)
        self.progress.one_more("exports")
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


def points(data: Any) -> list[tuple[str, Any]]:
    if data is None:
        return []
    return [
        (m.name, p)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
    ]


def torn_points(data: Any) -> list[str]:
    return [
        f"{name}: count {p.count} != sum(buckets) {sum(p.bucket_counts)}"
        for name, p in points(data)
        if isinstance(p, HistogramDataPoint) and p.count != sum(p.bucket_counts)
    ]


def totals(data: Any) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    out: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for name, p in points(data):
        key = (name, tuple(sorted(p.attributes.items())))
        if isinstance(p, HistogramDataPoint):
            out[key] = (tuple(p.bucket_counts), p.count, p.sum, p.min, p.max)
        elif name not in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            out[key] = (p.value,)
    return out


def build(
    two_engines: bool, defer_steps: int = 1
) -> tuple[MeterProvider, InMemoryMetricReader, CheckingExporter, list[EngineTelemetry]]:
    config = TelemetryConfig(model_name="m", spans=False, defer_steps=defer_steps)
    reader = InMemoryMetricReader()
    exporter = CheckingExporter(Progress())
    periodic = PeriodicExportingMetricReader(exporter, export_interval_millis=5)
    provider = MeterProvider(metric_readers=[reader, periodic], views=otel_llm.views(config))
    first = EngineTelemetry(config, meter_provider=provider)
    second = (
        EngineTelemetry(
            TelemetryConfig(model_name="m", engine="1", spans=False, defer_steps=defer_steps), meter_provider=provider
        )
        if two_engines
        else first
    )
    return provider, reader, exporter, [first, second]


@pytest.mark.parametrize("defer_steps", [1, 16], ids=["each_batch", "deferred_16"])  # 16: readers apply kept batches
@pytest.mark.parametrize("two_engines", [False, True], ids=["one_telemetry", "two_telemetries_one_provider"])
def test_two_publishers_a_collector_and_an_exporter(two_engines, defer_steps):
    provider, reader, exporter, telemetries = build(two_engines, defer_steps)
    progress = exporter.progress
    work = [engine_batches("a"), engine_batches("b")]
    stop = threading.Event()
    problems: list[str] = []
    errors: list[BaseException] = []

    def publish(telemetry: EngineTelemetry, batches: Sequence[list[RequestEvent]]) -> None:
        try:
            bus = HookBus()
            bus.subscribe(telemetry)
            every = len(batches) // CHECKPOINTS
            for i, batch in enumerate(batches):
                if i % every == 0:
                    progress.wait_for_both()
                bus.publish(batch)
            assert bus.errors == {}, bus.errors
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def collect() -> None:
        last: dict[tuple, int] = {}
        try:
            while not stop.is_set():
                data = reader.get_metrics_data()
                problems.extend(torn_points(data))
                for name, p in points(data):
                    if isinstance(p, HistogramDataPoint):
                        key = (name, tuple(sorted(attrs(p.attributes).items())))
                        if p.count < last.get(key, 0):
                            problems.append(f"{name}: cumulative count went down {last[key]} -> {p.count}")
                        last[key] = p.count
                progress.one_more("collections")
        except BaseException as exc:  # noqa: BLE001 - any failure of a reader thread is reported by the test
            errors.append(exc)

    collector = threading.Thread(target=collect, daemon=True)
    publishers = [threading.Thread(target=publish, args=(telemetries[i], work[i]), daemon=True) for i in range(2)]
    collector.start()
    for th in publishers:
        th.start()
    for th in publishers:
        th.join(JOIN_TIMEOUT)
        assert not th.is_alive(), "a publisher is stuck: deadlock"
    stop.set()
    collector.join(JOIN_TIMEOUT)
    assert not collector.is_alive(), "the collector is stuck: deadlock"
    assert not errors, errors
    provider.force_flush(10_000)
    final = reader.get_metrics_data()
    provider.shutdown()
    assert not problems, problems[:5]
    assert not exporter.problems, exporter.problems[:5]

    # Exact: the same events, one thread, nothing collecting in between.
    ref_provider, ref_reader, _, ref_telemetries = build(two_engines)
    for i in range(2):
        for batch in work[i]:
            ref_telemetries[i].on_events(batch)
    expected = ref_reader.get_metrics_data()
    ref_provider.shutdown()
    got_totals, expected_totals = totals(final), totals(expected)
    assert got_totals == expected_totals
    success = sum(p.value for name, p in points(final) if name == "vllm:request_success")
    assert success == 2 * N_REQUESTS
    preemptions = [p for name, p in points(final) if name == "vllm:request_num_preemptions"]
    assert sum(p.count for p in preemptions) == 2 * N_REQUESTS
