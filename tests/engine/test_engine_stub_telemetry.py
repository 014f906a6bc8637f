"""engine_stub with the otel-llm plugin: every number the telemetry reports equals the engine's own."""

from __future__ import annotations

import bisect
import math
import urllib.request
from importlib.metadata import entry_points
from typing import Any, Iterator

import pytest

from engine_stub import Engine, EngineConfig, RequestOutput
from engine_stub.workload import WorkloadSpec, generate, run_workload
from otel_llm import EngineTelemetry, TelemetryConfig
from otel_llm.export.handle import TelemetryHandle
from otel_llm.testing import in_memory_telemetry
from tests.support.otel_helpers import attrs

BUCKETS = (0.5, 1, 2, 3, 4, 5, 10, 20)


class Instrumented:
    """An engine with EngineTelemetry on in-memory providers (otel_llm.testing)."""

    def __init__(self, **engine_kwargs: Any) -> None:
        config = TelemetryConfig(model_name="tiny", naming="vllm", preemption_buckets=BUCKETS)
        self.otel = in_memory_telemetry(config)
        self.engine = Engine(EngineConfig(load_plugins=False, **engine_kwargs))
        self.engine.hooks.subscribe(self.otel.telemetry)

    def run(self, num_requests: int, seed: int = 0) -> list[RequestOutput]:
        requests = generate(WorkloadSpec(num_requests=num_requests, seed=seed), 640)
        return run_workload(self.engine, requests).outputs

    def close(self) -> None:
        self.otel.shutdown()


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
    metrics = tight.otel.metrics()
    hist = metrics.histogram("vllm:request_num_preemptions")
    assert hist.bounds == BUCKETS
    assert hist.count == len(outputs) == 120
    assert hist.sum == sum(counts)
    assert list(hist.bucket_counts) == expected_buckets(counts)
    assert hist.attributes["model_name"] == "tiny"
    assert metrics.counter("vllm:num_preemptions") == sum(counts)


def test_ample_kv_puts_every_request_in_the_first_bucket(ample: Instrumented) -> None:
    outputs = ample.run(80)
    hist = ample.otel.histogram("request_num_preemptions")
    assert list(hist.buckets.items()) == [(0.5, 80)] + [(b, 0) for b in (*BUCKETS[1:], math.inf)]
    assert (hist.count, hist.sum) == (len(outputs), 0)


def test_each_request_span_has_its_preemption_events(tight: Instrumented) -> None:
    outputs = tight.run(80)
    spans = tight.otel.spans_by_request()
    assert set(spans) == {o.request_id for o in outputs}
    assert {s.name for s in spans.values()} == {"llm_request"}
    for o in outputs:
        preempted = tight.otel.preemptions(o.request_id)
        assert [p.ordinal for p in preempted] == list(range(1, o.num_preemptions + 1)), o.request_id
        assert all(p.reason == "kv_cache_full" and p.num_computed_tokens > 0 for p in preempted)
        assert attrs(spans[o.request_id].attributes)["llm.request.num_preemptions"] == o.num_preemptions
    assert sum(o.num_preemptions for o in outputs) > 0


def plugin_handle(engine: Engine) -> TelemetryHandle:
    """The handle the otel plugin keeps as ``engine.telemetry_handle`` (set at run time: Engine does not declare it)."""
    handle = vars(engine)["telemetry_handle"]
    assert isinstance(handle, TelemetryHandle)
    return handle


def test_entry_point_is_installed() -> None:
    [ep] = [ep for ep in entry_points(group="engine_stub.plugins") if ep.name == "otel"]
    assert ep.value == "otel_llm.integrations.engine_stub:register"


def test_engine_loads_the_plugin_from_installed_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_STUB_PLUGINS", "otel")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    engine = Engine(EngineConfig())
    handle = plugin_handle(engine)
    try:
        assert engine.plugins == ["otel"]
        assert isinstance(handle.telemetry, EngineTelemetry)
        assert handle.config.model_name == "engine_stub-tiny"
        assert handle.config.provider_name == "engine_stub"  # the engine kind, apart from vLLM's and transformers'
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
    handle = plugin_handle(engine)
    try:
        outputs = run_workload(engine, generate(WorkloadSpec(num_requests=60), 640)).outputs
        url = f"http://127.0.0.1:{handle.prometheus_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
    finally:
        engine.shutdown()
    total = sum(o.num_preemptions for o in outputs)
    assert total > 0
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    [(key, value)] = [(k, v) for k, v in samples.items() if k.startswith("vllm:num_preemptions_total{")]
    assert 'model_name="engine_stub-tiny"' in key
    assert float(value) == total
    [count] = [v for k, v in samples.items() if k.startswith("vllm:request_num_preemptions_count{")]
    assert float(count) == 60


def test_a_bad_setting_leaves_the_plugin_off_in_one_warning_and_the_engine_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ENGINE_STUB_PLUGINS", "otel")
    monkeypatch.setenv("OTEL_LLM_NAMING", "bogus")
    with caplog.at_level("WARNING"):
        engine = Engine(EngineConfig(num_kv_blocks=40))
    try:
        assert engine.plugins == ["otel"] and not engine.hooks.active  # loaded, subscribed to nothing
        outputs = run_workload(engine, generate(WorkloadSpec(num_requests=10), 640)).outputs
        assert len(outputs) == 10
    finally:
        engine.shutdown()
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "otel-llm engine_stub plugin: telemetry disabled, the engine runs on: "
            "OTEL_LLM_NAMING='bogus': naming: 'bogus' must be one of ('vllm', 'semconv')",
        )
    ]
