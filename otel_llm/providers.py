"""setup_telemetry(): providers, readers and exporters from the config and the standard environment.

The providers are our own (never installed as the process globals): a plugin must not take
over the host application's OpenTelemetry setup.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from opentelemetry import trace
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics._internal.exemplar import (
    AlwaysOffExemplarFilter,
    AlwaysOnExemplarFilter,
    TraceBasedExemplarFilter,
)
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult

from .config import TelemetryConfig
from .metrics import views
from .telemetry import EngineTelemetry
from .tracker import METRIC_POINTS_EXPORT_FAILED, SPANS_AFTER_SHUTDOWN, SPANS_EXPORT_FAILED, SPANS_QUEUE_FULL

_log = logging.getLogger(__name__)

DEFAULT_PROMETHEUS_HOST = "127.0.0.1"
DEFAULT_PROMETHEUS_PORT = 9464
DEFAULT_OTLP_PROTOCOL = "grpc"
_EXEMPLAR_FILTERS = {
    "trace_based": TraceBasedExemplarFilter,
    "always_on": AlwaysOnExemplarFilter,
    "always_off": AlwaysOffExemplarFilter,
}


@dataclass
class TelemetryHandle:
    """What :func:`setup_telemetry` built. ``shutdown()`` flushes everything; it is idempotent."""

    config: TelemetryConfig
    telemetry: EngineTelemetry
    meter_provider: Any
    tracer_provider: Any
    prometheus: Any = None  # otel_llm.prometheus.PrometheusEndpoint when serving /metrics
    engines: list[EngineTelemetry] = field(default_factory=list)
    accounting: Optional["ExportAccounting"] = None  # what the exporters lost (and delivered)
    _closed: bool = False

    @property
    def prometheus_port(self) -> Optional[int]:
        return self.prometheus.port if self.prometheus is not None else None

    def new_telemetry(self, **overrides: Any) -> EngineTelemetry:
        """Another engine's telemetry on the same providers, e.g. ``new_telemetry(engine="1")``."""
        telemetry = EngineTelemetry(dataclasses.replace(self.config, **overrides),
                                    meter_provider=self.meter_provider, tracer_provider=self.tracer_provider,
                                    fast_path=isinstance(self.meter_provider, MeterProvider))
        self.engines.append(telemetry)
        return telemetry

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        ok = True
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is self.meter_provider and self.accounting is not None:
                self.accounting.flush()  # span losses onto dropped_events before metrics go out
            flush = getattr(provider, "force_flush", None)
            if flush is not None:
                ok = bool(flush(timeout_millis)) and ok
        return ok

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for telemetry in self.engines:
            telemetry.shutdown()
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is self.meter_provider and self.accounting is not None:
                self.accounting.flush()
            stop = getattr(provider, "shutdown", None)
            if stop is not None:
                try:
                    stop()
                except Exception:  # noqa: BLE001 - a dead collector must not fail the host's shutdown
                    _log.warning("otel_llm: provider shutdown failed", exc_info=True)
        if self.prometheus is not None:
            self.prometheus.shutdown()


def setup_telemetry(config: Optional[TelemetryConfig] = None, *,
                    extra_metric_readers: Sequence[MetricReader] = (),
                    extra_span_processors: Sequence[SpanProcessor] = (),
                    environ: Optional[Mapping[str, str]] = None) -> TelemetryHandle:
    """Build providers, readers and exporters, and the engine's :class:`EngineTelemetry`.

    Settings left ``None`` in ``config`` come from the standard ``OTEL_*`` variables.
    Raises ValueError (bad settings) or OSError (Prometheus port taken) at once.
    """
    env = os.environ if environ is None else environ
    config = (config or TelemetryConfig.from_env(env)).with_env_defaults(env)
    if config.sdk_disabled:
        telemetry = EngineTelemetry(config, meter_provider=NoOpMeterProvider(),
                                    tracer_provider=trace.NoOpTracerProvider(), fast_path=False)
        return TelemetryHandle(config, telemetry, None, None, engines=[telemetry])

    resource = _resource(config)
    metrics_exporters = config.metrics_exporters or (("prometheus",) if config.prometheus_port is not None
                                                     else ("otlp",))
    traces_exporters = config.traces_exporters or ("otlp",)

    # Every exporter setting is checked before anything binds a port or starts a thread.
    for signal, names in (("metrics", metrics_exporters), ("traces", traces_exporters)):
        if "otlp" in names:
            _endpoint(config, env, signal, _protocol(config, env, signal))

    prometheus = None
    readers: list[MetricReader] = []
    if "prometheus" in metrics_exporters:
        from .prometheus import PrometheusEndpoint

        host = config.prometheus_host or DEFAULT_PROMETHEUS_HOST
        port = DEFAULT_PROMETHEUS_PORT if config.prometheus_port is None else config.prometheus_port
        prometheus = PrometheusEndpoint(host, port)
        prometheus.start()
        readers.append(prometheus.reader)
    interval = config.metric_export_interval_ms or 60_000
    accounting = ExportAccounting()
    if "otlp" in metrics_exporters:
        readers.append(PeriodicExportingMetricReader(_CountingMetricExporter(_otlp_metric_exporter(config, env),
                                                                             accounting),
                                                     export_interval_millis=interval))
    if "console" in metrics_exporters:
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(), export_interval_millis=interval))
    readers.extend(extra_metric_readers)

    filter_name = config.exemplar_filter or "trace_based"
    meter_provider = MeterProvider(metric_readers=readers, resource=resource, views=views(config),
                                   exemplar_filter=_EXEMPLAR_FILTERS[filter_name]())
    tracer_provider = TracerProvider(resource=resource)
    if "otlp" in traces_exporters:
        tracer_provider.add_span_processor(_counting_processor(_otlp_span_exporter(config, env), accounting))
    if "console" in traces_exporters:
        tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    for processor in extra_span_processors:
        tracer_provider.add_span_processor(processor)

    telemetry = EngineTelemetry(config, meter_provider=meter_provider, tracer_provider=tracer_provider,
                                fast_path=True)
    accounting.telemetry = telemetry
    _log.info("otel_llm telemetry: metrics=%s traces=%s prometheus=%s settings=%s", metrics_exporters,
              traces_exporters, prometheus.url if prometheus else None, config.redacted())
    return TelemetryHandle(config, telemetry, meter_provider, tracer_provider, prometheus, engines=[telemetry],
                           accounting=accounting)




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
        self.telemetry: Optional[EngineTelemetry] = None

    def drop(self, reason: str, n: int) -> None:
        if n > 0:
            with self._lock:
                self.dropped[reason] = self.dropped.get(reason, 0) + n
                self._pending[reason] = self._pending.get(reason, 0) + n

    def delivered(self, kind: str, n: int) -> None:
        with self._lock:
            self.exported[kind] = self.exported.get(kind, 0) + n

    def flush(self) -> None:
        telemetry = self.telemetry
        if telemetry is None:
            return
        with self._lock:
            pending, self._pending = self._pending, {}
        if pending:
            with telemetry._lock:
                for reason, n in pending.items():
                    for _ in range(n):
                        telemetry.metrics.dropped(reason)


class _ProcessorDrops:
    """Stands in for the SDK 1.45 BatchProcessor's metrics hook: ``drop_items`` is called
    exactly when a span is dropped (queue full, or after shutdown)."""

    def __init__(self, inner: Any, accounting: ExportAccounting) -> None:
        self._inner = inner
        self._accounting = accounting

    def register_queue_size(self, get_queue_size: Any) -> None:
        self._inner.register_queue_size(get_queue_size)

    def drop_items(self, count: int, error_type: str = "queue_full") -> None:
        self._accounting.drop(SPANS_AFTER_SHUTDOWN if error_type == "already_shutdown" else SPANS_QUEUE_FULL, count)
        self._inner.drop_items(count, error_type)

    def finish_items(self, count: int) -> None:
        self._inner.finish_items(count)


def _counting_processor(exporter: SpanExporter, accounting: ExportAccounting) -> BatchSpanProcessor:
    processor = BatchSpanProcessor(_CountingSpanExporter(exporter, accounting))
    batch = getattr(processor, "_batch_processor", None)  # SDK 1.45 internals (pinned)
    if batch is not None and hasattr(batch, "_metrics"):
        batch._metrics = _ProcessorDrops(batch._metrics, accounting)
    return processor


class _CountingSpanExporter(SpanExporter):
    def __init__(self, exporter: SpanExporter, accounting: ExportAccounting) -> None:
        self._exporter = exporter
        self._accounting = accounting

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        self._accounting.flush()
        try:
            result = self._exporter.export(spans)
        except Exception:  # noqa: BLE001 - counted, then as the SDK would: logged, batch lost
            _log.warning("otel_llm: span export raised", exc_info=True)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self._accounting.delivered("spans", len(spans))
        else:
            self._accounting.drop(SPANS_EXPORT_FAILED, len(spans))
        return result

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        try:
            self._exporter.shutdown(timeout_millis=timeout_millis, **kwargs)  # type: ignore[call-arg]
        except TypeError:
            self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class _CountingMetricExporter(MetricExporter):
    def __init__(self, exporter: MetricExporter, accounting: ExportAccounting) -> None:
        super().__init__(preferred_temporality=exporter._preferred_temporality,
                         preferred_aggregation=exporter._preferred_aggregation)
        self._exporter = exporter
        self._accounting = accounting

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        self._accounting.flush()
        try:
            result = self._exporter.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception:  # noqa: BLE001
            _log.warning("otel_llm: metric export raised", exc_info=True)
            result = MetricExportResult.FAILURE
        points = sum(len(m.data.data_points) for rm in metrics_data.resource_metrics for sm in rm.scope_metrics
                     for m in sm.metrics)
        if result is MetricExportResult.SUCCESS:
            self._accounting.delivered("metric_points", points)
        else:
            self._accounting.drop(METRIC_POINTS_EXPORT_FAILED, points)
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._exporter.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._exporter.shutdown(timeout_millis=timeout_millis, **kwargs)


def _resource(config: TelemetryConfig) -> Resource:
    # Resource.create() honours OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
    resource = Resource.create(dict(config.resource_attributes))
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "otel-llm"}))
    return resource


def _protocol(config: TelemetryConfig, env: Mapping[str, str], signal: str) -> str:
    var = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
    protocol = (env.get(var) or config.otlp_protocol or DEFAULT_OTLP_PROTOCOL).strip().lower()
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"{var}={protocol!r}: must be 'grpc' or 'http/protobuf'")
    return protocol


def _endpoint(config: TelemetryConfig, env: Mapping[str, str], signal: str, protocol: str) -> Optional[str]:
    """Per-signal endpoint as given; the base endpoint gets /v1/<signal> for HTTP (OTLP spec)."""
    var = f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
    specific = env.get(var)
    if specific:
        if not specific.startswith(("http://", "https://")) or not specific.split("://", 1)[1]:
            raise ValueError(f"{var}={specific!r}: must be an http:// or https:// URL, e.g. http://127.0.0.1:4317")
        endpoint, source = specific, var
    elif not config.otlp_endpoint:
        return None
    elif protocol == "http/protobuf":
        endpoint, source = config.otlp_endpoint.rstrip("/") + f"/v1/{signal}", "OTEL_EXPORTER_OTLP_ENDPOINT"
    else:
        endpoint, source = config.otlp_endpoint, "OTEL_EXPORTER_OTLP_ENDPOINT"
    scheme, _, rest = endpoint.partition("://")
    if protocol == "grpc" and "@" in rest.split("/", 1)[0]:
        # gRPC does not send URL credentials, and its exporter logs the endpoint on every failure.
        raise ValueError(f"{source}={scheme}://***@{rest.split('@', 1)[1]!s}: credentials in a gRPC endpoint URL "
                         "are not supported (they would be logged); pass them in OTEL_EXPORTER_OTLP_HEADERS")
    return endpoint


def _http_session() -> Any:
    """A requests Session that keeps the exporter's CA file (OTEL_EXPORTER_OTLP_[SIGNAL_]CERTIFICATE).

    requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE, when set in the environment (common in
    containers), override a Session's ``verify``: the certificate variable was then silently
    ignored and every export to a private-CA collector failed verification. None (the SDK's own
    session) when a credential provider plugin supplies the session.
    """
    if any(k.startswith("OTEL_PYTHON_EXPORTER_OTLP_HTTP") and k.endswith("CREDENTIAL_PROVIDER") for k in os.environ):
        return None
    import requests

    class _Session(requests.Session):
        def merge_environment_settings(self, url, proxies, stream, verify, cert):  # type: ignore[no-untyped-def]
            settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
            if verify is None and isinstance(self.verify, str):
                settings["verify"] = self.verify
            return settings

    return _Session()


def _otlp_metric_exporter(config: TelemetryConfig, env: Mapping[str, str]) -> Any:
    protocol = _protocol(config, env, "metrics")
    endpoint = _endpoint(config, env, "metrics", protocol)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter  # type: ignore

        return OTLPMetricExporter(endpoint=endpoint, session=_http_session())
    return OTLPMetricExporter(endpoint=endpoint)  # headers, TLS, compression, timeout, temporality: env


def _otlp_span_exporter(config: TelemetryConfig, env: Mapping[str, str]) -> Any:
    protocol = _protocol(config, env, "traces")
    endpoint = _endpoint(config, env, "traces", protocol)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore

        return OTLPSpanExporter(endpoint=endpoint, session=_http_session())
    return OTLPSpanExporter(endpoint=endpoint)
