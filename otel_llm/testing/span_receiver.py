"""A minimal OTLP/gRPC trace receiver on 127.0.0.1 that keeps the spans it is sent, in memory.

``otel-llm demo-vllm`` and bench/vllm_engine.py point the vLLM server's plugin at it
(``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) to read its ``llm_request`` spans back. Built on grpc
and opentelemetry-proto, both dependencies of the OTLP exporter that otel-llm depends on.
"""

from __future__ import annotations

import threading
from concurrent import futures
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


class SpanReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """``with SpanReceiver() as receiver:`` serves OTLP/gRPC traces at ``receiver.endpoint``."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.port = 0
        self._changed = threading.Condition()
        self._server: Optional[grpc.Server] = None

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def Export(self, request: Any, context: Any) -> Any:  # the gRPC method's name
        received = [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
        with self._changed:
            self.spans.extend(received)
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

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
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1).wait(5)
            self._server = None

    def __enter__(self) -> "SpanReceiver":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
