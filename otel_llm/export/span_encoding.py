"""OTLP span encoding: a batch of SDK spans straight to the bytes of an ExportTraceServiceRequest.

Why: the OTLP exporters' encoder builds a protobuf message object per span, attribute and value
(about 280 Python calls per span of ours), most of a span export's cost in a serving process
(5.7x this encoder's time for the spans of vLLM requests). Here a span is a few byte-string
joins, and the encoding of what repeats from span to span (the resource, the scope, an
attribute's key and value) is kept. The bytes are those the exporters' own encoder serialises
(tests/export/test_span_encoding.py), except that spans are grouped by resource and scope
object rather than by equal ones (one TracerProvider: one of each). :class:`OtlpEncoder` (resources,
scopes, attributes) serves :mod:`otel_llm.export.metric_encoding` too.

:class:`OwnEncoding` wraps an OTLP span exporter (HTTP or gRPC) of the SDK: while it exports, the
exporter module's ``encode_spans`` gives this encoding (a message parsed from it for gRPC, whose
stub serialises a message); for every other caller in the process it is the SDK's, unchanged.
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import struct
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

_log = logging.getLogger(__name__)

_PACK_FIXED64 = struct.Struct("<Q").pack
_PACK_FIXED32 = struct.Struct("<I").pack
_PACK_DOUBLE = struct.Struct("<d").pack

# Span.flags: the parent's (or a link's) is_remote is known, and it is true.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200

_CACHED_VALUES = 4096  # attribute (key, value) encodings kept; cleared when full


_SMALL = [bytes((i,)) for i in range(128)]


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _SMALL[n]
    if n < 0:
        n += 1 << 64  # int64: two's complement, ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, message)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _string(number: int, value: Optional[str]) -> bytes:
    """A proto3 string field: absent when empty."""
    return _field(number, value.encode()) if value else b""


def _uint(number: int, value: int) -> bytes:
    """A proto3 varint field: absent when zero."""
    return _varint(number << 3) + _varint(value) if value else b""


def _any_value(value: Any) -> bytes:
    """An AnyValue message (the exporters' rules: None is an empty value)."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _field(1, value.encode())
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _PACK_DOUBLE(value)
    if isinstance(value, bytes):
        return _field(7, value)
    if isinstance(value, Sequence):
        return _field(5, b"".join(_field(1, _any_value(v)) for v in value))
    if isinstance(value, Mapping):
        return _field(6, b"".join(_field(1, _key_value(str(k), v)) for k, v in value.items()))
    raise TypeError(f"invalid attribute value type {type(value).__name__}")


def _key_value(key: str, value: Any) -> bytes:
    return _string(1, key) + _field(2, _any_value(value))


def keep(cache: dict[Any, bytes], key: Any, encoded: bytes) -> bytes:
    """``encoded`` kept in ``cache`` under ``key`` (the cache cleared when full); returned."""
    if len(cache) >= _CACHED_VALUES:
        cache.clear()
    cache[key] = encoded
    return encoded


class OtlpEncoder:
    """What OTLP's signals share: resources, scopes and attributes, their encodings kept."""

    def __init__(self) -> None:
        self._values: dict[tuple[int, str, type, Any], bytes] = {}
        self._resources: dict[int, tuple[Any, bytes]] = {}
        self._scopes: dict[int, tuple[Any, bytes]] = {}

    def _attributes(self, number: int, attributes: Optional[Mapping[str, Any]]) -> bytes:
        """The repeated KeyValue field ``number``. Strings, ints and bools are kept by value (a
        float rarely repeats: a latency); a float's key is kept."""
        if not attributes:
            return b""
        values = self._values
        out = []
        for key, value in attributes.items():
            kind = type(value)
            if kind is float:
                prefix = values.get((number, key, kind, None))
                if prefix is None:
                    key_part = _string(1, key)
                    prefix = _varint(number << 3 | 2) + _varint(len(key_part) + 11) + key_part + b"\x12\x09\x21"
                    self._keep((number, key, kind, None), prefix)
                out.append(prefix + _PACK_DOUBLE(value))
                continue
            if kind is tuple and len(value) == 1 and type(value[0]) is str:
                ident: Optional[tuple] = (number, key, kind, value)  # a finish reason: one of a few
            elif kind is str or kind is int or kind is bool:
                ident = (number, key, kind, value)
            else:
                ident = None
            encoded = values.get(ident) if ident is not None else None
            if encoded is None:
                encoded = _field(number, _key_value(key, value))
                if ident is not None:
                    self._keep(ident, encoded)
            out.append(encoded)
        return b"".join(out)

    def _keep(self, ident: tuple, encoded: bytes) -> None:
        keep(self._values, ident, encoded)

    def _resource(self, resource: Any) -> bytes:
        kept = self._resources.get(id(resource))
        if kept is None or kept[0] is not resource:
            kept = self._resources[id(resource)] = (resource, _field(1, self._attributes(1, resource.attributes)))
        return kept[1]

    def _scope(self, scope: Any) -> bytes:
        kept = self._scopes.get(id(scope))
        if kept is None or kept[0] is not scope:
            if scope is None:
                encoded = _field(1, b"")
            else:
                encoded = _field(
                    1,
                    _string(1, scope.name) + _string(2, scope.version) + self._attributes(3, scope.attributes),
                )
            kept = self._scopes[id(scope)] = (scope, encoded)
        return kept[1]


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
            body = [self._resource(resource)]
            for scope, encoded in scopes.values():
                scope_spans = self._scope(scope) + b"".join(encoded)
                if scope is not None:
                    scope_spans += _string(3, scope.schema_url)
                body.append(_field(2, scope_spans))
            body.append(_string(3, resource.schema_url))
            out.append(_field(1, b"".join(body)))
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
            parts.append(_string(3, ",".join(f"{k}={v}" for k, v in trace_state.items())))
        if parent is not None:
            parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
        name_kind = self._names.get((span.name, span.kind))
        if name_kind is None:
            name_kind = keep(self._names, (span.name, span.kind), _string(5, span.name) + _uint(6, span.kind.value + 1))
        parts.append(name_kind)
        if span.start_time:
            parts.append(b"\x39" + _PACK_FIXED64(span.start_time))
        if span.end_time:
            parts.append(b"\x41" + _PACK_FIXED64(span.end_time))
        parts.append(self._attributes(9, span.attributes))
        parts.append(_uint(10, span.dropped_attributes))
        for event in span.events:
            body = b"\x09" + _PACK_FIXED64(event.timestamp) if event.timestamp else b""
            body += _string(2, event.name) + self._attributes(3, event.attributes)
            body += _uint(4, event.dropped_attributes)
            parts.append(_field(11, body))
        parts.append(_uint(12, span.dropped_events))
        for link in span.links:
            link_context = link.context
            body = (
                b"\x0a\x10"
                + link_context.trace_id.to_bytes(16, "big")
                + b"\x12\x08"
                + link_context.span_id.to_bytes(8, "big")
                + self._attributes(4, link.attributes)
                + _uint(5, link.dropped_attributes)
                + b"\x35"
                + _PACK_FIXED32(_flags(link_context))
            )
            parts.append(_field(13, body))
        parts.append(_uint(14, span.dropped_links))
        status = span.status
        if status is not None:
            ident = (status.description, status.status_code)
            encoded = self._statuses.get(ident)
            if encoded is None:
                body = _string(2, status.description) + _uint(3, status.status_code.value)
                encoded = keep(self._statuses, ident, _field(15, body))
            parts.append(encoded)
        parts.append(b"\x85\x01" + _PACK_FIXED32(_flags(parent)))
        return _field(2, b"".join(parts))


def _flags(parent: Any) -> int:
    return _HAS_IS_REMOTE | _IS_REMOTE if parent is not None and parent.is_remote else _HAS_IS_REMOTE


# The encoder of the OwnEncoding exporting in this context (None: the SDK's encoding).
_active: "contextvars.ContextVar[Optional[SpanEncoder]]" = contextvars.ContextVar("otel_llm_span_encoder", default=None)
_installed: dict[str, bool] = {}  # by module, of every signal: whether its encoding function is ours
_install_lock = threading.Lock()


class _Serialized:
    """What the HTTP exporter asks of ``encode_spans``' message: its bytes."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializePartialToString(self) -> bytes:
        return self.data


def _as_message(data: bytes) -> Any:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    return ExportTraceServiceRequest.FromString(data)


def install_encoder(
    module_name: str,
    function: str,
    active: "contextvars.ContextVar[Any]",
    wrap_for: Callable[[Any], Callable[[Any], Any]],
    signal: str,
) -> bool:
    """``module_name``'s ``function`` (an exporter module's ``encode_spans`` or ``encode_metrics``)
    made to use the encoder that ``active`` holds in the exporting context, its result handed to
    the exporter as ``wrap_for(module)`` makes it (called once, at the install); the SDK's
    encoding where none is active or the encoder fails. False where the module has no such
    function (an SDK whose exporter encodes otherwise: its own encoding is used)."""
    with _install_lock:
        if module_name in _installed:
            return _installed[module_name]
        module = importlib.import_module(module_name)
        original = getattr(module, function, None)
        if not callable(original):
            _installed[module_name] = False
            return False
        wrap = wrap_for(module)

        def encode(batch: Any) -> Any:
            encoder = active.get()
            if encoder is None:
                return original(batch)
            try:
                return wrap(encoder.encode(batch))
            except Exception:  # noqa: BLE001 - the SDK's encoding, which reports what it cannot encode
                _log.warning("otel_llm: %s encoding failed; the SDK's encoder is used", signal, exc_info=True)
                return original(batch)

        setattr(module, function, encode)
        _installed[module_name] = True
        return True


# The SDK's OTLP span exporters, by module: what their ``encode_spans`` returns.
_MODULES: dict[str, Callable[[bytes], Any]] = {
    "opentelemetry.exporter.otlp.proto.http.trace_exporter": _Serialized,
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
