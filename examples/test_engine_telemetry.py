"""Testing an engine's telemetry with otel-llm's pytest plugin: the fixtures come with the package
(entry point ``pytest11``), no conftest.py needed. The engine here is engine_stub; any engine that
publishes otel_llm events on a hook bus is tested the same way.

    pytest examples/test_engine_telemetry.py
"""

import pytest

from engine_stub import Engine, EngineConfig
from otel_llm import TelemetryConfig


@pytest.fixture
def otel_llm_config() -> TelemetryConfig:
    """The config the ``otel_llm_telemetry`` fixture is built with (overrides the plugin's)."""
    return TelemetryConfig(model_name="stub", preemption_buckets=(0.5, 1, 2, 5, 10))


def run_engine(telemetry, num_kv_blocks: int = 24) -> list:
    """24 requests on an engine whose KV cache holds a fraction of them: some are preempted."""
    engine = Engine(
        EngineConfig(num_kv_blocks=num_kv_blocks, max_num_seqs=16, max_num_batched_tokens=128, load_plugins=False)
    )
    engine.hooks.subscribe(telemetry)
    for i in range(24):
        engine.add_request(f"req-{i}", "the quick brown fox " * 4, max_tokens=48)
    return engine.run()


def test_preemption_histogram_matches_the_engine(otel_llm_telemetry):
    outputs = run_engine(otel_llm_telemetry.telemetry)
    counts = [o.num_preemptions for o in outputs]
    assert sum(counts) > 0

    metrics = otel_llm_telemetry.metrics()  # one collection, read several ways
    hist = metrics.histogram("request_num_preemptions", model_name="stub")  # a metric key, or its name
    assert (hist.count, hist.sum) == (len(outputs), sum(counts))
    assert hist.buckets[0.5] == counts.count(0)  # le=0.5: the requests never preempted
    assert metrics.counter("vllm:num_preemptions") == sum(counts)
    assert metrics.counter("request_success") == len(outputs)  # summed over its finished_reason values


def test_each_preemption_is_an_event_on_its_request_span(otel_llm_telemetry):
    outputs = run_engine(otel_llm_telemetry.telemetry)
    for o in outputs:
        span = otel_llm_telemetry.span(o.request_id)  # by gen_ai.request.id
        assert span.attributes["llm.request.num_preemptions"] == o.num_preemptions
        preemptions = otel_llm_telemetry.preemptions(o.request_id)
        assert [p.ordinal for p in preemptions] == list(range(1, o.num_preemptions + 1))
        assert all(p.reason == "kv_cache_full" and p.num_computed_tokens > 0 for p in preemptions)


def test_ample_kv_cache_never_preempts(otel_llm_telemetry_factory):
    telemetry = otel_llm_telemetry_factory(TelemetryConfig(model_name="stub"))  # one per call, any config
    outputs = run_engine(telemetry.telemetry, num_kv_blocks=1024)
    assert telemetry.histogram("request_num_preemptions").buckets[0.5] == len(outputs)
    assert telemetry.counter("num_preemptions") == 0
