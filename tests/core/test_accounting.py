"""resilience.Backoff: while exports fail, later ones fail at once (counted, not sent) until a
probe; resilience.ExportBound: an export is waited for at most its bound.

The exporters here are stand-ins that fail or hang on demand: faults (a collector answering
errors at exactly chosen moments, an export that returns only when told) that a real collector
cannot be made to produce deterministically; the real collector outage is
tests/reliability/test_reliability_outage.py, a real hung collector
tests/reliability/test_reliability_lifecycle.py.
"""

from __future__ import annotations

import contextvars
import threading
from typing import cast

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_llm.catalogue.drops import SPANS_EXPORT_FAILED, SPANS_QUEUE_FULL
from otel_llm.export import accounting, resilience
from tests.support.sdk_versions import needs_sdk


class Flaky(SpanExporter):
    def __init__(self) -> None:
        self.ok = False
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        return SpanExportResult.SUCCESS if self.ok else SpanExportResult.FAILURE


def test_backoff_skips_exports_until_the_probe_and_counts_everything(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(resilience.time, "monotonic", lambda: now[0])
    acc = accounting.ExportAccounting()
    inner = Flaky()
    processor = accounting.counting_processor(inner, acc)
    # Its exporter: in its BatchProcessor (SDK 1.34+), its own before.
    exporter = (
        processor._batch_processor._exporter if hasattr(processor, "_batch_processor") else processor.span_exporter
    )
    batch = cast("list[ReadableSpan]", [object()] * 5)  # stand-ins for spans: counted, never read

    assert exporter.export(batch) is SpanExportResult.FAILURE and inner.calls == 1  # tried: fails
    now[0] += 0.5
    assert exporter.export(batch) is SpanExportResult.FAILURE and inner.calls == 1  # within 1 s: not sent
    now[0] += 0.6
    exporter.export(batch)  # 1.1 s: the probe, fails again -> next delay 2 s
    assert inner.calls == 2
    now[0] += 1.5
    exporter.export(batch)
    assert inner.calls == 2
    inner.ok = True
    now[0] += 0.6
    assert exporter.export(batch) is SpanExportResult.SUCCESS and inner.calls == 3  # probe succeeds
    assert exporter.export(batch) is SpanExportResult.SUCCESS and inner.calls == 4  # reset: sent at once
    assert acc.dropped == {SPANS_EXPORT_FAILED: 20}
    assert acc.exported == {"spans": 10}


def test_backoff_delay_doubles_up_to_its_cap(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(resilience.time, "monotonic", lambda: now[0])
    backoff = resilience.Backoff()
    delays = []
    for _ in range(6):
        backoff.result(False)
        delays.append(backoff._until - now[0])
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    backoff.result(True)
    assert not backoff.closed()


class _WorkerWinsTheRace:
    """The SDK's drop hook, behind accounting's: when the processor reports its queue full, the
    export thread pops a batch before the item is appended (what a busy machine lets happen)."""

    def __init__(self, inner, batch) -> None:
        self._inner, self._batch = inner, batch
        self.queue_full_reports = 0

    def register_queue_size(self, get_queue_size) -> None:
        self._inner.register_queue_size(get_queue_size)

    def finish_items(self, count) -> None:
        self._inner.finish_items(count)

    def drop_items(self, count, error_type="queue_full") -> None:
        if error_type == "queue_full":
            self.queue_full_reports += 1
            batch = self._batch
            batch._exporter.export([batch._queue.pop() for _ in range(batch._max_export_batch_size)])
        self._inner.drop_items(count, error_type)


@needs_sdk("1.41", "counting the spans a batch processor drops (its queue and drop hook)")
def test_spans_dropped_on_a_full_queue_are_counted_once_each_whatever_the_export_thread_does(monkeypatch):
    """Queue of 8, batches of 4, the export thread held off (its lock taken here). 12 spans:
    4 evicted. Then a queue found full whose export thread pops a batch before the append:
    nothing evicted, nothing counted lost. Every span is delivered or counted lost, once."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    acc = accounting.ExportAccounting()
    inner = InMemorySpanExporter()
    processor = accounting.counting_processor(inner, acc)
    batch = processor._batch_processor
    tp = TracerProvider()
    tp.add_span_processor(processor)
    tracer = tp.get_tracer("test")
    with batch._export_lock:
        for _ in range(12):
            tracer.start_span("s").end()
        assert acc.dropped == {SPANS_QUEUE_FULL: 4} and len(batch._queue) == 8
        drops = batch._metrics
        assert isinstance(drops, accounting._ProcessorDrops)  # accounting's hook, before the SDK's
        race = _WorkerWinsTheRace(drops._inner, batch)
        drops._inner = race
        tracer.start_span("s").end()
        assert race.queue_full_reports == 1  # the SDK reported it full: the batch went out in between
        assert acc.dropped == {SPANS_QUEUE_FULL: 4} and len(batch._queue) == 5
    tp.shutdown()
    assert acc.exported == {"spans": 9} == {"spans": len(inner.get_finished_spans())}
    assert acc.dropped == {SPANS_QUEUE_FULL: 4}


def test_an_export_past_its_bound_fails_and_the_next_ones_fail_at_once_until_it_ends():
    bound = resilience.ExportBound(0.2)
    failure, success = SpanExportResult.FAILURE, SpanExportResult.SUCCESS
    release, shut = threading.Event(), threading.Event()
    calls = []
    caller = contextvars.ContextVar("caller", default="none")
    caller.set("the batch processor's")

    def hung() -> SpanExportResult:
        calls.append(caller.get())  # run with the caller's context
        assert release.wait(60)
        return success

    def second() -> SpanExportResult:
        calls.append("second")
        return success

    assert bound.export(hung, failure) is failure  # still running after 0.2 s: counted failed
    assert bound.export(second, failure) is failure  # not even tried
    bound.when_idle(shut.set)  # an exporter's shutdown waits for the export still running
    assert calls == ["the batch processor's"] and not shut.is_set()
    release.set()
    assert shut.wait(60)
    assert bound.export(lambda: success, failure) is success  # idle again: exports go through
