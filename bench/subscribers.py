"""The baselines that the telemetry is compared with, and the factories of every subscriber.

* :class:`CountingSubscriber` -- (a) the floor: ``stats[k] += 1`` per event, nothing else.
* :class:`PrometheusClientSubscriber` -- (b) what vLLM does: prometheus_client metrics with
  children bound once (``.labels(...)`` at start-up), ``inc``/``observe``/``set`` per
  observation, on a registry of its own. It derives the per-request values with the same
  :class:`otel_llm.core.tracker.Tracker` as the telemetry, so the comparison is about the metric path
  only; same metric set, same buckets (inter-token latency per token included).
* ``ours`` / ``naive`` -- :class:`otel_llm.EngineTelemetry` with the fast path (default on a
  provider built with ``otel_llm.views``) or ``metric_path="sdk", span_path="tracer"`` (one SDK
  record/add per observation).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from otel_llm._sdk.logs import LogRecordExporter, LogRecordExportResult
from otel_llm.catalogue import drops
from otel_llm.catalogue.metrics import BY_KEY, FINISH_OBSERVATIONS, METRICS, base_attributes, finish_values, label_key
from otel_llm.config.settings import TelemetryConfig
from otel_llm.core.tracker import RequestState, Tracker
from otel_llm.events import EventType, RequestEvent, StepStats
from otel_llm.summary import RequestSummary


class CountingSubscriber:
    """(a) The floor: a Python hook that only counts events by type."""

    def __init__(self) -> None:
        self.stats: dict[Any, int] = {k: 0 for k in EventType}
        self.steps = 0

    def on_events(self, events: Sequence[RequestEvent]) -> None:
        stats = self.stats
        for event in events:
            stats[event.type] += 1

    def on_step(self, stats: StepStats) -> None:
        self.steps += 1

    def shutdown(self) -> None:
        pass


class PrometheusClientSubscriber:
    """(b) vLLM-style: prometheus_client children bound once, one call per observation."""

    def __init__(
        self,
        config: TelemetryConfig,
        registry: Optional[CollectorRegistry] = None,
        families: Optional[dict[str, Any]] = None,
    ) -> None:
        """``families``: another instance's ``_families`` -- engines sharing one registry (vLLM's
        data-parallel ranks: one family per metric, an ``engine`` label per rank)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.lock = threading.Lock()
        labels = base_attributes(config)  # model_name, engine
        names = list(labels)
        values = [labels[k] for k in names]
        self._families: dict[str, Any] = {}
        bound: dict[str, Any] = {}
        for m in METRICS:
            name = m.name(config.naming).replace(".", "_")
            extra = [label_key(config, m.label).replace(".", "_")] if m.label else []
            if families is not None:
                family = self._families[m.key] = families[m.key]
                if not extra:
                    bound[m.key] = family.labels(*values)
                continue
            if m.kind == "counter":
                family = Counter(name, m.meaning, names + extra, registry=self.registry)
            elif m.kind == "gauge":
                family = Gauge(name, m.meaning, names + extra, registry=self.registry)
            else:
                family = Histogram(
                    name, m.meaning, names + extra, registry=self.registry, buckets=list(m.boundaries(config))
                )
            self._families[m.key] = family
            if not extra:
                bound[m.key] = family.labels(*values)
        self._values = values
        # Labelled children, bound on first use and cached (vLLM pre-binds per finish reason).
        self._by_reason: dict[str, Any] = {}
        self._by_finish: dict[str, Any] = {}
        self._by_drop: dict[str, Any] = {}
        b = bound
        self.c_preemptions, self.c_recomputed = b["num_preemptions"], b["num_recomputed_tokens"]
        self.c_prompt, self.c_generation = b["prompt_tokens"], b["generation_tokens"]
        self.g_running, self.g_waiting, self.g_kv = (
            b["num_requests_running"],
            b["num_requests_waiting"],
            b["kv_cache_usage_perc"],
        )
        self.h_ttft, self.h_itl = b["time_to_first_token_seconds"], b["inter_token_latency_seconds"]
        self.h_iteration = b["iteration_tokens_total"]
        self.h_request = {key: b[key] for key, _, _ in FINISH_OBSERVATIONS}
        self.tracker = Tracker(self, config.max_inflight_requests)

    def _child(self, cache: dict[str, Any], key: str, value: str) -> Any:
        child = cache.get(value)
        if child is None:
            child = cache[value] = self._families[key].labels(*self._values, value)
        return child

    # hook bus interface
    def on_events(self, events: Sequence[RequestEvent]) -> None:
        handle = self.tracker.handle
        with self.lock:
            for event in events:
                try:
                    handle(event)
                except Exception:  # noqa: BLE001 - as the telemetry: never into the engine
                    self.dropped(drops.INTERNAL_ERROR, event)

    def on_step(self, stats: StepStats) -> None:
        with self.lock:
            self.g_running.set(stats.num_running)
            self.g_waiting.set(stats.num_waiting)
            self.g_kv.set(stats.kv_cache_usage)
            if stats.num_batched_tokens is not None:
                self.h_iteration.observe(stats.num_batched_tokens)

    def shutdown(self) -> None:
        pass

    # TrackerSink
    def request_arrived(self, req: RequestState, event: RequestEvent) -> None:
        pass

    def request_scheduled(self, req: RequestState, ts: float, resumed: bool) -> None:
        pass

    def request_preempted(self, req: RequestState, event: RequestEvent, kind: str, causes: Any) -> None:
        self.c_preemptions.inc()
        self._child(self._by_reason, "num_preemptions_by_reason", event.reason).inc()
        self.c_recomputed.inc(event.num_computed_tokens)

    def first_token(self, req: RequestState, ts: float) -> None:
        self.h_ttft.observe(ts - req.arrival)
        self.c_prompt.inc(req.prompt_tokens)

    def tokens(self, n: int, itl: Optional[float], exemplar: Any, ctx: Any) -> None:
        self.c_generation.inc(n)
        if itl is not None:
            self.h_itl.observe(itl)

    def request_finished(self, req: RequestState, summary: RequestSummary, event: RequestEvent) -> None:
        self._child(self._by_finish, "request_success", summary.finish_reason).inc()
        h = self.h_request
        for key, value in finish_values(summary):
            h[key].observe(value)

    def request_evicted(self, req: RequestState) -> None:
        self.dropped(drops.EVICTED, req)

    def dropped(self, reason: str, event: Any) -> None:
        self._child(self._by_drop, "dropped_events", reason).inc()

    # sanity totals
    def totals(self) -> dict[str, float]:
        def value(key: str, suffix: str, labels: Optional[dict[str, str]] = None) -> float:
            total = 0.0
            for metric in self.registry.collect():
                for s in metric.samples:
                    if s.name == self._families[key]._name + suffix and (
                        labels is None or all(s.labels.get(k) == v for k, v in labels.items())
                    ):
                        total += s.value
            return total

        return {
            "finished": value("request_success", "_total"),
            "preemptions": value("num_preemptions", "_total"),
            "generation_tokens": value("generation_tokens", "_total"),
            "prompt_tokens": value("prompt_tokens", "_total"),
            "itl_count": value("inter_token_latency_seconds", "_count"),
            "itl_sum": value("inter_token_latency_seconds", "_sum"),
            "ttft_count": value("time_to_first_token_seconds", "_count"),
            "num_preemptions_hist_count": value("request_num_preemptions", "_count"),
            "num_preemptions_hist_sum": value("request_num_preemptions", "_sum"),
            "e2e_sum": value("e2e_request_latency_seconds", "_sum"),
        }


# --------------------------------------------------------------------------- OTel subscribers


class _NullSpanExporter(SpanExporter):
    """Span exporter that accepts and drops: measures the processor, not a network."""

    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


class _NullLogExporter(LogRecordExporter):
    """Log record exporter that accepts and drops: measures the processor, not a network."""

    def export(self, batch: Any) -> LogRecordExportResult:
        return LogRecordExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


@dataclass
class OtelSubscriber:
    """An EngineTelemetry with the providers and the in-memory reader it records into."""

    telemetry: Any
    meter_provider: Any
    reader: Any
    tracer_provider: Any = None
    logger_provider: Any = None

    def on_events(self, events: Sequence[RequestEvent]) -> None:
        self.telemetry.on_events(events)

    def on_step(self, stats: StepStats) -> None:
        self.telemetry.on_step(stats)

    def shutdown(self) -> None:
        self.telemetry.shutdown()
        self.meter_provider.shutdown()
        for provider in (self.tracer_provider, self.logger_provider):
            if provider is not None:
                provider.shutdown()

    def totals(self) -> dict[str, float]:
        data = self.reader.get_metrics_data()
        points: dict[str, list[Any]] = {}
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    points.setdefault(metric.name, []).extend(metric.data.data_points)

        def total(key: str, attr: str = "value") -> float:
            return float(sum(getattr(p, attr) for p in points.get(BY_KEY[key].name("vllm"), [])))

        return {
            "finished": total("request_success"),
            "preemptions": total("num_preemptions"),
            "generation_tokens": total("generation_tokens"),
            "prompt_tokens": total("prompt_tokens"),
            "itl_count": total("inter_token_latency_seconds", "count"),
            "itl_sum": total("inter_token_latency_seconds", "sum"),
            "ttft_count": total("time_to_first_token_seconds", "count"),
            "num_preemptions_hist_count": total("request_num_preemptions", "count"),
            "num_preemptions_hist_sum": total("request_num_preemptions", "sum"),
            "e2e_sum": total("e2e_request_latency_seconds", "sum"),
        }

    def collect_points(self) -> int:
        data = self.reader.get_metrics_data()
        return sum(
            len(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        )


def otel_subscriber(
    config: TelemetryConfig, *, metric_path: str = "auto", span_path: str = "auto", span_processor: str = "batch"
) -> OtelSubscriber:
    """EngineTelemetry on a fresh MeterProvider(views=otel_llm.views(config)) + InMemoryMetricReader;
    with log events on, a LoggerProvider with a BatchLogRecordProcessor to a null exporter."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    import otel_llm

    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader], views=otel_llm.views(config))
    tp = None
    if config.spans:
        tp = TracerProvider()
        processor = (
            BatchSpanProcessor(_NullSpanExporter(), max_queue_size=65536)
            if span_processor == "batch"
            else SimpleSpanProcessor(_NullSpanExporter())
        )
        tp.add_span_processor(processor)
    lp = None
    if config.log_events:
        from opentelemetry.sdk._logs import LoggerProvider
        from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

        lp = LoggerProvider(shutdown_on_exit=False)
        lp.add_log_record_processor(BatchLogRecordProcessor(_NullLogExporter(), max_queue_size=65536))
    telemetry = otel_llm.EngineTelemetry(
        config, meter_provider=mp, tracer_provider=tp, logger_provider=lp, metric_path=metric_path, span_path=span_path
    )
    return OtelSubscriber(telemetry, mp, reader, tp, lp)


Factory = Callable[[], Any]
