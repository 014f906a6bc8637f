"""otel_llm's OTLP metric encoding: the bytes of the SDK exporters' own encoder, over the wire on
both protocols, and the SDK's encoding left to every other exporter in the process."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.sdk.metrics import Counter, MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader, MetricExportResult
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from otel_llm import _sdk
from otel_llm.config.settings import TelemetryConfig
from otel_llm.export import metric_encoding, otlp
from otel_llm.testing import in_memory_telemetry
from tests.support.backends import backend, start_otlp_sink, wait_until

MODULES = {
    "grpc": "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "http/protobuf": "opentelemetry.exporter.otlp.proto.http.metric_exporter",
}


def _varied_metrics(temporality: AggregationTemporality = AggregationTemporality.CUMULATIVE):
    """Metrics of every kind the SDK makes: int and float sums (monotonic or not), gauges,
    explicit and exponential histograms (negative values where the SDK takes them, exemplars with
    and without a trace), units, descriptions, resource attributes, attribute values of each
    type. (A scope's attributes and schema URL: the oldest SDK's encoder drops them, below.)"""
    reader = InMemoryMetricReader(
        preferred_temporality={Counter: temporality} if temporality is AggregationTemporality.DELTA else None
    )
    provider = MeterProvider(
        metric_readers=[reader],
        resource=Resource.create({"service.name": "vllm", "llm.engine": "0"}),
        views=[View(instrument_name="exponential", aggregation=ExponentialBucketHistogramAggregation())],
    )
    meter = provider.get_meter("otel_llm", "1.2.3")
    other = provider.get_meter("other")
    labels: dict[str, Any] = {
        "model_name": "tiny",
        "engine": "0",
        "big": 2**63 - 1,
        "f": -0.0,
        "yes": True,
        "s": ("a", "b"),
    }
    tokens = meter.create_counter("tokens", unit="{token}", description="generated tokens")
    tokens.add(96, labels)
    tokens.add(3, {"model_name": "other"})
    meter.create_counter("seconds").add(0.125)
    meter.create_up_down_counter("running").add(-2, {"engine": "1"})
    meter.create_observable_gauge("usage", [lambda _: [_obs(0.5, {"engine": "0"}), _obs(-7, {"engine": "1"})]])
    latency = meter.create_histogram("latency", unit="s")
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("request"):  # sampled: exemplars with trace and span ids
        for v in (0.001, 0.3, 2.5, 7.0, 12000.0):
            latency.record(v, {"model_name": "tiny"})
    latency.record(4, {"model_name": "int"})
    exponential = other.create_histogram("exponential")
    for v in (-3.5, -0.25, 0.0, 0.0, 1.0, 1.5, 1e6):
        exponential.record(v)
    meter.create_counter("never_added")
    return reader.get_metrics_data()


def _obs(value, attributes):
    from opentelemetry.metrics import Observation

    return Observation(value, attributes)


def _engine_metrics():
    """engine_stub's metrics under KV pressure, as the plugin makes them (in-process histograms)."""
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
        mem.telemetry.flush()
        return mem.metric_reader.get_metrics_data()


def _points(data) -> int:
    return sum(len(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics)


@pytest.mark.parametrize(
    "make",
    [_varied_metrics, lambda: _varied_metrics(AggregationTemporality.DELTA), _engine_metrics],
    ids=["varied", "delta", "engine"],
)
def test_the_encoding_is_the_sdk_encoders_byte_for_byte(make):
    data = make()
    encoder = metric_encoding.MetricEncoder()
    expected = encode_metrics(data).SerializeToString()
    assert encoder.encode(data) == (expected, _points(data))
    assert encoder.encode(data) == (expected, _points(data))  # from what it kept


def test_a_scopes_attributes_and_schema_url_are_encoded():
    """What newer SDKs' encoders send and the oldest one's (1.28) drops: kept here on every SDK."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    schema = "https://opentelemetry.io/schemas/1.26.0"
    provider.get_meter("otel_llm", "1.2.3", schema_url=schema, attributes={"scope.kind": "test"}).create_counter(
        "tokens"
    ).add(1)
    data = reader.get_metrics_data()
    assert data is not None
    encoded, points = metric_encoding.MetricEncoder().encode(data)
    scope_metrics = ExportMetricsServiceRequest.FromString(encoded).resource_metrics[0].scope_metrics[0]
    assert points == 1 and scope_metrics.schema_url == schema
    assert (scope_metrics.scope.name, scope_metrics.scope.version) == ("otel_llm", "1.2.3")
    assert [(a.key, a.value.string_value) for a in scope_metrics.scope.attributes] == [("scope.kind", "test")]


def test_where_the_exporters_contract_does_not_hold_or_they_split_batches_the_sdks_encoder_is_used(
    clean_env, monkeypatch
):
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    config = TelemetryConfig(otlp_endpoint="http://127.0.0.1:4317", otlp_protocol="grpc")
    splitting = metric_encoding.OwnMetricEncoding(OTLPMetricExporter(max_export_batch_size=100))
    monkeypatch.setattr(_sdk, "_unmet", {"otlp_exporters": "moved"})
    unmet = otlp.exporter(config, {}, "metrics")
    for exporter in (splitting, unmet):
        assert isinstance(exporter, metric_encoding.OwnMetricEncoding) and not exporter.enabled
        exporter.shutdown()


@pytest.mark.backend
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_both_protocols_send_the_encoding_and_other_exporters_keep_the_sdks(protocol, clean_env):
    data = _varied_metrics()
    with backend("otlp sink"), start_otlp_sink("grpc" if protocol == "grpc" else "http") as sink:
        exporter = otlp.exporter(TelemetryConfig(otlp_endpoint=sink.endpoint, otlp_protocol=protocol), {}, "metrics")
        assert isinstance(exporter, metric_encoding.OwnMetricEncoding) and exporter.enabled
        assert exporter.export(data) is MetricExportResult.SUCCESS
        received = wait_until(lambda: list(sink.metrics), timeout=30, what="the metric export")
        exporter.shutdown()
    assert received == [ExportMetricsServiceRequest.FromString(encode_metrics(data).SerializeToString())]
    module = importlib.import_module(MODULES[protocol])
    assert isinstance(module.encode_metrics(data), ExportMetricsServiceRequest)  # outside our exports


@pytest.mark.backend
def test_an_encoding_failure_falls_back_to_the_sdks_encoding(clean_env, monkeypatch, caplog):
    """A fake fault (the encoder raising): nothing here makes it fail otherwise."""
    data = _varied_metrics()

    def broken(self, batch):
        raise RuntimeError("encoder fault")

    monkeypatch.setattr(metric_encoding.MetricEncoder, "encode", broken)
    with backend("otlp sink"), start_otlp_sink("http") as sink, caplog.at_level(logging.WARNING):
        config = TelemetryConfig(otlp_endpoint=sink.endpoint, otlp_protocol="http/protobuf")
        exporter = otlp.exporter(config, {}, "metrics")
        assert exporter.export(data) is MetricExportResult.SUCCESS
        received = wait_until(lambda: list(sink.metrics), timeout=30, what="the metric export")
        exporter.shutdown()
    assert received == [ExportMetricsServiceRequest.FromString(encode_metrics(data).SerializeToString())]
    assert "metric encoding failed; the SDK's encoder is used" in caplog.text
