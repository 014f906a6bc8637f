"""An EngineTelemetry on in-memory providers built with otel_llm's Views, and readers for what it
produced."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    MeterProvider,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Sampler

from otel_llm.config.settings import TelemetryConfig
from otel_llm.core.telemetry import EngineTelemetry
from otel_llm.recording.views import views
from otel_llm.testing import read
from otel_llm.testing.read import MetricsSnapshot, Preemption

# Every instrument kind whose temporality a reader chooses (a gauge's last value has none).
_INSTRUMENTS = (Counter, UpDownCounter, Histogram, ObservableCounter, ObservableUpDownCounter, ObservableGauge)


@dataclass
class InMemoryTelemetry:
    """An :class:`~otel_llm.EngineTelemetry` (``telemetry``: subscribe it to an engine's hook
    bus) whose metrics go to ``metric_reader``, spans to ``span_exporter`` and, when the config
    asks for preemption log events, log records to ``log_exporter``.

    The metric readings (:meth:`metrics`, :meth:`point`, :meth:`histogram`, :meth:`counter`) each
    collect the reader once; with ``delta`` temporality each collection holds only what was
    recorded since the previous one, so take one :meth:`metrics` snapshot and read from it. Span
    and log readings apply the telemetry's pending event batches first. Read before
    :meth:`shutdown`; it is idempotent, and a ``with`` block calls it.
    """

    telemetry: EngineTelemetry
    config: TelemetryConfig
    meter_provider: MeterProvider
    metric_reader: InMemoryMetricReader
    tracer_provider: TracerProvider
    span_exporter: InMemorySpanExporter
    delta: bool = False
    logger_provider: Optional[Any] = None
    log_exporter: Optional[Any] = None
    _closed: bool = field(default=False, repr=False)

    # -- metrics ------------------------------------------------------------------------

    def metrics(self) -> MetricsSnapshot:
        """One collection: every metric's points by exported name."""
        return read.collect_metrics(self.metric_reader, self.config.naming)

    def point(self, metric: str, attributes: Optional[Mapping[str, Any]] = None, /, **attrs: Any) -> Any:
        """The one data point of ``metric`` (key or name) with these attributes (one collection)."""
        return self.metrics().point(metric, attributes, **attrs)

    def histogram(self, metric: str, attributes: Optional[Mapping[str, Any]] = None, /, **attrs: Any) -> read.Histogram:
        """The explicit-bucket histogram of ``metric`` (key or name) with these attributes."""
        return self.metrics().histogram(metric, attributes, **attrs)

    def counter(self, metric: str, attributes: Optional[Mapping[str, Any]] = None, /, **attrs: Any) -> float:
        """The value of counter ``metric`` (key or name), summed over the points with these attributes."""
        return self.metrics().counter(metric, attributes, **attrs)

    # -- spans and log records ----------------------------------------------------------

    def finished_spans(self) -> tuple[ReadableSpan, ...]:
        """Every finished span, once the pending event batches are applied."""
        self.telemetry.flush()
        return self.span_exporter.get_finished_spans()

    def spans_by_request(self) -> dict[str, ReadableSpan]:
        """The finished request spans by request id (``gen_ai.request.id``)."""
        return read.spans_by_request(self.finished_spans())

    def span(self, request_id: str) -> ReadableSpan:
        """The finished span of ``request_id``; LookupError if it has none (yet)."""
        spans = self.spans_by_request()
        if request_id not in spans:
            raise LookupError(f"no finished span for request {request_id!r} ({len(spans)} request spans)")
        return spans[request_id]

    def preemptions(self, request_id: str) -> list[Preemption]:
        """The preemptions of ``request_id`` as its span's ``preempted`` events."""
        return read.span_preemptions(self.span(request_id))

    def log_records(self) -> list[Any]:
        """The log records emitted so far (the SDK's ``LogRecord``), once the pending batches are
        applied; [] when the config has no log events."""
        self.telemetry.flush()
        if self.log_exporter is None:
            return []
        return [data.log_record for data in self.log_exporter.get_finished_logs()]

    def log_preemptions(self, request_id: str) -> list[Preemption]:
        """The preemptions of ``request_id`` as log-based events (``preemption_events`` "log"/"both")."""
        return read.log_preemptions(self.log_records(), request_id)

    # -- teardown -----------------------------------------------------------------------

    def shutdown(self) -> None:
        """Shut the telemetry down (in-flight requests' spans end, marked incomplete), then the
        providers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.telemetry.shutdown()
        self.meter_provider.shutdown()
        self.tracer_provider.shutdown()
        if self.logger_provider is not None:
            self.logger_provider.shutdown()

    def __enter__(self) -> InMemoryTelemetry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def in_memory_telemetry(
    config: Optional[TelemetryConfig] = None,
    *,
    delta: bool = False,
    span_limits: Optional[SpanLimits] = None,
    sampler: Optional[Sampler] = None,
    metric_path: str = "auto",
    span_path: str = "auto",
    with_views: bool = True,
) -> InMemoryTelemetry:
    """An EngineTelemetry for ``config`` (default ``TelemetryConfig(model_name="tiny")``) on new
    in-memory providers: a MeterProvider with an InMemoryMetricReader (cumulative, or ``delta``
    temporality) and ``otel_llm.views(config)``; a TracerProvider (``span_limits`` and ``sampler``, else the
    SDK's) with an InMemorySpanExporter; when ``config.preemption_events`` is "log" or "both", a
    LoggerProvider with an in-memory log exporter. ``metric_path``/``span_path`` are
    EngineTelemetry's; ``with_views=False`` builds the MeterProvider without the Views (what a
    user who forgets them gets: SDK names and buckets, one warning)."""
    config = config or TelemetryConfig(model_name="tiny")
    temporality = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
    reader = InMemoryMetricReader(preferred_temporality={kind: temporality for kind in _INSTRUMENTS})
    meter_provider = MeterProvider(metric_readers=[reader], views=views(config) if with_views else ())
    span_exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider(span_limits=span_limits, sampler=sampler)
    tracer_provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    logger_provider, log_exporter = _in_memory_logs() if config.log_events else (None, None)
    telemetry = EngineTelemetry(
        config,
        meter_provider=meter_provider,
        tracer_provider=tracer_provider,
        logger_provider=logger_provider,
        metric_path=metric_path,
        span_path=span_path,
    )
    return InMemoryTelemetry(
        telemetry, config, meter_provider, reader, tracer_provider, span_exporter, delta, logger_provider, log_exporter
    )


def _in_memory_logs() -> tuple[Any, Any]:
    from otel_llm._sdk.logs import InMemoryLogRecordExporter, LoggerProvider, SimpleLogRecordProcessor

    exporter = InMemoryLogRecordExporter()
    provider = LoggerProvider()
    provider.add_log_record_processor(SimpleLogRecordProcessor(exporter))
    return provider, exporter
