"""accounting.Backoff: while exports fail, later ones fail at once (counted, not sent) until a probe.

The exporter here is a stand-in that fails on demand: a fault (a collector answering errors at
exactly chosen moments) that a real collector cannot be made to produce deterministically; the
real collector outage is tests/reliability/test_reliability_outage.py.
"""

from __future__ import annotations

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_llm import accounting
from otel_llm.tracker import SPANS_EXPORT_FAILED


class Flaky(SpanExporter):
    def __init__(self) -> None:
        self.ok = False
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        return SpanExportResult.SUCCESS if self.ok else SpanExportResult.FAILURE


def test_backoff_skips_exports_until_the_probe_and_counts_everything(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(accounting.time, "monotonic", lambda: now[0])
    acc = accounting.ExportAccounting()
    inner = Flaky()
    exporter = accounting.counting_processor(inner, acc)._batch_processor._exporter
    batch = [object()] * 5

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
    monkeypatch.setattr(accounting.time, "monotonic", lambda: now[0])
    backoff = accounting.Backoff()
    delays = []
    for _ in range(6):
        backoff.result(False)
        delays.append(backoff._until - now[0])
    assert delays == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    backoff.result(True)
    assert not backoff.closed()
