"""Reliability: security defaults.

* Listeners bind 127.0.0.1 unless a host is configured (the Prometheus endpoint's socket).
* OTLP headers and TLS work through the standard variables: OTEL_EXPORTER_OTLP_HEADERS reaches
  the receiver; OTEL_EXPORTER_OTLP_CERTIFICATE (a self-signed CA made here with ``openssl``) lets
  the exporter talk to a TLS receiver on 127.0.0.1 (HTTP, and gRPC with a TLS OTLP sink), and
  without it the export fails, counted.
* No prompt or output text is recorded unless ``record_content=True``; then it is truncated to
  ``content_max_length``.
* Secrets in headers and endpoint credentials never appear in logs (setup, failing exports);
  credentials in a gRPC endpoint URL are refused at setup (gRPC would log, not send, them).
"""

from __future__ import annotations

import dataclasses
import gzip
import logging
import shutil
import socket
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_llm
from otel_llm import EngineTelemetry, EventType, RequestEvent, TelemetryConfig, setup_telemetry
from otel_llm.catalogue.drops import METRIC_POINTS_EXPORT_FAILED, SPANS_EXPORT_FAILED
from tests.support.backends import backend, start_otlp_sink
from tests.support.otel_helpers import attrs

E = EventType
SECRET = "s3cr3t-T0KEN-value"


def one_request(telemetry: EngineTelemetry, rid: str = "r1", prompt: str = "", output: str = "") -> None:
    telemetry.on_events(
        [
            RequestEvent(E.ARRIVED, rid, 1.0, prompt_tokens=3, max_tokens=4, prompt_text=prompt or None),
            RequestEvent(E.SCHEDULED, rid, 1.0),
            RequestEvent(E.TOKENS, rid, 1.5, num_tokens=1),
            RequestEvent(E.FINISHED, rid, 2.0, finish_reason="stop", output_text=output or None),
        ]
    )


# ----------------------------------------------------------------------------- listeners


def test_prometheus_endpoint_binds_loopback_by_default(clean_env):
    handle = setup_telemetry(
        TelemetryConfig(metrics_exporters=("prometheus",), traces_exporters=("none",), prometheus_port=0)
    )
    try:
        host, port = handle.prometheus._server.socket.getsockname()[:2]
        assert host == "127.0.0.1", host
        assert handle.prometheus.url.startswith("http://127.0.0.1:")
    finally:
        handle.shutdown()


def test_prometheus_endpoint_binds_elsewhere_only_when_configured(clean_env):
    clean_env.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "0.0.0.0")
    clean_env.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "0")
    clean_env.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")
    handle = setup_telemetry()
    try:
        assert handle.prometheus._server.socket.getsockname()[0] == "0.0.0.0"
    finally:
        handle.shutdown()


# ----------------------------------------------------------------------------- a capturing receiver


class Receiver:
    """A tiny OTLP/HTTP receiver on 127.0.0.1 (plain or TLS) that records paths and headers."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.requests: list[tuple[str, dict[str, str], int]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if (self.headers.get("Content-Encoding") or "").lower() == "gzip":
                    body = gzip.decompress(body)
                with receiver.lock:
                    receiver.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, len(body)))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def paths(self) -> set[str]:
        with self.lock:
            return {p for p, _, _ in self.requests}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _otlp_env(env, endpoint: str, protocol: str = "http/protobuf") -> None:
    env.setenv("OTEL_METRICS_EXPORTER", "otlp")
    env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    env.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")
    env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "3")


def test_otlp_headers_from_the_standard_variable_reach_the_receiver(clean_env, receiver, caplog):
    caplog.set_level(logging.DEBUG)
    _otlp_env(clean_env, f"http://127.0.0.1:{receiver.port}")
    clean_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{SECRET},x-tenant=acme")
    handle = setup_telemetry(TelemetryConfig(model_name="m"))
    one_request(handle.telemetry)
    assert handle.force_flush(10_000)
    handle.shutdown()
    assert {"/v1/metrics", "/v1/traces"} <= receiver.paths()
    for path, headers, _ in receiver.requests:
        assert headers.get("authorization") == f"Bearer {SECRET}", (path, headers)
        assert headers.get("x-tenant") == "acme"
    assert SECRET not in caplog.text


# ----------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


@pytest.fixture
def tls_receiver(self_signed) -> Iterator[Receiver]:
    cert, key = self_signed
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    r = Receiver(tls=context)
    yield r
    r.close()


def test_otlp_over_tls_with_the_certificate_variable(clean_env, tls_receiver, self_signed):
    _otlp_env(clean_env, f"https://127.0.0.1:{tls_receiver.port}")
    clean_env.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(self_signed[0]))
    handle = setup_telemetry(TelemetryConfig(model_name="m"))
    one_request(handle.telemetry)
    assert handle.force_flush(10_000)
    handle.shutdown()
    assert {"/v1/metrics", "/v1/traces"} <= tls_receiver.paths()
    assert handle.accounting is not None
    assert handle.accounting.dropped == {} and handle.accounting.exported.get("spans") == 1


def test_otlp_grpc_over_tls_with_the_certificate_variable(clean_env, self_signed):
    with backend("otlp sink"), start_otlp_sink("grpc", tls=self_signed) as sink:
        assert sink.endpoint.startswith("https://127.0.0.1:")
        _otlp_env(clean_env, sink.endpoint, "grpc")
        clean_env.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(self_signed[0]))
        handle = setup_telemetry(TelemetryConfig(model_name="m"))
        one_request(handle.telemetry)
        assert handle.force_flush(10_000)
        handle.shutdown()
        spans = sink.spans()
        assert [a.value.string_value for s in spans for a in s.attributes if a.key == "gen_ai.request.id"] == ["r1"]
        assert "vllm:request_num_preemptions" in sink.metric_names()
        assert handle.accounting is not None
        assert handle.accounting.dropped == {} and handle.accounting.exported.get("spans") == 1


def test_otlp_grpc_over_tls_without_the_ca_fails_counted_not_raised(clean_env, self_signed):
    with backend("otlp sink"), start_otlp_sink("grpc", tls=self_signed) as sink:
        _otlp_env(clean_env, sink.endpoint, "grpc")
        handle = setup_telemetry(TelemetryConfig(model_name="m"))
        one_request(handle.telemetry)
        handle.force_flush(10_000)  # the handshake fails: logged by the SDK, counted by us, never raised
        handle.shutdown()
        assert sink.spans() == []
        assert handle.accounting is not None
        assert handle.accounting.dropped.get(SPANS_EXPORT_FAILED) == 1


def test_otlp_over_tls_without_the_ca_fails_counted_not_raised(clean_env, tls_receiver, caplog):
    caplog.set_level(logging.DEBUG)
    _otlp_env(clean_env, f"https://127.0.0.1:{tls_receiver.port}")
    clean_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization={SECRET}")
    handle = setup_telemetry(TelemetryConfig(model_name="m"))
    one_request(handle.telemetry)
    handle.force_flush(10_000)  # fails verification: logged by the SDK, counted by us, never raised
    handle.shutdown()
    assert tls_receiver.paths() == set()
    assert handle.accounting is not None
    assert handle.accounting.dropped.get(SPANS_EXPORT_FAILED) == 1
    assert handle.accounting.dropped.get(METRIC_POINTS_EXPORT_FAILED, 0) > 0
    assert SECRET not in caplog.text


# ----------------------------------------------------------------------------- content


def _span_rig(config: TelemetryConfig) -> tuple[EngineTelemetry, InMemorySpanExporter, InMemoryMetricReader]:
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader], views=otel_llm.views(config))
    # defer_steps=1: each on_events applied at once, so that its span can be read right after.
    config = dataclasses.replace(config, defer_steps=1)
    return EngineTelemetry(config, meter_provider=mp, tracer_provider=tp), spans, reader


def test_no_prompt_or_output_text_unless_asked_then_truncated(caplog):
    caplog.set_level(logging.DEBUG)
    prompt, output = "PROMPT-" + "p" * 5000, "OUTPUT-" + "o" * 5000
    telemetry, spans, reader = _span_rig(TelemetryConfig(model_name="m"))
    one_request(telemetry, prompt=prompt, output=output)
    telemetry.on_events([RequestEvent(E.ARRIVED, "bad", float("nan"), prompt_text=prompt)])  # dropped, logged
    (span,) = spans.get_finished_spans()
    texts = [str(v) for v in attrs(span.attributes).values()]
    texts += [str(v) for e in span.events for v in attrs(e.attributes).values()]
    assert not any("PROMPT-" in t or "OUTPUT-" in t for t in texts)
    data = reader.get_metrics_data()
    assert data is not None
    assert not any(
        "PROMPT-" in str(v) or "OUTPUT-" in str(v)
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        for p in m.data.data_points
        for v in attrs(p.attributes).values()
    )
    assert "PROMPT-" not in caplog.text and "OUTPUT-" not in caplog.text

    telemetry, spans, _ = _span_rig(TelemetryConfig(model_name="m", record_content=True, content_max_length=12))
    one_request(telemetry, prompt=prompt, output=output)
    (span,) = spans.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["gen_ai.prompt"] == prompt[:12]
    assert span.attributes["gen_ai.completion"] == output[:12]


# ----------------------------------------------------------------------------- secrets in logs


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_secrets_never_appear_in_logs_during_setup_and_failing_exports(clean_env, caplog, protocol):
    caplog.set_level(logging.DEBUG)
    port = _closed_port()  # nothing listens: every export fails
    clean_env.setenv("OTEL_METRICS_EXPORTER", "otlp")
    clean_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    if protocol == "grpc":
        # gRPC sends no URL credentials and its exporter logs the endpoint on every failure: refused.
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://user:{SECRET}-pw@127.0.0.1:{port}")
        with pytest.raises(ValueError) as info:
            setup_telemetry(TelemetryConfig(model_name="m"))
        assert SECRET not in str(info.value) and "OTEL_EXPORTER_OTLP_HEADERS" in str(info.value)
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    else:  # HTTP uses them (basic auth) and must not log them
        clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://user:{SECRET}-pw@127.0.0.1:{port}")
    clean_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", f"authorization=Bearer%20{SECRET},api-key={SECRET}")
    clean_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    clean_env.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")
    handle = setup_telemetry(TelemetryConfig(model_name="m"))
    one_request(handle.telemetry)
    handle.force_flush(5_000)
    handle.shutdown()
    assert handle.accounting is not None
    assert sum(handle.accounting.dropped.values()) > 0, "the exports were expected to fail"
    assert any("otel_llm telemetry" in r.getMessage() for r in caplog.records), "setup logs its settings"
    leaked = [
        r.getMessage() for r in caplog.records if SECRET in r.getMessage() or (r.exc_text and SECRET in r.exc_text)
    ]
    assert not leaked, leaked[:3]
    assert SECRET not in caplog.text
