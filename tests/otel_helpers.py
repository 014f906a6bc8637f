"""Test helpers: build a telemetry on in-memory readers and read its data points by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_llm
from otel_llm import EngineTelemetry, TelemetryConfig
from otel_llm.events import EventType, RequestEvent

E = EventType


@dataclass
class Rig:
    telemetry: EngineTelemetry
    reader: InMemoryMetricReader
    span_exporter: InMemorySpanExporter
    meter_provider: MeterProvider

    @property
    def spans(self) -> InMemorySpanExporter:
        """The finished spans' exporter, after the pending event batches are applied
        (a metric collection applies them by itself)."""
        self.telemetry.flush()
        return self.span_exporter

    def metrics(self) -> dict[str, list[Any]]:
        return collect(self.reader)

    def point(self, name: str, **attrs: str) -> Any:
        matches = [p for p in self.metrics().get(name, []) if all(p.attributes.get(k) == v for k, v in attrs.items())]
        assert len(matches) == 1, f"{name} {attrs}: {len(matches)} points"
        return matches[0]


def rig(config: Optional[TelemetryConfig] = None, fast_path: Optional[bool] = None, with_views: bool = True,
        delta: bool = False) -> Rig:
    config = config or TelemetryConfig(model_name="tiny")
    temporality = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
    reader = InMemoryMetricReader(preferred_temporality={k: temporality for k in _INSTRUMENT_CLASSES})
    mp = MeterProvider(metric_readers=[reader], views=otel_llm.views(config) if with_views else ())
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    return Rig(EngineTelemetry(config, meter_provider=mp, tracer_provider=tp, fast_path=fast_path), reader,
               exporter, mp)


def assert_same_snapshots(fast: list[dict], sdk: list[dict], count: int) -> None:
    """The fast path's and the SDK path's collections, snapshot by snapshot and point by point."""
    assert len(fast) == len(sdk) == count
    for f, s in zip(fast, sdk):
        assert f.keys() == s.keys()
        for key in f:
            assert f[key] == s[key], key


def _instrument_classes() -> tuple[type, ...]:
    from opentelemetry.sdk.metrics import (Counter, Histogram, ObservableCounter, ObservableGauge,
                                           ObservableUpDownCounter, UpDownCounter, _Gauge)
    return (Counter, Histogram, ObservableCounter, ObservableGauge, ObservableUpDownCounter, UpDownCounter, _Gauge)


_INSTRUMENT_CLASSES = _instrument_classes()


def collect(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


def lifecycle(rid: str, t0: float, preemptions: int = 0, tokens: int = 3, prompt_tokens: int = 10,
              max_tokens: int = 16, finish_reason: str = "stop") -> list[RequestEvent]:
    """A complete, valid request: arrive, queue, schedule, k preempt/resume cycles, tokens, finish."""
    ev = [RequestEvent(E.ARRIVED, rid, t0, prompt_tokens=prompt_tokens, max_tokens=max_tokens),
          RequestEvent(E.QUEUED, rid, t0 + 0.001),
          RequestEvent(E.SCHEDULED, rid, t0 + 0.01)]
    t = t0 + 0.01
    for k in range(preemptions):
        ev.append(RequestEvent(E.PREEMPTED, rid, t + 0.002, num_computed_tokens=prompt_tokens + k,
                               reason="kv_cache_full"))
        ev.append(RequestEvent(E.SCHEDULED, rid, t + 0.005))
        t += 0.005
    ev.append(RequestEvent(E.FIRST_TOKEN, rid, t + 0.02))
    for k in range(tokens):
        ev.append(RequestEvent(E.TOKENS, rid, t + 0.02 + 0.03 * k, num_tokens=1))
    ev.append(RequestEvent(E.FINISHED, rid, t + 0.02 + 0.03 * max(tokens - 1, 0), finish_reason=finish_reason))
    return ev
