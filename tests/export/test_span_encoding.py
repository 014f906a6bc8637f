"""otel_llm's OTLP span encoding: the bytes of the SDK exporters' own encoder, over the wire on
both protocols, and the SDK's encoding left to every other exporter in the process."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)
from opentelemetry.trace.span import TraceState

from otel_llm.config.settings import TelemetryConfig
from otel_llm.export import otlp, span_encoding
from otel_llm.testing import in_memory_telemetry
from tests.support.backends import backend, start_otlp_sink, wait_until

MODULES = {
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.trace_exporter",
}


def _varied_spans() -> list:
    """Spans of every shape the SDK makes: kinds, remote and local parents, links, trace state,
    statuses, events, and attribute values of each type (negative and 64-bit ints, -0.0,
    unicode, sequences)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm", "llm.engine": "0"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("otel_llm", "1.2.3")
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")]))
    local = SpanContext(0x1234, 0x5678, is_remote=False, trace_flags=TraceFlags(1))
    values: dict[str, Any] = {
        "s": "tiny",
        "unicode": "préemption ✓",
        "empty": "",
        "i": 96,
        "zero": 0,
        "negative": -5,
        "big": 2**63 - 1,
        "f": 0.125,
        "negative_zero": -0.0,
        "yes": True,
        "no": False,
        "strings": ("length", "stop"),
        "ints": (1, 2, 3),
        "floats": (0.5,),
        "bools": (True, False),
    }
    for i, (kind, parent) in enumerate(
        [(SpanKind.SERVER, remote), (SpanKind.INTERNAL, local), (SpanKind.CLIENT, None), (SpanKind.CONSUMER, remote)]
    ):
        context = set_span_in_context(NonRecordingSpan(parent)) if parent is not None else None
        links = [Link(local, {"link.n": i})] if i % 2 else [Link(remote)]
        span = tracer.start_span(f"chat tiny {i}", context=context, kind=kind, links=links, attributes=values)
        span.add_event("preempted", {"ordinal": 1, "num_computed_tokens": 17, "reason": "kv_cache_full"})
        span.add_event("empty")
        span.set_attribute("request", f"cmpl-{i}")
        if i == 1:
            span.set_status(Status(StatusCode.ERROR, "finish_reason=error"))
        elif i == 2:
            span.set_status(Status(StatusCode.OK))
        span.end()
    return list(exporter.get_finished_spans())


def _engine_spans() -> list:
    """Request spans of engine_stub under KV pressure (preemption events), as the plugin makes them."""
    from engine_stub import Engine, EngineConfig

    engine = Engine(
        EngineConfig(
            num_kv_blocks=12, block_size=16, max_num_seqs=8, max_num_batched_tokens=64, seed=0, load_plugins=False
        )
    )
    with in_memory_telemetry(TelemetryConfig(model_name="tiny", engine="0")) as mem:
        engine.hooks.subscribe(mem.telemetry)
        for i in range(12):
            engine.add_request(f"req-{i:02d}", "hello world " * (1 + i % 3), max_tokens=40 + 7 * i)
        engine.run()
        spans = list(mem.finished_spans())
    assert len(spans) == 12 and any(e.name == "preempted" for s in spans for e in s.events)
    return spans


@pytest.mark.parametrize("make", [_varied_spans, _engine_spans], ids=["varied", "engine"])
def test_the_encoding_is_the_sdk_encoders_byte_for_byte(make):
    spans = make()
    encoder = span_encoding.SpanEncoder()
    expected = encode_spans(spans).SerializePartialToString()
    assert encoder.encode(spans) == expected
    assert encoder.encode(spans) == expected  # from what it kept
    assert encoder.encode(spans[1:]) == encode_spans(spans[1:]).SerializePartialToString()


@pytest.mark.backend
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_both_protocols_send_the_encoding_and_other_exporters_keep_the_sdks(protocol, clean_env):
    spans = _engine_spans()
    with backend("otlp sink"), start_otlp_sink("grpc" if protocol == "grpc" else "http") as sink:
        exporter = otlp.exporter(TelemetryConfig(otlp_endpoint=sink.endpoint, otlp_protocol=protocol), {}, "traces")
        assert isinstance(exporter, span_encoding.OwnEncoding) and exporter.enabled
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        received = wait_until(lambda: list(sink.traces), timeout=30, what="the span export")
        exporter.shutdown()
    assert received == [ExportTraceServiceRequest.FromString(encode_spans(spans).SerializePartialToString())]
    # Outside an OwnEncoding export, the exporter module's encode_spans is the SDK's.
    module = importlib.import_module(MODULES[protocol])
    assert isinstance(module.encode_spans(spans), ExportTraceServiceRequest)


@pytest.mark.backend
def test_an_encoding_failure_falls_back_to_the_sdks_encoding(clean_env, monkeypatch, caplog):
    """A fake fault (the encoder raising): nothing here makes it fail otherwise."""
    spans = _varied_spans()

    def broken(self, batch):
        raise RuntimeError("encoder fault")

    monkeypatch.setattr(span_encoding.SpanEncoder, "encode", broken)
    with backend("otlp sink"), start_otlp_sink("http") as sink, caplog.at_level(logging.WARNING):
        config = TelemetryConfig(otlp_endpoint=sink.endpoint, otlp_protocol="http/protobuf")
        exporter = otlp.exporter(config, {}, "traces")
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        received = wait_until(lambda: list(sink.traces), timeout=30, what="the span export")
        exporter.shutdown()
    assert received == [ExportTraceServiceRequest.FromString(encode_spans(spans).SerializePartialToString())]
    assert "span encoding failed; the SDK's encoder is used" in caplog.text
