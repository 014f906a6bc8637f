"""OTLP span encoding: a batch of SDK spans straight to the bytes of an ExportTraceServiceRequest.

Why: the OTLP exporters' encoder builds a protobuf message object per span, attribute and value
(about 280 Python calls per span of ours), most of a span export's cost in a serving process
(5.7x this encoder's time for the spans of vLLM requests). Here a span is a few byte-string
joins, and the encoding of what repeats from span to span (the resource, the scope, an
attribute's key and value) is kept. The bytes are those the exporters' own encoder serialises
(tests/export/test_span_encoding.py), except that spans are grouped by resource and scope
object rather than by equal ones (one TracerProvider: one of each). The resources, scopes and
attributes are encoded as for metrics (:mod:`otel_llm.export.otlp_encoding`).

:class:`OwnEncoding` wraps an OTLP span exporter (HTTP or gRPC) of the SDK: while it exports, the
exporter module's ``encode_spans`` gives this encoding (a message parsed from it for gRPC, whose
stub serialises a message); for every other caller in the process it is the SDK's, unchanged.
"""

from __future__ import annotations

import contextvars
import struct
from collections.abc import Sequence
from typing import Any, Callable, Optional

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_llm.export.otlp_encoding import (
    PACK_FIXED64,
    OtlpEncoder,
    Serialized,
    field,
    install_encoder,
    keep,
    string,
    uint,
)

_PACK_FIXED32 = struct.Struct("<I").pack

# Span.flags: the parent's (or a link's) is_remote is known, and it is true.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200


class SpanEncoder(OtlpEncoder):
    """Encodes span batches; keeps the encodings of resources, scopes, attribute values, span
    names and statuses."""

    def __init__(self) -> None:
        super().__init__()
        self._names: dict[tuple[str, Any], bytes] = {}  # a span's name and kind
        self._statuses: dict[tuple[Optional[str], Any], bytes] = {}

    def encode(self, spans: Sequence[Any]) -> bytes:
        """The ExportTraceServiceRequest of ``spans``, serialised."""
        grouped: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
        for span in spans:
            resource = span.resource
            scopes = grouped.setdefault(id(resource), (resource, {}))[1]
            scope = span.instrumentation_scope or None
            scopes.setdefault(id(scope), (scope, []))[1].append(self._span(span))
        out = []
        for resource, scopes in grouped.values():
            body = [self.resource(resource)]
            for scope, encoded in scopes.values():
                scope_spans = self.scope(scope) + b"".join(encoded)
                if scope is not None:
                    scope_spans += string(3, scope.schema_url)
                body.append(field(2, scope_spans))
            body.append(string(3, resource.schema_url))
            out.append(field(1, b"".join(body)))
        return b"".join(out)

    def _span(self, span: Any) -> bytes:
        context = span.get_span_context()
        parent = span.parent
        parts = [
            b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + context.span_id.to_bytes(8, "big"),
        ]
        trace_state = context.trace_state
        if trace_state:
            parts.append(string(3, ",".join(f"{k}={v}" for k, v in trace_state.items())))
        if parent is not None:
            parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
        name_kind = self._names.get((span.name, span.kind))
        if name_kind is None:
            name_kind = keep(self._names, (span.name, span.kind), string(5, span.name) + uint(6, span.kind.value + 1))
        parts.append(name_kind)
        if span.start_time:
            parts.append(b"\x39" + PACK_FIXED64(span.start_time))
        if span.end_time:
            parts.append(b"\x41" + PACK_FIXED64(span.end_time))
        parts.append(self.attributes(9, span.attributes))
        parts.append(uint(10, span.dropped_attributes))
        for event in span.events:
            body = b"\x09" + PACK_FIXED64(event.timestamp) if event.timestamp else b""
            body += string(2, event.name) + self.attributes(3, event.attributes)
            body += uint(4, event.dropped_attributes)
            parts.append(field(11, body))
        parts.append(uint(12, span.dropped_events))
        for link in span.links:
            link_context = link.context
            body = (
                b"\x0a\x10"
                + link_context.trace_id.to_bytes(16, "big")
                + b"\x12\x08"
                + link_context.span_id.to_bytes(8, "big")
                + self.attributes(4, link.attributes)
                + uint(5, link.dropped_attributes)
                + b"\x35"
                + _PACK_FIXED32(_flags(link_context))
            )
            parts.append(field(13, body))
        parts.append(uint(14, span.dropped_links))
        status = span.status
        if status is not None:
            ident = (status.description, status.status_code)
            encoded = self._statuses.get(ident)
            if encoded is None:
                body = string(2, status.description) + uint(3, status.status_code.value)
                encoded = keep(self._statuses, ident, field(15, body))
            parts.append(encoded)
        parts.append(b"\x85\x01" + _PACK_FIXED32(_flags(parent)))
        return field(2, b"".join(parts))


def _flags(parent: Any) -> int:
    return _HAS_IS_REMOTE | _IS_REMOTE if parent is not None and parent.is_remote else _HAS_IS_REMOTE


# The encoder of the OwnEncoding exporting in this context (None: the SDK's encoding).
_active: "contextvars.ContextVar[Optional[SpanEncoder]]" = contextvars.ContextVar("otel_llm_span_encoder", default=None)


def _as_message(data: bytes) -> Any:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    return ExportTraceServiceRequest.FromString(data)


# The SDK's OTLP span exporters, by module: what their ``encode_spans`` returns.
_MODULES: dict[str, Callable[[bytes], Any]] = {
    "opentelemetry.exporter.otlp.proto.http.trace_exporter": Serialized,
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter": _as_message,
}


class OwnEncoding(SpanExporter):
    """``exporter`` (an SDK OTLP span exporter), its batches encoded by :class:`SpanEncoder`."""

    def __init__(self, exporter: Any) -> None:
        self._exporter = exporter
        self._encoder = SpanEncoder()
        module = type(exporter).__module__
        # Not for another exporter class, nor where the module encodes otherwise (the SDK's then).
        self.enabled = module in _MODULES and install_encoder(
            module, "encode_spans", _active, lambda _: _MODULES[module], "span"
        )

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        token = _active.set(self._encoder if self.enabled else None)
        try:
            return self._exporter.export(spans)
        finally:
            _active.reset(token)

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        self._exporter.shutdown(*args, **kwargs)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._exporter.force_flush(timeout_millis)
