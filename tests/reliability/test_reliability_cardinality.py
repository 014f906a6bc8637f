"""Reliability: metric cardinality stays bounded whatever the engine sends.

* Request ids, prompts, outputs, trace ids and span ids never become metric attributes: every
  attribute of every point of a real engine_stub run (with trace contexts and prompt text) is
  scanned, and the attribute keys are exactly the documented labels.
* Label values that come from users (finish reasons, preemption reasons) are bounded by
  ``max_label_values``; the rest map to ``overflow``. 10^5 distinct finish reasons and 10^5
  distinct preemption reasons through one engine's telemetry stay within the limit, totals intact.
* Model names are configuration (one per engine's telemetry), not event payload.
"""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_llm
from engine_stub import Engine, EngineConfig
from engine_stub.workload import WorkloadSpec, generate, run_workload
from otel_llm import EngineTelemetry, EventType, RequestEvent, TelemetryConfig
from otel_llm.config.labels import OVERFLOW_LABEL_VALUE
from tests.support.otel_helpers import BOTH_PATHS

E = EventType
ALLOWED_KEYS = {
    "vllm": {"model_name", "engine", "reason", "cause", "finished_reason"},
    "semconv": {
        "gen_ai.request.model",
        "llm.engine",
        "gen_ai.operation.name",
        "gen_ai.provider.name",
        "gen_ai.response.finish_reason",
        "llm.preemption.reason",
        "llm.preemption.cause",
        "reason",
        "error.type",
    },
}


def all_points(reader: InMemoryMetricReader) -> list[tuple[str, Any]]:
    """(metric name, point) of every point, of any kind: each test reads the fields its metrics' kind has."""
    data = reader.get_metrics_data()
    assert data is not None
    return [
        (m.name, p)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
    ]


@pytest.mark.parametrize("naming", ["vllm", "semconv"])
def test_ids_prompts_and_trace_ids_never_become_metric_attributes(naming):
    config = TelemetryConfig(model_name="tiny", naming=naming, record_content=True)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=otel_llm.views(config))
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    telemetry = EngineTelemetry(config, meter_provider=provider, tracer_provider=tracer_provider)
    engine = Engine(
        EngineConfig(num_kv_blocks=12, max_num_seqs=16, max_num_batched_tokens=64, seed=0, load_plugins=False)
    )
    engine.hooks.subscribe(telemetry)
    requests = generate(WorkloadSpec(num_requests=40, seed=3), 180)

    def carrier(rid: str) -> dict[str, str]:
        return {"traceparent": f"00-{(abs(hash(rid)) % 16**32):032x}-{(abs(hash(rid[::-1])) % 16**16):016x}-01"}

    result = run_workload(engine, requests, trace_context=carrier)
    assert result.total_preemptions > 0  # the run exercises preemption reasons too
    finished = spans.get_finished_spans()
    forbidden: set[str] = {r.request_id for r in requests} | {r.prompt for r in requests}
    forbidden |= {o.text for o in result.outputs if getattr(o, "text", None)}
    forbidden |= {f"{s.context.trace_id:032x}" for s in finished} | {f"{s.context.span_id:016x}" for s in finished}
    forbidden |= {carrier(r.request_id)["traceparent"] for r in requests}
    points = all_points(reader)
    assert points
    keys: set[str] = set()
    for name, p in points:
        for key, value in p.attributes.items():
            keys.add(key)
            assert str(value) not in forbidden, f"{name} carries {key}={value!r}"
            assert len(str(value)) <= 64, f"{name} carries a long label {key}={value!r}"
    assert keys <= ALLOWED_KEYS[naming], keys - ALLOWED_KEYS[naming]
    provider.shutdown()
    tracer_provider.shutdown()


@BOTH_PATHS
def test_a_hundred_thousand_distinct_reasons_stay_within_max_label_values(paths):
    limit = 25
    n = 100_000
    config = TelemetryConfig(model_name="m", max_label_values=limit, spans=False)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=otel_llm.views(config))
    telemetry = EngineTelemetry(config, meter_provider=provider, **paths)
    batch: list[RequestEvent] = []
    for i in range(n):
        rid = f"r{i}"
        batch += [
            RequestEvent(E.ARRIVED, rid, 1.0, prompt_tokens=1),
            RequestEvent(E.SCHEDULED, rid, 1.0),
            RequestEvent(E.PREEMPTED, rid, 1.0, num_computed_tokens=1, reason=f"user-reason-{i}"),
            RequestEvent(E.SCHEDULED, rid, 1.0),
            RequestEvent(E.FINISHED, rid, 2.0, finish_reason=f"user-finish-{i}"),
        ]
        if len(batch) >= 5000:
            telemetry.on_events(batch)
            batch = []
    telemetry.on_events(batch)
    points = all_points(reader)
    by_finish = {p.attributes["finished_reason"]: p.value for name, p in points if name == "vllm:request_success"}
    by_reason = {p.attributes["reason"]: p.value for name, p in points if name == "vllm:num_preemptions_by_reason"}
    for label_values in (by_finish, by_reason):
        assert len(label_values) == limit + 1, len(label_values)
        assert label_values[OVERFLOW_LABEL_VALUE] == n - limit
        assert sum(label_values.values()) == n  # nothing lost, only folded into "overflow"
    # The whole export stays small: a few series per metric, not 10^5.
    assert len(points) < 100, len(points)
    assert not [p for name, p in points if name == "otel_llm.dropped_events" and p.value], "nothing is dropped"
    provider.shutdown()


def test_model_names_are_configuration_not_event_payload():
    """An event cannot set the model name: the label comes from the engine's config only."""
    config = TelemetryConfig(model_name="configured", spans=False)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=otel_llm.views(config))
    telemetry = EngineTelemetry(config, meter_provider=provider)
    for i in range(1000):
        telemetry.on_events(
            [
                RequestEvent(E.ARRIVED, f"r{i}", 1.0, prompt_tokens=1),
                RequestEvent(E.FINISHED, f"r{i}", 2.0, finish_reason="stop"),
            ]
        )
    models = {p.attributes.get("model_name") for _, p in all_points(reader)}
    assert models == {"configured"}
    assert not hasattr(RequestEvent(E.ARRIVED, "x", 1.0), "model_name")
    provider.shutdown()
