"""Reading what the telemetry produced: metric points by metric key or name, explicit-bucket
histograms, counters, request spans and their preemptions (span events or log records).

Works on the SDK's data as any reader or exporter holds it (duck-typed: ``attributes``,
``bucket_counts``, ``value``, span ``events``), so it does not import the OpenTelemetry SDK.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional

from otel_llm.catalogue.metrics import BY_KEY, METRICS

REQUEST_ID = "gen_ai.request.id"  # the request span's attribute that holds the request id
PREEMPTED = "preempted"  # the span event of one preemption


@dataclass(frozen=True)
class Histogram:
    """One explicit-bucket histogram point: ``bucket_counts[i]`` observations fell in
    ``(bounds[i-1], bounds[i]]``; the last bucket is ``(bounds[-1], +inf)``."""

    attributes: Mapping[str, Any]
    bounds: tuple[float, ...]
    bucket_counts: tuple[int, ...]
    count: int
    sum: float

    @property
    def buckets(self) -> dict[float, int]:
        """Upper bound -> observations in that bucket (not cumulative), ``inf`` last."""
        return dict(zip((*self.bounds, math.inf), self.bucket_counts))


@dataclass(frozen=True)
class Preemption:
    """One preemption of a request, as its span event or log record says: ``ordinal`` counts from
    1, ``num_computed_tokens`` were thrown away, for ``reason`` (e.g. ``kv_cache_full``), at
    ``time_ns`` (wall clock)."""

    ordinal: int
    num_computed_tokens: int
    reason: str
    time_ns: int


def _matches(point: Any, attributes: Mapping[str, Any]) -> bool:
    return all(point.attributes.get(k) == v for k, v in attributes.items())


class MetricsSnapshot(Mapping[str, list[Any]]):
    """One collection of a metric reader: metric name -> its data points (the SDK's).

    Every reading method takes a metric *key* of :data:`otel_llm.catalogue.metrics.METRICS` (such as
    ``"request_num_preemptions"``, resolved to the name of the naming profile) or an exported name
    (``"vllm:request_num_preemptions"``), and optionally the attributes a point must have, as a
    mapping (for dotted keys) and/or keyword arguments.
    """

    def __init__(self, points: Mapping[str, list[Any]], naming: str = "vllm") -> None:
        self._points = dict(points)
        self.naming = naming

    def __getitem__(self, name: str) -> list[Any]:
        return self._points[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._points)

    def __len__(self) -> int:
        return len(self._points)

    def __repr__(self) -> str:
        return f"MetricsSnapshot({sorted(self._points)})"

    def name(self, metric: str) -> str:
        """The exported name of ``metric`` (a key or a name): the profile's name, or the instrument
        name where the provider was built without otel_llm.views (no rename)."""
        definition = BY_KEY.get(metric)
        if definition is None:
            return metric
        name = definition.name(self.naming)
        instrument = definition.instrument_name(self.naming)
        return instrument if name not in self._points and instrument in self._points else name

    def points(self, metric: str, attributes: Optional[Mapping[str, Any]] = None, /, **attrs: Any) -> list[Any]:
        """The points of ``metric`` whose attributes include the given ones ([] if none)."""
        wanted = {**(attributes or {}), **attrs}
        return [p for p in self._points.get(self.name(metric), ()) if _matches(p, wanted)]

    def point(self, metric: str, attributes: Optional[Mapping[str, Any]] = None, /, **attrs: Any) -> Any:
        """The one point of ``metric`` with the given attributes; LookupError unless exactly one."""
        found = self.points(metric, attributes, **attrs)
        if len(found) != 1:
            wanted = {**(attributes or {}), **attrs}
            present = [dict(p.attributes) for p in self._points.get(self.name(metric), ())]
            raise LookupError(f"{self.name(metric)} {wanted}: {len(found)} points match; points present: {present}")
        return found[0]

    def histograms(
        self, metric: str, attributes: Optional[Mapping[str, Any]] = None, /, **attrs: Any
    ) -> list[Histogram]:
        """Each attribute set's explicit-bucket histogram of ``metric`` (with the given attributes)."""
        return [_histogram(self.name(metric), p) for p in self.points(metric, attributes, **attrs)]

    def histogram(self, metric: str, attributes: Optional[Mapping[str, Any]] = None, /, **attrs: Any) -> Histogram:
        """The one explicit-bucket histogram of ``metric`` with the given attributes."""
        return _histogram(self.name(metric), self.point(metric, attributes, **attrs))

    def counter(self, metric: str, attributes: Optional[Mapping[str, Any]] = None, /, **attrs: Any) -> float:
        """The sum of ``metric``'s points with the given attributes (a counter over all its label
        values unless narrowed). 0 for a metric of the table that has no point yet; LookupError for
        a name that is neither collected nor in the table (a typo)."""
        name = self.name(metric)
        if name not in self._points and name not in _TABLE_NAMES:
            raise LookupError(
                f"{name}: not collected and not a metric of otel_llm.catalogue.metrics.METRICS; "
                f"collected: {sorted(self._points)}"
            )
        return sum(p.value for p in self.points(metric, attributes, **attrs))


_TABLE_NAMES = frozenset(
    n for m in METRICS for profile in ("vllm", "semconv") for n in (m.name(profile), m.instrument_name(profile))
)


def _histogram(name: str, point: Any) -> Histogram:
    if not hasattr(point, "explicit_bounds"):
        raise TypeError(
            f"{name} is not an explicit-bucket histogram here ({type(point).__name__}): read its point with .point()"
        )
    return Histogram(
        dict(point.attributes), tuple(point.explicit_bounds), tuple(point.bucket_counts), point.count, point.sum
    )


def collect_metrics(reader: Any, naming: str = "vllm") -> MetricsSnapshot:
    """Collect ``reader`` (an InMemoryMetricReader) once: every metric's points by name. ``naming``
    is the config's profile, to resolve metric keys. With delta temporality each collection holds
    what was recorded since the previous one."""
    out: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return MetricsSnapshot(out, naming)


def spans_by_request(spans: Iterable[Any]) -> dict[str, Any]:
    """The request spans among ``spans`` (finished spans, e.g. an InMemorySpanExporter's), by
    request id (their ``gen_ai.request.id``)."""
    return {s.attributes[REQUEST_ID]: s for s in spans if s.attributes and REQUEST_ID in s.attributes}


def span_preemptions(span: Any) -> list[Preemption]:
    """The preemptions recorded on a request span, as its ``preempted`` span events (the span
    keeps at most the SDK's event limit of them; ``llm.request.num_preemptions`` has the count)."""
    return [
        Preemption(e.attributes["ordinal"], e.attributes["num_computed_tokens"], e.attributes["reason"], e.timestamp)
        for e in span.events
        if e.name == PREEMPTED
    ]


def log_preemptions(records: Iterable[Any], request_id: str) -> list[Preemption]:
    """The preemptions of ``request_id`` among log records (``LogRecord``s, or the exporter's
    ``LogData``), as log-based events (``preemption_events`` "log" or "both")."""
    out = []
    for record in records:
        record = getattr(record, "log_record", record)
        attrs = record.attributes or {}
        if attrs.get(REQUEST_ID) == request_id and "llm.preemption.ordinal" in attrs:
            out.append(
                Preemption(
                    attrs["llm.preemption.ordinal"],
                    attrs["llm.preemption.num_computed_tokens"],
                    attrs["llm.preemption.reason"],
                    record.timestamp,
                )
            )
    return sorted(out, key=lambda p: p.ordinal)
