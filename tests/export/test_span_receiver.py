"""otel_llm.testing.span_receiver: the receiver that the vLLM demo and benchmark read spans back from."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from otel_llm.testing.span_receiver import SpanReceiver, span_attributes


def _send_span(exporter: Any, name: str, tokens: int) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("t").start_as_current_span(name) as span:
        span.set_attribute("gen_ai.usage.output_tokens", tokens)
    provider.shutdown()


def test_spans_over_grpc_and_http_and_metric_exports_counted():
    with SpanReceiver() as receiver:
        _send_span(GrpcSpanExporter(endpoint=receiver.endpoint, insecure=True), "over_grpc", 3)
        _send_span(HttpSpanExporter(endpoint=receiver.http_endpoint + "/v1/traces"), "over_http", 5)
        gzipped = HttpSpanExporter(endpoint=receiver.http_endpoint + "/v1/traces", compression=Compression.Gzip)
        _send_span(gzipped, "over_http", 7)

        reader = InMemoryMetricReader()
        meters = MeterProvider(metric_readers=[reader])
        meters.get_meter("t").create_counter("c").add(1)
        exporter = OTLPMetricExporter(endpoint=receiver.http_endpoint + "/v1/metrics")
        data = reader.get_metrics_data()
        assert data is not None
        assert exporter.export(data).name == "SUCCESS"
        meters.shutdown()

        assert [span_attributes(s)["gen_ai.usage.output_tokens"] for s in receiver.named("over_grpc")] == [3]
        assert [span_attributes(s)["gen_ai.usage.output_tokens"] for s in receiver.named("over_http")] == [5, 7]
        assert receiver.metric_exports == 1
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(urllib.request.Request(receiver.http_endpoint + "/v1/logs", b"", method="POST"))
        assert raised.value.code == 404
