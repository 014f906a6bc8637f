"""A minimal OTLP receiver on 127.0.0.1 that keeps the spans it is sent, in memory.

``otel-llm demo-vllm`` and bench/vllm/engine.py point the vLLM server's plugin at it
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) to read its ``llm_request`` spans back. Traces over
OTLP/gRPC (``endpoint``) or OTLP/HTTP (``http_endpoint``, where metric exports are counted too).
Built on grpc and opentelemetry-proto, both dependencies of the OTLP exporter that otel-llm
depends on.
"""

from __future__ import annotations

import gzip
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

LOOPBACK = "127.0.0.1"


def attribute_value(value: AnyValue) -> Any:
    """The Python value of a scalar OTLP attribute (None for arrays, maps and empty values)."""
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else None


def span_attributes(span: Span) -> dict[str, Any]:
    """An OTLP span's attributes as Python values; an array of strings as a list."""
    out: dict[str, Any] = {}
    for a in span.attributes:
        if a.value.WhichOneof("value") == "array_value":
            out[a.key] = [x.string_value for x in a.value.array_value.values]
        else:
            out[a.key] = attribute_value(a.value)
    return out


def _instance(resource: Any) -> str:
    values = [a.value.string_value for a in resource.attributes if a.key == "service.instance.id"]
    return values[0] if values else ""


class SpanReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """``with SpanReceiver() as receiver:`` serves OTLP/gRPC traces at ``receiver.endpoint``."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.instances: list[str] = []  # each span's resource's service.instance.id ("" if none)
        self.metric_exports = 0  # OTLP/HTTP metric requests received
        self.port = 0
        self._changed = threading.Condition()
        self._server: Optional[grpc.Server] = None
        self._http: Optional[ThreadingHTTPServer] = None

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def http_endpoint(self) -> str:
        """OTLP/HTTP base URL (``OTEL_EXPORTER_OTLP_ENDPOINT``): /v1/traces and /v1/metrics."""
        assert self._http is not None, "not started"
        return f"http://{LOOPBACK}:{self._http.server_address[1]}"

    def Export(self, request: Any, context: Any) -> Any:  # the gRPC method's name
        received = [
            (span, _instance(rs.resource))
            for rs in request.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]
        with self._changed:
            self.spans.extend(span for span, _ in received)
            self.instances.extend(instance for _, instance in received)
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def _received_http(self, path: str, body: bytes) -> bool:
        """An OTLP/HTTP request's protobuf body; False for a path it does not serve."""
        if path == "/v1/traces":
            self.Export(trace_service_pb2.ExportTraceServiceRequest.FromString(body), None)
        elif path == "/v1/metrics":
            with self._changed:
                self.metric_exports += 1
                self._changed.notify_all()
        else:
            return False
        return True

    def named(self, name: str) -> list[Span]:
        with self._changed:
            return [span for span in self.spans if span.name == name]

    def wait_for(self, ready: Callable[["SpanReceiver"], bool], timeout_s: float) -> bool:
        """Waits until ``ready(self)`` holds (checked at each export), at most ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(lambda: ready(self), timeout_s)

    def start(self) -> "SpanReceiver":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, server)
        self.port = server.add_insecure_port(f"{LOOPBACK}:0")
        server.start()
        self._server = server
        self._http = ThreadingHTTPServer((LOOPBACK, 0), _http_handler(self))
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, daemon=True, name="span-receiver-http").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1).wait(5)
            self._server = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def __enter__(self) -> "SpanReceiver":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _http_handler(receiver: SpanReceiver) -> type:
    class Handler(BaseHTTPRequestHandler):
        wbufsize = 1 << 16  # the status, headers and body in one write: no delayed-ACK wait for the client

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            served = receiver._received_http(self.path, body)
            self.send_response(200 if served else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: the bench and the demo print what they received

    return Handler
