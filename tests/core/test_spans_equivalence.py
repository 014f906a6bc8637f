"""Assembled spans (built once at the end) must be exactly the spans of the Tracer API path.

Both paths run the same events on SDK TracerProviders with the same deterministic id
generator, sampler and span limits; every exported span is compared field by field: ids and
flags, parent, times, status, attributes (and how many the limits dropped), events (names,
times, attributes, drops), resource and scope. The workload has remote parents, preemptions
beyond the event limit, errors, content recording, evictions and spans ended by shutdown.
"""

from __future__ import annotations

import dataclasses

import pytest
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased

from otel_llm import EngineTelemetry, TelemetryConfig
from otel_llm.testing import lifecycle
from otel_llm.tracing.spans import AssembledSpans, RequestSpans
from tests.support.otel_helpers import E, RequestEvent, attrs

PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


class CountingIds(IdGenerator):
    """Deterministic ids, so that both paths give every span the same ones."""

    def __init__(self) -> None:
        self.n = 0

    def generate_span_id(self) -> int:
        self.n += 1
        return self.n

    def generate_trace_id(self) -> int:
        self.n += 1
        return self.n * 0x9E3779B97F4A7C15 % (1 << 128) or 1  # spread over the range the ratio sampler reads


def workload() -> list[list[RequestEvent]]:
    batches = []
    for i, k in enumerate((0, 1, 2, 7, 0, 3, 0, 12)):
        events = lifecycle(f"r{i}", 10.0 + i, preemptions=k, tokens=1 + i, finish_reason="error" if i == 5 else "stop")
        arrived = events[0]
        carrier = {"traceparent": f"00-{PARENT_TRACE}-00f067aa0ba902b{i}-0{i % 2}"} if i % 3 == 0 else None
        events[0] = dataclasses.replace(arrived, trace_context=carrier, prompt_text="a prompt " * i)
        events[-1] = dataclasses.replace(events[-1], output_text="an answer " * i)
        batches.append(events)
    # Arrivals that never finish: the first two are evicted (cap 4), the rest ended by shutdown.
    batches.append([RequestEvent(E.ARRIVED, f"open{i}", 30.0 + i, prompt_tokens=5) for i in range(6)])
    return batches


def run(assembled: bool, sampler, limits: SpanLimits) -> list[tuple]:
    provider = TracerProvider(sampler=sampler, id_generator=CountingIds(), span_limits=limits)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = TelemetryConfig(model_name="tiny", max_inflight_requests=4, record_content=True, content_max_length=12)
    telemetry = EngineTelemetry(
        config,
        meter_provider=NoOpMeterProvider(),
        tracer_provider=provider,
        span_path="auto" if assembled else "tracer",
    )
    assert type(telemetry.spans) is (AssembledSpans if assembled else RequestSpans)
    telemetry.spans._offset_ns = 0  # the monotonic-to-wall offset, taken per instance: the same for both runs
    for batch in workload():
        telemetry.on_events(batch)
    telemetry.shutdown()
    out = []
    for s in exporter.get_finished_spans():
        shutdown = (s.status.description or "").endswith("shutdown")  # the attribute is truncated by tight limits
        out.append(
            (
                s.name,
                s.kind,
                s.context,
                s.parent,
                s.start_time,
                None if shutdown else s.end_time,  # ended "now" by shutdown: the two runs differ
                s.status.status_code,
                s.status.description,
                dict(attrs(s.attributes)),
                s.dropped_attributes,
                [(e.name, e.timestamp, dict(attrs(e.attributes)), e.dropped_attributes) for e in s.events],
                s.dropped_events,
                s.resource,
                s.instrumentation_scope,
            )
        )
    return out


SAMPLERS = {"always_on": ALWAYS_ON, "parentbased_ratio": ParentBased(TraceIdRatioBased(0.5)), "always_off": ALWAYS_OFF}
LIMITS = {
    "default": SpanLimits(),
    "tight": SpanLimits(
        max_events=5, max_span_attributes=6, max_event_attributes=2, max_attribute_length=4, max_span_attribute_length=6
    ),
}


@pytest.mark.parametrize("limits", LIMITS, ids=list(LIMITS))
@pytest.mark.parametrize("sampler", SAMPLERS, ids=list(SAMPLERS))
def test_assembled_spans_equal_tracer_api_spans(sampler, limits):
    assembled = run(True, SAMPLERS[sampler], LIMITS[limits])
    live = run(False, SAMPLERS[sampler], LIMITS[limits])
    assert len(assembled) == len(live)
    for a, b in zip(assembled, live):
        assert a == b
    if sampler == "always_on":
        assert len(live) == 14  # 8 finished + 2 evicted + 4 ended by shutdown
        assert sum(1 for s in live if s[3] is not None and f"{s[3].trace_id:032x}" == PARENT_TRACE) == 3
    if sampler == "always_on" and limits == "tight":  # the limits did bite, on both paths alike
        assert any(s[9] > 0 for s in live) and any(s[11] > 0 for s in live)
        assert any(e[3] > 0 for s in live for e in s[10])
    if sampler == "always_off":
        assert live == []
