"""Test helpers: build a telemetry on in-memory readers and read its data points by name."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_llm
from otel_llm import EngineTelemetry, TelemetryConfig
from otel_llm.events import EventType, RequestEvent, StepStats

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


# The telemetry's two paths, which tests run side by side: in-process aggregation with assembled
# spans, and the straightforward SDK path with Tracer-API spans.
FAST: dict[str, str] = {"metric_path": "in_process"}
SDK: dict[str, str] = {"metric_path": "sdk", "span_path": "tracer"}
BOTH_PATHS = pytest.mark.parametrize("paths", [FAST, SDK], ids=["fast", "sdk"])


def rig(config: Optional[TelemetryConfig] = None, *, metric_path: str = "auto", span_path: str = "auto",
        with_views: bool = True, delta: bool = False) -> Rig:
    config = config or TelemetryConfig(model_name="tiny")
    temporality = AggregationTemporality.DELTA if delta else AggregationTemporality.CUMULATIVE
    reader = InMemoryMetricReader(preferred_temporality={k: temporality for k in _INSTRUMENT_CLASSES})
    mp = MeterProvider(metric_readers=[reader], views=otel_llm.views(config) if with_views else ())
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    return Rig(EngineTelemetry(config, meter_provider=mp, tracer_provider=tp, metric_path=metric_path,
                               span_path=span_path), reader,
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


def workload(seed: int = 7) -> tuple[list[list[RequestEvent]], list[StepStats]]:
    """60 random request lifecycles (preemptions, errors) in batches, an unknown request's
    event, and 40 random steps: the equivalence tests' shared input."""
    rnd = random.Random(seed)
    batches = []
    for i in range(60):
        evs = lifecycle(f"r{i}", 10.0 + i * 0.37, preemptions=rnd.choice((0, 0, 0, 1, 2, 5, 12)),
                        tokens=rnd.randint(1, 40), prompt_tokens=rnd.randint(1, 3000),
                        max_tokens=rnd.choice((0, 64, 2048)), finish_reason=rnd.choice(("stop", "length", "abort", "error")))
        batches.append(evs)
    batches.append([RequestEvent(E.TOKENS, "ghost", 1.0, num_tokens=1)])
    steps = [StepStats(float(i), rnd.randint(0, 9), rnd.randint(0, 9), rnd.random(), rnd.randint(0, 5000))
             for i in range(40)]
    return batches, steps
