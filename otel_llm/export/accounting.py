"""What the export path loses, counted: spans and log records dropped by the batch processors or
in failed exports, metric points of failed exports. Onto ``otel_llm.dropped_events`` by reason.

The SDK reports these only as log lines (its ``otel.sdk.*`` self-metrics are off by default
and go to the global MeterProvider, which a plugin does not own), so the exporters and the
batch processor's drop hook are wrapped here (SDK internals: otel_llm._sdk.batch_processor and
.metric_exporter; where they do not hold, those losses go uncounted and the start-up warning says so).
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any, Optional, Sequence

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from otel_llm import _sdk
from otel_llm._sdk import batch_processor, metric_exporter
from otel_llm._sdk.logs import BatchLogRecordProcessor, LogRecordExporter, LogRecordExportResult
from otel_llm.catalogue.drops import (
    LOG_RECORDS_AFTER_SHUTDOWN,
    LOG_RECORDS_EXPORT_FAILED,
    LOG_RECORDS_QUEUE_FULL,
    METRIC_POINTS_EXPORT_FAILED,
    SPANS_AFTER_SHUTDOWN,
    SPANS_EXPORT_FAILED,
    SPANS_QUEUE_FULL,
)
from otel_llm.export.resilience import Backoff, export_bound, run_export, when_export_idle

if TYPE_CHECKING:
    from otel_llm.core.telemetry import EngineTelemetry

_log = logging.getLogger(__name__)


class ExportAccounting:
    """Counts what the export path lost, by reason, and what it delivered.

    Counted from any thread under a lock of its own; put onto ``otel_llm.dropped_events`` by
    :meth:`flush`, which the exporter threads call before each export (never the engine's
    thread: it may hold the telemetry's lock). ``dropped``/``exported`` are running totals.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.dropped: dict[str, int] = {}
        self.exported: dict[str, int] = {}
        self._pending: dict[str, int] = {}
        self._in_flight: dict[int, tuple[str, int]] = {}  # export -> (its failure reason, its items)
        self._exports = itertools.count()
        self.telemetry: Optional[EngineTelemetry] = None

    def drop(self, reason: str, n: int) -> None:
        if n > 0:
            with self._lock:
                self.dropped[reason] = self.dropped.get(reason, 0) + n
                self._pending[reason] = self._pending.get(reason, 0) + n

    def begin(self, failed: str, n: int) -> int:
        """An export of ``n`` items starts; its token for :meth:`settle`."""
        with self._lock:
            token = next(self._exports)
            self._in_flight[token] = (failed, n)
        return token

    def settle(self, token: int) -> bool:
        """The export ``token`` ended: False if :meth:`abandon_in_flight` has counted it lost already."""
        with self._lock:
            return self._in_flight.pop(token, None) is not None

    def abandon_in_flight(self) -> None:
        """At shutdown: the exports still running are counted lost, as they will be once the
        process exits (their threads are daemons); one that ends later counts nothing more."""
        with self._lock:
            in_flight, self._in_flight = self._in_flight, {}
        for failed, n in in_flight.values():
            self.drop(failed, n)

    def dropped_so_far(self) -> dict[str, int]:
        """A copy of ``dropped``: exports left running in the background may still add to it."""
        with self._lock:
            return dict(self.dropped)

    def delivered(self, kind: str, n: int) -> None:
        with self._lock:
            self.exported[kind] = self.exported.get(kind, 0) + n

    def flush(self) -> None:
        telemetry = self.telemetry
        if telemetry is None:
            return
        with self._lock:
            pending, self._pending = self._pending, {}
        for reason, n in pending.items():
            telemetry.count_dropped(reason, n)


class _ProcessorDrops:
    """Stands in for the SDK's BatchProcessor metrics hook, to count the items dropped after
    shutdown (``drop_items(1, "already_shutdown")``, called exactly then). Its queue-full call is
    not counted: it comes before the append, which evicts nothing if the export thread popped a
    batch in between; the queue counts its evictions itself (batch_processor.count_evictions)."""

    def __init__(self, inner: Any, accounting: ExportAccounting, after_shutdown: str) -> None:
        self._inner = inner
        self._accounting = accounting
        self._after_shutdown = after_shutdown

    def register_queue_size(self, get_queue_size: Any) -> None:
        self._inner.register_queue_size(get_queue_size)

    def drop_items(self, count: int, error_type: str = "queue_full") -> None:
        if error_type == "already_shutdown":
            self._accounting.drop(self._after_shutdown, count)
        self._inner.drop_items(count, error_type)

    def finish_items(self, count: int) -> None:
        self._inner.finish_items(count)


def _count_drops(processor: Any, accounting: ExportAccounting, queue_full: str, after_shutdown: str) -> None:
    if _sdk.holds("batch_processor"):
        batch_processor.wrap_drop_hook(processor, lambda hook: _ProcessorDrops(hook, accounting, after_shutdown))
        batch_processor.count_evictions(processor, lambda n: accounting.drop(queue_full, n))


def counting_processor(
    exporter: SpanExporter, accounting: ExportAccounting, bound_s: Optional[float] = None
) -> BatchSpanProcessor:
    """``bound_s``: wait at most that long for an export (:class:`ExportBound`); None: as long as it takes."""
    processor = BatchSpanProcessor(_CountingExporter(exporter, accounting, _SPANS, bound_s))
    _count_drops(processor, accounting, SPANS_QUEUE_FULL, SPANS_AFTER_SHUTDOWN)
    return processor


def counting_log_processor(
    exporter: LogRecordExporter, accounting: ExportAccounting, bound_s: Optional[float] = None
) -> BatchLogRecordProcessor:
    processor = BatchLogRecordProcessor(_CountingExporter(exporter, accounting, _LOG_RECORDS, bound_s))
    _count_drops(processor, accounting, LOG_RECORDS_QUEUE_FULL, LOG_RECORDS_AFTER_SHUTDOWN)
    return processor


class _Kind:
    """What a counting exporter exports: its name in ``delivered``, its failure reason, its results."""

    def __init__(self, name: str, failed: str, result: Any) -> None:
        self.name, self.failed, self.success, self.failure = name, failed, result.SUCCESS, result.FAILURE


_SPANS = _Kind("spans", SPANS_EXPORT_FAILED, SpanExportResult)


_LOG_RECORDS = _Kind("log_records", LOG_RECORDS_EXPORT_FAILED, LogRecordExportResult)


class _CountingExporter(SpanExporter, LogRecordExporter):
    """A span or log record exporter that counts what it delivers and loses (with Backoff)."""

    def __init__(self, exporter: Any, accounting: ExportAccounting, kind: _Kind, bound_s: Optional[float]) -> None:
        self._exporter = exporter
        self._accounting = accounting
        self._kind = kind
        self._backoff = Backoff()
        self._bound = export_bound(bound_s)

    def export(self, items: Sequence[Any]) -> Any:
        kind = self._kind
        self._accounting.flush()
        if self._backoff.closed():
            result = kind.failure
        else:
            token = self._accounting.begin(kind.failed, len(items))
            result = run_export(lambda: self._exporter.export(items), kind.failure, kind.name, self._bound)
            self._backoff.result(result is kind.success)
            if not self._accounting.settle(token):
                return result  # counted lost at shutdown
        if result is kind.success:
            self._accounting.delivered(kind.name, len(items))
        else:
            self._accounting.drop(kind.failed, len(items))
        return result

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        def stop() -> None:
            try:
                self._exporter.shutdown(timeout_millis=timeout_millis, **kwargs)
            except TypeError:
                self._exporter.shutdown()

        when_export_idle(self._bound, stop)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class CountingMetricExporter(MetricExporter):
    def __init__(self, exporter: MetricExporter, accounting: ExportAccounting, bound_s: Optional[float] = None) -> None:
        temporality, aggregation = metric_exporter.preferences(exporter)
        super().__init__(preferred_temporality=temporality, preferred_aggregation=aggregation)
        self._exporter = exporter
        self._accounting = accounting
        self._backoff = Backoff()
        self._bound = export_bound(bound_s)

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self._accounting.flush()
        points = sum(
            len(m.data.data_points)
            for rm in metrics_data.resource_metrics
            for sm in rm.scope_metrics
            for m in sm.metrics
        )
        if self._backoff.closed():
            result = MetricExportResult.FAILURE
        else:
            token = self._accounting.begin(METRIC_POINTS_EXPORT_FAILED, points)
            result = run_export(
                lambda: self._exporter.export(metrics_data, timeout_millis=timeout_millis, **kwargs),
                MetricExportResult.FAILURE,
                "metric",
                self._bound,
            )
            self._backoff.result(result is MetricExportResult.SUCCESS)
            if not self._accounting.settle(token):
                return result  # counted lost at shutdown
        if result is MetricExportResult.SUCCESS:
            self._accounting.delivered("metric_points", points)
        else:
            self._accounting.drop(METRIC_POINTS_EXPORT_FAILED, points)
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._exporter.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        when_export_idle(self._bound, lambda: self._exporter.shutdown(timeout_millis=timeout_millis, **kwargs))
