"""Preemptions as log-based events (``preemption_events``: span_event, log, both).

One log record per preemption, ``event_name="llm.request.preempted"``, at the preemption's own
time, with the request span's trace and span ids and the attributes gen_ai.request.id,
llm.preemption.ordinal (from 1), llm.preemption.num_computed_tokens, llm.preemption.reason,
llm.preemption.cause and llm.preemption.cause_request_ids.
Checked on engine_stub against the engine's own preemption counts, past the span event limit,
through the path vLLM uses (record_finished), bounded and counted on the way out, and over OTLP
through a real collector (rotel).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import pytest
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs import export as log_export
from opentelemetry.sdk._logs.export import SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_llm
from otel_llm import EngineTelemetry, TelemetryConfig, setup_telemetry
from otel_llm.catalogue.drops import LOG_RECORDS_EXPORT_FAILED, LOG_RECORDS_QUEUE_FULL
from otel_llm.summary import RequestSummary
from otel_llm.testing import lifecycle
from otel_llm.tracing.log_events import PREEMPTED_EVENT
from tests.support.backends import rotel_to_sink, wait_until
from tests.support.otel_helpers import attrs
from tests.support.sdk_versions import needs_sdk
from tests.support.workloads import engine_run

# Log-based events: Logger.emit with event_name (opentelemetry-sdk 1.38).
needs_log_events = needs_sdk("1.38", "log-based events (Logger.emit with event_name)")
# In-memory log exporter: InMemoryLogExporter before SDK 1.39 renamed it.
InMemoryLogRecordExporter = getattr(log_export, "InMemoryLogRecordExporter", None) or log_export.InMemoryLogExporter

ATTRIBUTES = {
    "gen_ai.request.id",
    "llm.preemption.ordinal",
    "llm.preemption.num_computed_tokens",
    "llm.preemption.reason",
    "llm.preemption.cause",
    "llm.preemption.cause_request_ids",  # engine_stub names the cause of every preemption
}


@dataclasses.dataclass
class LogRig:
    telemetry: EngineTelemetry
    spans: InMemorySpanExporter
    logs: Any

    def records(self) -> list[Any]:
        self.telemetry.flush()
        return [r.log_record for r in self.logs.get_finished_logs()]

    def finished_spans(self) -> dict[str, Any]:
        self.telemetry.flush()
        return {attrs(s.attributes)["gen_ai.request.id"]: s for s in self.spans.get_finished_spans()}


def log_rig(
    preemption_events: str, spans: bool = True, limits: Optional[SpanLimits] = None, span_path: str = "auto"
) -> LogRig:
    config = TelemetryConfig(model_name="tiny", preemption_events=preemption_events, spans=spans)
    span_exporter, log_exporter = InMemorySpanExporter(), InMemoryLogRecordExporter()
    tp = TracerProvider(span_limits=limits or SpanLimits())
    tp.add_span_processor(SimpleSpanProcessor(span_exporter))
    lp = LoggerProvider()
    lp.add_log_record_processor(SimpleLogRecordProcessor(log_exporter))
    mp = MeterProvider(views=otel_llm.views(config))
    telemetry = EngineTelemetry(config, meter_provider=mp, tracer_provider=tp, logger_provider=lp, span_path=span_path)
    return LogRig(telemetry, span_exporter, log_exporter)


def by_request(records: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for r in records:
        out.setdefault(r.attributes["gen_ai.request.id"], []).append(r)
    return out


@pytest.mark.parametrize("mode", ["log", "both"])
@pytest.mark.parametrize("span_path", ["auto", "tracer"], ids=["assembled", "tracer_api"])
@needs_log_events
def test_each_preemption_of_engine_stub_is_one_log_record_of_its_request_span(mode, span_path):
    r = log_rig(mode, span_path=span_path)
    truth = engine_run(r.telemetry)
    assert sum(truth.values()) >= 20 and max(truth.values()) >= 5
    spans = r.finished_spans()
    records = by_request(r.records())
    assert set(records) == {rid for rid, k in truth.items() if k}
    for rid, k in truth.items():
        span, recs = spans[rid], records.get(rid, [])
        assert span.attributes["llm.request.num_preemptions"] == k
        assert [x.attributes["llm.preemption.ordinal"] for x in recs] == list(range(1, k + 1)), rid
        span_events = [e for e in span.events if e.name == "preempted"]
        assert len(span_events) == (k if mode == "both" else 0)
        for i, x in enumerate(recs):
            assert x.event_name == PREEMPTED_EVENT
            assert set(x.attributes) == ATTRIBUTES
            assert x.attributes["llm.preemption.reason"] == "kv_cache_full"
            assert x.attributes["llm.preemption.num_computed_tokens"] >= 0
            assert (x.trace_id, x.span_id) == (span.context.trace_id, span.context.span_id)
            assert x.trace_flags == span.context.trace_flags
            assert span.start_time <= x.timestamp <= span.end_time
            if mode == "both":  # the same preemption, the same time and values
                event = span_events[i]
                assert event.timestamp == x.timestamp
                assert event.attributes["ordinal"] == x.attributes["llm.preemption.ordinal"]
                assert event.attributes["num_computed_tokens"] == x.attributes["llm.preemption.num_computed_tokens"]
        if mode == "log" and k:  # other span events stay
            assert [e.attributes["ordinal"] for e in span.events if e.name == "resumed"] == list(range(1, k + 1))


def test_span_event_default_emits_no_log_record():
    assert TelemetryConfig().preemption_events == "span_event"
    r = log_rig("span_event")
    truth = engine_run(r.telemetry, 12)
    assert r.records() == []
    assert r.telemetry.log_events is None
    spans = r.finished_spans()
    assert all(len([e for e in spans[rid].events if e.name == "preempted"]) == k for rid, k in truth.items())


@needs_log_events
def test_counts_stay_exact_past_the_span_event_limit():
    r = log_rig("both", limits=SpanLimits(max_events=16))
    r.telemetry.on_events(lifecycle("long", 1.0, preemptions=40, tokens=2))
    (span,) = r.finished_spans().values()
    assert span.attributes["llm.request.num_preemptions"] == 40
    assert len(span.events) == 16 and span.dropped_events > 0  # the span's limit bit
    assert [x.attributes["llm.preemption.ordinal"] for x in r.records()] == list(range(1, 41))


@needs_log_events
def test_without_spans_log_records_carry_no_trace_ids():
    r = log_rig("log", spans=False)
    r.telemetry.on_events(lifecycle("a", 1.0, preemptions=3))
    records = r.records()
    assert [x.attributes["llm.preemption.ordinal"] for x in records] == [1, 2, 3]
    assert all(x.trace_id == 0 and x.span_id == 0 for x in records)


@needs_log_events
def test_record_finished_emits_the_known_preemptions_as_log_records():
    """The path of the vLLM adapter (its deep hook hands over the preemption times)."""
    r = log_rig("log")
    times = (10.5, 10.75, 11.0)
    summary = RequestSummary(
        "v1",
        "stop",
        10.0,
        12.0,
        prompt_tokens=4,
        generation_tokens=3,
        num_preemptions=3,
        preemptions=tuple((t, 0, "kv_cache_full") for t in times),
    )
    r.telemetry.record_finished(summary, {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    (span,) = r.finished_spans().values()
    records = r.records()
    assert [x.attributes["llm.preemption.ordinal"] for x in records] == [1, 2, 3]
    assert r.telemetry.spans is not None
    assert [x.timestamp for x in records] == [r.telemetry.spans.wall_ns(t) for t in times]
    assert {x.trace_id for x in records} == {0x4BF92F3577B34DA6A3CE929D0E0E4736} == {span.context.trace_id}
    assert {x.span_id for x in records} == {span.context.span_id}
    assert not [e for e in span.events if e.name == "preempted"]
    assert span.attributes["llm.request.num_preemptions"] == 3


def test_invalid_preemption_events_fail_at_config_time_naming_the_setting(clean_env):
    with pytest.raises(ValueError, match=r"preemption_events: 'logs' must be one of"):
        TelemetryConfig(preemption_events="logs")
    for var, raw in (("OTEL_LLM_PREEMPTION_EVENTS", "span"), ("OTEL_LOGS_EXPORTER", "zipkin")):
        env = {
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_LLM_PREEMPTION_EVENTS": "log",
            var: raw,
        }
        with pytest.raises(ValueError, match=rf"^{var}={raw!r}"):
            TelemetryConfig.from_env(env)
        with pytest.raises(ValueError, match=rf"^{var}={raw!r}"):
            setup_telemetry(environ=env)


@needs_log_events
def test_setup_builds_a_logger_provider_only_for_log_events(clean_env):
    env = {"OTEL_METRICS_EXPORTER": "none", "OTEL_TRACES_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}
    handle = setup_telemetry(environ=env)
    try:
        assert handle.logger_provider is None and handle.telemetry.log_events is None
    finally:
        handle.shutdown()
    handle = setup_telemetry(environ={**env, "OTEL_LLM_PREEMPTION_EVENTS": "both"})
    try:
        assert isinstance(handle.logger_provider, LoggerProvider)
        other = handle.new_telemetry(engine="1")
        assert other.log_events is not None and handle.telemetry.log_events is not None
        assert other.log_events.logger is handle.telemetry.log_events.logger
    finally:
        handle.shutdown()


@needs_log_events
@needs_sdk("1.41", "counting the records a batch processor drops (its drop hook)")
def test_log_records_lost_on_the_way_out_are_bounded_and_counted(clean_env):
    """A collector that is not there and a queue of 8: every record emitted is delivered or
    counted lost, by reason, and the queue never holds more than its size."""
    from tests.support.backends import free_port

    env = {
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_LLM_PREEMPTION_EVENTS": "log",
        "OTEL_LOGS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
        "OTEL_BLRP_MAX_QUEUE_SIZE": "8",
        "OTEL_BLRP_MAX_EXPORT_BATCH_SIZE": "4",
        "OTEL_BLRP_SCHEDULE_DELAY": "60000",
    }
    for k, v in env.items():
        clean_env.setenv(k, v)  # the SDK's batch processor reads OTEL_BLRP_* itself
    handle = setup_telemetry(environ=env)
    try:
        handle.telemetry.on_events(lifecycle("r", 1.0, preemptions=50))
        handle.telemetry.flush()
        (processor,) = handle.logger_provider._multi_log_record_processor._log_record_processors
        assert len(processor._batch_processor._queue) <= 8
    finally:
        handle.shutdown()
    assert handle.accounting is not None
    lost = handle.accounting.dropped
    assert lost.get(LOG_RECORDS_QUEUE_FULL, 0) >= 50 - 8 - 4  # at most a queue and a batch in flight got out
    assert (
        lost.get(LOG_RECORDS_QUEUE_FULL, 0)
        + lost.get(LOG_RECORDS_EXPORT_FAILED, 0)
        + handle.accounting.exported.get("log_records", 0)
        == 50
    )


# ------------------------------------------------------------------ OTLP through a real collector


def _attrs(kvs: Any) -> dict[str, Any]:
    out = {}
    for kv in kvs:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


def _log_records(sink: Any) -> list[Any]:
    with sink.lock:
        return [lr for req in sink.logs for rl in req.resource_logs for sl in rl.scope_logs for lr in sl.log_records]


@pytest.mark.backend
@needs_log_events
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_log_events_over_otlp_through_rotel(clean_env, protocol):
    hop = "grpc" if protocol == "grpc" else "http"
    with rotel_to_sink(hop) as (sink, rotel):
        env = {
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_LOGS_EXPORTER": "otlp",
            "OTEL_LLM_PREEMPTION_EVENTS": "log",
            "OTEL_SERVICE_NAME": "otel-llm-test",
            "OTEL_EXPORTER_OTLP_ENDPOINT": rotel.endpoint(hop),
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        }
        handle = setup_telemetry(TelemetryConfig.from_env(env, model_name="tiny"), environ=env)
        try:
            truth = engine_run(handle.telemetry)
            handle.force_flush()
            expected = sum(truth.values())

            def arrived() -> bool:
                spans = [s for s in sink.spans() if s.name == "llm_request"]
                return len(_log_records(sink)) >= expected and len(spans) >= len(truth)

            try:
                wait_until(arrived, timeout=15, what=f"log records through rotel ({protocol})")
            except TimeoutError as exc:
                raise AssertionError(
                    f"{exc}: {len(_log_records(sink))} of {expected} log records; rotel: {rotel.output()[-2000:]}"
                ) from None
        finally:
            handle.shutdown()

    spans = {_attrs(s.attributes)["gen_ai.request.id"]: s for s in sink.spans() if s.name == "llm_request"}
    records: dict[str, list[Any]] = {}
    for lr in _log_records(sink):
        records.setdefault(_attrs(lr.attributes)["gen_ai.request.id"], []).append(lr)
    assert sum(len(v) for v in records.values()) == sum(truth.values())  # exactly once each
    for rid, k in truth.items():
        span, recs = spans[rid], sorted(records.get(rid, []), key=lambda x: x.time_unix_nano)
        assert _attrs(span.attributes)["llm.request.num_preemptions"] == k
        assert not [e for e in span.events if e.name == "preempted"]
        assert [_attrs(x.attributes)["llm.preemption.ordinal"] for x in recs] == list(range(1, k + 1)), rid
        for x in recs:
            assert x.event_name == PREEMPTED_EVENT
            assert set(_attrs(x.attributes)) == ATTRIBUTES
            assert (x.trace_id, x.span_id) == (span.trace_id, span.span_id)
            assert span.start_time_unix_nano <= x.time_unix_nano <= span.end_time_unix_nano
