"""OTLP metric encoding: the SDK's MetricsData straight to the bytes of an ExportMetricsServiceRequest.

Why: as for spans (:mod:`otel_llm.export.span_encoding`), the exporters' encoder builds a protobuf
message per metric, data point and attribute; in vLLM's API server that was a quarter of an
export. Here a data point is a few byte-string joins: the encodings of what repeats from export
to export (attribute sets, metric names, histogram bounds) are kept. The bytes are those the
exporters' own encoder serialises (tests/export/test_metric_encoding.py); a metric of a kind
this does not know is left to the SDK's encoder, for the whole batch.

:class:`OwnMetricEncoding` wraps an OTLP metric exporter (HTTP or gRPC) of the SDK: while it
exports, the exporter module's ``encode_metrics`` gives this encoding (a message parsed from it
where the exporter reads the message); for every other caller it is the SDK's, unchanged.
"""

from __future__ import annotations

import contextvars
import struct
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

from opentelemetry.sdk.metrics.export import (
    ExponentialHistogram,
    Gauge,
    Histogram,
    MetricExporter,
    MetricExportResult,
    Sum,
)

from otel_llm import _sdk
from otel_llm._sdk import metric_exporter, otlp_exporters
from otel_llm.export.otlp_encoding import (
    PACK_DOUBLE,
    PACK_FIXED64,
    OtlpEncoder,
    Serialized,
    field,
    install_encoder,
    keep,
    string,
    uint,
    varint,
)

_PACK_SFIXED64 = struct.Struct("<q").pack


def _sint(number: int, value: int) -> bytes:
    """A proto3 sint32 field (zigzag): absent when zero."""
    return varint(number << 3) + varint((value << 1) ^ (value >> 31)) if value else b""


class MetricEncoder(OtlpEncoder):
    """Encodes MetricsData; keeps the encodings of resources, scopes, attribute values, metric
    names and bucket bounds."""

    def __init__(self) -> None:
        super().__init__()
        self._heads: dict[tuple[str, str, str], bytes] = {}
        self._bounds: dict[tuple[float, ...], bytes] = {}

    def encode(self, data: Any) -> tuple[bytes, int]:
        """The ExportMetricsServiceRequest of ``data``, serialised, and its number of data points.
        Raises TypeError for a metric of a kind it does not know."""
        out = []
        points = 0
        for resource_metrics in data.resource_metrics:
            resource = resource_metrics.resource
            body = [self.resource(resource)]
            for scope_metrics in resource_metrics.scope_metrics:
                scope = scope_metrics.scope
                parts = [self.scope(scope)]
                for metric in scope_metrics.metrics:
                    parts.append(field(2, self._metric(metric)))
                    points += len(metric.data.data_points)
                parts.append(string(3, scope.schema_url))
                body.append(field(2, b"".join(parts)))
            body.append(string(3, resource.schema_url))
            out.append(field(1, b"".join(body)))
        return b"".join(out), points

    def _metric(self, metric: Any) -> bytes:
        ident = (metric.name, metric.description, metric.unit)
        head = self._heads.get(ident)
        if head is None:
            head = keep(self._heads, ident, string(1, ident[0]) + string(2, ident[1]) + string(3, ident[2]))
        data = metric.data
        points = data.data_points
        if isinstance(data, Gauge):
            kind, body = 5, [field(1, self._number(p, False)) for p in points]
        elif isinstance(data, Histogram):
            kind, body = 9, [field(1, self._histogram(p)) for p in points]
            body.append(uint(2, int(data.aggregation_temporality)))
        elif isinstance(data, Sum):
            kind, body = 7, [field(1, self._number(p, True)) for p in points]
            body.append(uint(2, int(data.aggregation_temporality)))
            body.append(b"\x18\x01" if data.is_monotonic else b"")
        elif isinstance(data, ExponentialHistogram):
            kind, body = 10, [field(1, self._exponential(p)) for p in points]
            body.append(uint(2, int(data.aggregation_temporality)))
        else:
            raise TypeError(f"metric data of type {type(data).__name__}")
        if not points:  # the SDK's encoder sets the data with its first point
            return head
        return head + field(kind, b"".join(body))

    def _number(self, p: Any, started: bool) -> bytes:
        start, time, value = p.start_time_unix_nano, p.time_unix_nano, p.value
        parts = [
            b"\x11" + PACK_FIXED64(start) if started and start else b"",
            b"\x19" + PACK_FIXED64(time) if time else b"",
        ]
        is_int = isinstance(value, int)
        if not is_int:
            parts.append(b"\x21" + PACK_DOUBLE(value))
        parts.extend(field(5, self._exemplar(e)) for e in p.exemplars)
        if is_int:
            parts.append(b"\x31" + _PACK_SFIXED64(value))
        parts.append(self.attributes(7, p.attributes))
        return b"".join(parts)

    def _histogram(self, p: Any) -> bytes:
        start, time, count, counts = p.start_time_unix_nano, p.time_unix_nano, p.count, p.bucket_counts
        parts = [
            b"\x11" + PACK_FIXED64(start) if start else b"",
            b"\x19" + PACK_FIXED64(time) if time else b"",
            b"\x21" + PACK_FIXED64(count) if count else b"",
            b"\x29" + PACK_DOUBLE(p.sum) if p.sum is not None else b"",
            field(6, struct.pack(f"<{len(counts)}Q", *counts)) if counts else b"",
            self._explicit_bounds(p.explicit_bounds),
        ]
        parts.extend(field(8, self._exemplar(e)) for e in p.exemplars)
        parts.append(self.attributes(9, p.attributes))
        if p.min is not None:
            parts.append(b"\x59" + PACK_DOUBLE(p.min))
        if p.max is not None:
            parts.append(b"\x61" + PACK_DOUBLE(p.max))
        return b"".join(parts)

    def _explicit_bounds(self, bounds: Sequence[float]) -> bytes:
        if not bounds:
            return b""
        key = tuple(bounds)
        encoded = self._bounds.get(key)
        if encoded is None:
            encoded = keep(self._bounds, key, field(7, struct.pack(f"<{len(key)}d", *key)))
        return encoded

    def _exponential(self, p: Any) -> bytes:
        start, time, count, zero_count = p.start_time_unix_nano, p.time_unix_nano, p.count, p.zero_count
        parts = [
            self.attributes(1, p.attributes),
            b"\x11" + PACK_FIXED64(start) if start else b"",
            b"\x19" + PACK_FIXED64(time) if time else b"",
            b"\x21" + PACK_FIXED64(count) if count else b"",
            b"\x29" + PACK_DOUBLE(p.sum) if p.sum is not None else b"",
            _sint(6, p.scale),
            b"\x39" + PACK_FIXED64(zero_count) if zero_count else b"",
        ]
        for number, buckets in ((8, p.positive), (9, p.negative)):
            if buckets.bucket_counts:
                counts = b"".join(varint(c) for c in buckets.bucket_counts)
                parts.append(field(number, _sint(1, buckets.offset) + field(2, counts)))
        parts.append(uint(10, p.flags))
        parts.extend(field(11, self._exemplar(e)) for e in p.exemplars)
        if p.min is not None:
            parts.append(b"\x61" + PACK_DOUBLE(p.min))
        if p.max is not None:
            parts.append(b"\x69" + PACK_DOUBLE(p.max))
        return b"".join(parts)

    def _exemplar(self, e: Any) -> bytes:
        time, value = e.time_unix_nano, e.value
        parts = [b"\x11" + PACK_FIXED64(time) if time else b""]
        if isinstance(value, float):
            parts.append(b"\x19" + PACK_DOUBLE(value))
        elif not isinstance(value, int):
            raise TypeError("Exemplar value must be an int or float")
        if e.span_id is not None and e.trace_id is not None:
            parts.append(b"\x22\x08" + e.span_id.to_bytes(8, "big") + b"\x2a\x10" + e.trace_id.to_bytes(16, "big"))
        if not isinstance(value, float):
            parts.append(b"\x31" + _PACK_SFIXED64(value))
        parts.append(self.attributes(7, e.filtered_attributes))
        return b"".join(parts)


# The encoder of the OwnMetricEncoding exporting in this context (None: the SDK's encoding).
_active: "contextvars.ContextVar[Optional[MetricEncoder]]" = contextvars.ContextVar(
    "otel_llm_metric_encoder", default=None
)
_MODULES = (otlp_exporters.HTTP_METRICS, otlp_exporters.GRPC_METRICS)


class _Encoded(Serialized):
    """The bytes, and the number of data points, that the HTTP exporter reads of the message."""

    __slots__ = ("points",)

    def __init__(self, encoded: tuple[bytes, int]) -> None:
        super().__init__(encoded[0])
        self.points = encoded[1]


def _message(encoded: tuple[bytes, int]) -> Any:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    return ExportMetricsServiceRequest.FromString(encoded[0])


def _wrap_for(module: ModuleType) -> Callable[[tuple[bytes, int]], Any]:
    """What the module's ``encode_metrics`` returns: the bytes where the module reads only those
    and the point count (which it is made to take from them), else a message parsed from them."""
    if module.__name__ == otlp_exporters.HTTP_METRICS and otlp_exporters.count_data_points(
        module, _Encoded, lambda encoded: encoded.points
    ):
        return _Encoded
    return _message


class OwnMetricEncoding(MetricExporter):
    """``exporter`` (an SDK OTLP metric exporter), its batches encoded by :class:`MetricEncoder`
    (not where it splits batches by size: that takes the SDK's messages; nor where the exporters
    may read more of a request than :mod:`otel_llm._sdk.otlp_exporters` knows)."""

    def __init__(self, exporter: Any) -> None:
        temporality, aggregation = metric_exporter.preferences(exporter)
        super().__init__(preferred_temporality=temporality, preferred_aggregation=aggregation)
        self._exporter = exporter
        self._encoder = MetricEncoder()
        module = type(exporter).__module__
        self.enabled = (
            module in _MODULES
            and _sdk.holds("otlp_exporters")
            and not otlp_exporters.splits_batches(exporter)
            and install_encoder(module, "encode_metrics", _active, _wrap_for, "metric")
        )

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        token = _active.set(self._encoder if self.enabled else None)
        try:
            return self._exporter.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        finally:
            _active.reset(token)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._exporter.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._exporter.shutdown(timeout_millis=timeout_millis, **kwargs)
