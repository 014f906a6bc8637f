"""engine_stub with the otel-llm plugin: every number the telemetry reports equals the engine's own."""

from __future__ import annotations

import bisect
import urllib.request
from importlib.metadata import entry_points
from typing import Any, Iterator

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_llm
from engine_stub import Engine, EngineConfig, RequestOutput
from engine_stub.workload import WorkloadSpec, generate, run_workload
from otel_llm import EngineTelemetry, TelemetryConfig

BUCKETS = (0.5, 1, 2, 3, 4, 5, 10, 20)


class Instrumented:
    """An engine with EngineTelemetry on in-memory metric and span readers."""

    def __init__(self, **engine_kwargs: Any) -> None:
        config = TelemetryConfig(model_name="tiny", naming="vllm", preemption_buckets=BUCKETS)
        self.reader = InMemoryMetricReader()
        self.spans = InMemorySpanExporter()
        self.meter_provider = MeterProvider(metric_readers=[self.reader], views=otel_llm.views(config))
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.telemetry = EngineTelemetry(
            config, meter_provider=self.meter_provider, tracer_provider=self.tracer_provider
        )
        self.engine = Engine(EngineConfig(load_plugins=False, **engine_kwargs))
        self.engine.hooks.subscribe(self.telemetry)

    def run(self, num_requests: int, seed: int = 0) -> list[RequestOutput]:
        requests = generate(WorkloadSpec(num_requests=num_requests, seed=seed), 640)
        return run_workload(self.engine, requests).outputs

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        return [
            point
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
            if metric.name == name
            for point in metric.data.data_points
        ]

    def close(self) -> None:
        self.meter_provider.shutdown()
        self.tracer_provider.shutdown()


@pytest.fixture
def tight() -> Iterator[Instrumented]:
    inst = Instrumented(num_kv_blocks=40, max_num_seqs=24, max_num_batched_tokens=128)
    yield inst
    inst.close()


@pytest.fixture
def ample() -> Iterator[Instrumented]:
    inst = Instrumented(num_kv_blocks=1024, max_num_seqs=32, max_num_batched_tokens=512)
    yield inst
    inst.close()


def expected_buckets(counts: list[int]) -> list[int]:
    """Cumulative-free bucket counts as the SDK keeps them: bucket i holds (b[i-1], b[i]]."""
    buckets = [0] * (len(BUCKETS) + 1)
    for c in counts:
        buckets[bisect.bisect_left(BUCKETS, c)] += 1
    return buckets


def test_preemption_histogram_equals_engine_ground_truth(tight: Instrumented) -> None:
    outputs = tight.run(120)
    counts = [o.num_preemptions for o in outputs]
    assert max(counts) >= 3  # the run really thrashes: the test would be weak otherwise
    [point] = tight.points("vllm:request_num_preemptions")
    assert tuple(point.explicit_bounds) == BUCKETS
    assert point.count == len(outputs) == 120
    assert point.sum == sum(counts)
    assert list(point.bucket_counts) == expected_buckets(counts)
    assert dict(point.attributes)["model_name"] == "tiny"
    [total] = tight.points("vllm:num_preemptions")
    assert total.value == sum(counts)


def test_ample_kv_puts_every_request_in_the_first_bucket(ample: Instrumented) -> None:
    outputs = ample.run(80)
    [point] = ample.points("vllm:request_num_preemptions")
    assert list(point.bucket_counts) == [80] + [0] * len(BUCKETS)
    assert (point.count, point.sum) == (len(outputs), 0)


def test_each_request_span_has_its_preemption_events(tight: Instrumented) -> None:
    outputs = tight.run(80)
    spans = {s.attributes["gen_ai.request.id"]: s for s in tight.spans.get_finished_spans() if s.name == "llm_request"}
    assert set(spans) == {o.request_id for o in outputs}
    for o in outputs:
        span = spans[o.request_id]
        preempted = [e for e in span.events if e.name == "preempted"]
        assert len(preempted) == o.num_preemptions, o.request_id
        assert [e.attributes["ordinal"] for e in preempted] == list(range(1, o.num_preemptions + 1))
        assert all(e.attributes["reason"] == "kv_cache_full" for e in preempted)
        assert span.attributes["llm.request.num_preemptions"] == o.num_preemptions
    assert sum(o.num_preemptions for o in outputs) > 0


def test_entry_point_is_installed() -> None:
    [ep] = [ep for ep in entry_points(group="engine_stub.plugins") if ep.name == "otel"]
    assert ep.value == "otel_llm.integrations.engine_stub:register"


def test_engine_loads_the_plugin_from_installed_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_STUB_PLUGINS", "otel")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    engine = Engine(EngineConfig())
    handle = engine.telemetry_handle
    try:
        assert engine.plugins == ["otel"]
        assert isinstance(handle.telemetry, EngineTelemetry)
        assert handle.config.model_name == "engine_stub-tiny"
        engine.hooks.unsubscribe(handle.telemetry)
        assert not engine.hooks.active  # the plugin's telemetry was the one subscriber
    finally:
        engine.shutdown()
    assert handle._closed  # Engine.shutdown() reached the handle the plugin returned


def test_plugin_from_environment_serves_the_engine_totals(monkeypatch: pytest.MonkeyPatch) -> None:
    # The whole no-code path: entry point -> env config -> Prometheus endpoint on a free port.
    monkeypatch.setenv("ENGINE_STUB_PLUGINS", "otel")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "0")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    engine = Engine(EngineConfig(num_kv_blocks=40, max_num_seqs=24, max_num_batched_tokens=128))
    handle = engine.telemetry_handle
    try:
        outputs = run_workload(engine, generate(WorkloadSpec(num_requests=60), 640)).outputs
        url = f"http://127.0.0.1:{handle.prometheus_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        engine.shutdown()
    total = sum(o.num_preemptions for o in outputs)
    assert total > 0
    samples = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    [(key, value)] = [(k, v) for k, v in samples.items() if k.startswith("vllm:num_preemptions_total{")]
    assert 'model_name="engine_stub-tiny"' in key
    assert float(value) == total
    [count] = [v for k, v in samples.items() if k.startswith("vllm:request_num_preemptions_count{")]
    assert float(count) == 60
