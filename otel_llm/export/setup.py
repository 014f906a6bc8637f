"""setup_telemetry(): providers, readers and exporters from the config and the standard environment.

One function per signal, as the SDK's own configurator has: exporters chosen and every setting
checked first, then the meter, tracer and (for preemption log events) logger providers.
The providers are our own (never installed as the process globals): a plugin must not take
over the host application's OpenTelemetry setup.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from opentelemetry import trace
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import (
    AlwaysOffExemplarFilter,
    AlwaysOnExemplarFilter,
    MeterProvider,
    TraceBasedExemplarFilter,
)
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from otel_llm import _sdk
from otel_llm._sdk.logs import BatchLogRecordProcessor, ConsoleLogRecordExporter, LoggerProvider, NoOpLoggerProvider
from otel_llm.config.settings import DEFAULT_DEFER_STEPS, TelemetryConfig
from otel_llm.core.telemetry import EngineTelemetry
from otel_llm.export import env_checks, identity, otlp
from otel_llm.export import resource as resources
from otel_llm.export.accounting import (
    CountingMetricExporter,
    ExportAccounting,
    counting_log_processor,
    counting_processor,
)
from otel_llm.export.handle import TelemetryHandle
from otel_llm.recording.views import use_reader_views, views

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import ExemplarFilter

    from otel_llm.export.prometheus import PrometheusEndpoint

_log = logging.getLogger(__name__)

DEFAULT_PROMETHEUS_HOST = "127.0.0.1"
DEFAULT_PROMETHEUS_PORT = 9464
_EXEMPLAR_FILTERS: dict[str, Callable[[], ExemplarFilter]] = {
    "trace_based": TraceBasedExemplarFilter,
    "always_on": AlwaysOnExemplarFilter,
    "always_off": AlwaysOffExemplarFilter,
}
PORT_TAKEN = ("raise", "warn")


@dataclass(frozen=True)
class _Exporters:
    """The exporters chosen per signal (``OTEL_*_EXPORTER`` or the config)."""

    metrics: tuple[str, ...]
    traces: tuple[str, ...]
    logs: tuple[str, ...]

    @classmethod
    def of(cls, config: TelemetryConfig) -> "_Exporters":
        return cls(
            metrics=config.metrics_exporters or (("prometheus",) if config.prometheus_port is not None else ("otlp",)),
            traces=config.traces_exporters or ("otlp",),
            # Log records are only the preemption events: no LoggerProvider unless they are on.
            logs=(config.logs_exporters or ("otlp",)) if config.log_events else (),
        )


def without_prometheus(config: TelemetryConfig) -> TelemetryConfig:
    """``config`` with no Prometheus endpoint: for providers of another resource in a process
    whose endpoint could not bind its port (said once, there), so that they do not try again."""
    kept = tuple(e for e in _Exporters.of(config).metrics if e != "prometheus")
    return dataclasses.replace(config, metrics_exporters=kept or ("none",))


def setup_telemetry(
    config: Optional[TelemetryConfig] = None,
    *,
    extra_metric_readers: Sequence[MetricReader] = (),
    extra_span_processors: Sequence[SpanProcessor] = (),
    extra_views: Sequence[View] = (),
    environ: Optional[Mapping[str, str]] = None,
    port_taken: str = "raise",
    serve_on: Optional["PrometheusEndpoint"] = None,
    tenant_sources: Sequence[str] = (),
    entry_point: str = "this engine",
) -> TelemetryHandle:
    """Build providers, readers and exporters, and the engine's :class:`EngineTelemetry`.

    ``extra_views``: Views for instruments of your own on the same MeterProvider (the vLLM
    plugin's :class:`~otel_llm.integrations.vllm.series.series.VllmSeries` passes its own).

    Settings left ``None`` in ``config`` come from the standard ``OTEL_*`` variables.
    Raises ValueError (bad settings) at once, and OSError when the Prometheus port is taken —
    unless ``port_taken="warn"`` (what the entry points pass): then this process serves no
    /metrics, says so in one line, and its other exporters (OTLP metrics, traces) go on.

    ``serve_on``: a Prometheus endpoint another handle owns (providers of another resource in the
    same process): these metrics are served there, by a reader of their own, and no port is bound.

    ``tenant_sources``: the tenant sources (``otel_llm.config.tenants.KINDS``) the engine hands over
    per request (``RequestEvent.tenant_facts``); a tenant source (``OTEL_LLM_TENANT``) among none of
    them is refused with one warning naming ``entry_point`` (an engine that hands over none: every
    source refused).
    """
    if port_taken not in PORT_TAKEN:
        raise ValueError(f"port_taken: {port_taken!r} is not one of {PORT_TAKEN}")
    env = os.environ if environ is None else environ
    config = (config or TelemetryConfig.from_env(env)).with_env_defaults(env)
    if config.defer_steps is None:
        config = dataclasses.replace(config, defer_steps=DEFAULT_DEFER_STEPS)
    if config.sdk_disabled:
        return _disabled(config, extra_views)

    exporters = _Exporters.of(config)
    _check_exporter_settings(config, env, exporters)  # before anything binds a port or starts a thread
    resource = resources.resource(config)
    if resources.user_given_instance_id(config, env):  # the SDK's own per-process UUIDs are unique already
        identity.claim(str(resource.attributes["service.instance.id"]))
    accounting = ExportAccounting()
    prometheus = None if serve_on is not None else _prometheus_endpoint(config, exporters, port_taken)
    served_on: Optional[PrometheusEndpoint] = prometheus
    prometheus_reader: Optional[MetricReader] = prometheus.reader if prometheus is not None else None
    if serve_on is not None and "prometheus" in exporters.metrics:
        served_on, prometheus_reader = serve_on, serve_on.new_reader()
    meter_provider = _meter_provider(
        config, env, exporters, resource, accounting, prometheus_reader, extra_metric_readers, extra_views
    )
    tracer_provider = _tracer_provider(config, env, exporters, resource, accounting, extra_span_processors)
    logger_provider = _logger_provider(config, env, exporters, resource, accounting)

    telemetry = EngineTelemetry(
        config,
        meter_provider=meter_provider,
        tracer_provider=tracer_provider,
        logger_provider=logger_provider,
        metric_path="in_process" if _sdk.in_process_metrics(config.exponential) else "sdk",
        tenant_sources=tenant_sources,
        entry_point=entry_point,
    )
    config = telemetry.config  # without a tenant source that does not reach the engine
    accounting.telemetry = telemetry
    _log.info(
        "otel_llm telemetry: metrics=%s traces=%s logs=%s prometheus=%s settings=%s",
        exporters.metrics,
        exporters.traces,
        exporters.logs,
        served_on.url if served_on else None,
        config.redacted(),
    )
    handle = TelemetryHandle(
        config,
        telemetry,
        meter_provider,
        tracer_provider,
        prometheus,
        engines=[telemetry],
        accounting=accounting,
        extra_views=tuple(extra_views),
        logger_provider=logger_provider,
    )
    atexit.register(handle.shutdown)
    return handle


def _disabled(config: TelemetryConfig, extra_views: Sequence[View]) -> TelemetryHandle:
    """OTEL_SDK_DISABLED: the no-op providers, the telemetry's checks still on."""
    telemetry = EngineTelemetry(
        config,
        meter_provider=NoOpMeterProvider(),
        tracer_provider=trace.NoOpTracerProvider(),
        logger_provider=NoOpLoggerProvider(),
        metric_path="sdk",
        span_path="tracer",
    )
    return TelemetryHandle(config, telemetry, None, None, engines=[telemetry], extra_views=tuple(extra_views))


def _check_exporter_settings(config: TelemetryConfig, env: Mapping[str, str], exporters: _Exporters) -> None:
    protocols = {}
    for signal, names in (("metrics", exporters.metrics), ("traces", exporters.traces), ("logs", exporters.logs)):
        if "otlp" in names:
            protocols[signal] = otlp.protocol(config, env, signal)
            otlp.endpoint(config, env, signal, protocols[signal])
    env_checks.check(env, protocols)


def _prometheus_endpoint(
    config: TelemetryConfig, exporters: _Exporters, port_taken: str
) -> Optional["PrometheusEndpoint"]:
    if "prometheus" not in exporters.metrics:
        return None
    from otel_llm.export.prometheus import PrometheusEndpoint

    host = config.prometheus_host or DEFAULT_PROMETHEUS_HOST
    port = DEFAULT_PROMETHEUS_PORT if config.prometheus_port is None else config.prometheus_port
    endpoint = PrometheusEndpoint(host, port, ports=config.prometheus_ports)
    try:
        endpoint.start()
    except OSError as exc:
        if port_taken == "raise":
            raise
        _log.warning(
            "otel-llm: no /metrics endpoint in this process: %s:%s is taken (%s); OTEL_EXPORTER_PROMETHEUS_PORT "
            "picks another port, OTEL_LLM_PROMETHEUS_PORTS=N gives each process on a host a port of its own. %s",
            host,
            port,
            os.strerror(exc.errno) if exc.errno else exc,
            _still_exported(exporters),
        )
        return None
    return endpoint


def _still_exported(exporters: _Exporters) -> str:
    """What goes on without the Prometheus endpoint, in words."""
    metrics = [e for e in exporters.metrics if e not in ("prometheus", "none")]
    traces = [e for e in exporters.traces if e != "none"]
    going = [f"metrics to {', '.join(metrics)}"] * bool(metrics) + [f"traces to {', '.join(traces)}"] * bool(traces)
    return f"The rest goes on: {' and '.join(going)}" if going else "Nothing else is exported"


def _meter_provider(
    config: TelemetryConfig,
    env: Mapping[str, str],
    exporters: _Exporters,
    resource: Resource,
    accounting: ExportAccounting,
    prometheus_reader: Optional[MetricReader],
    extra_metric_readers: Sequence[MetricReader],
    extra_views: Sequence[View],
) -> MeterProvider:
    readers: list[MetricReader] = [prometheus_reader] if prometheus_reader is not None else []
    interval = config.metric_export_interval_ms or 60_000
    otlp_reader = None
    if "otlp" in exporters.metrics:
        exporter = otlp.exporter(config, env, "metrics")
        if _sdk.holds("metric_exporter"):
            exporter = CountingMetricExporter(exporter, accounting, _export_bound_s(config, env, "metrics"))
        otlp_reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval)
        readers.append(otlp_reader)
    if "console" in exporters.metrics:
        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(), export_interval_millis=interval))
    readers.extend(extra_metric_readers)

    filter_name = config.exemplar_filter or "trace_based"
    # The histogram-aggregation variable is OTLP's: the other readers (Prometheus, console) keep
    # explicit buckets, and the OTLP reader gets Views of its own.
    explicit = dataclasses.replace(config, histogram_aggregation=None)
    meter_provider = MeterProvider(
        metric_readers=readers,
        resource=resource,
        views=views(explicit) + list(extra_views),
        exemplar_filter=_EXEMPLAR_FILTERS[filter_name](),
        shutdown_on_exit=False,  # the handle's bounded shutdown runs at exit instead
    )
    if config.exponential and otlp_reader is not None:
        use_reader_views(meter_provider, otlp_reader, views(config) + list(extra_views))
    return meter_provider


def _tracer_provider(
    config: TelemetryConfig,
    env: Mapping[str, str],
    exporters: _Exporters,
    resource: Resource,
    accounting: ExportAccounting,
    extra_span_processors: Sequence[SpanProcessor],
) -> TracerProvider:
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    if "otlp" in exporters.traces:
        tracer_provider.add_span_processor(
            counting_processor(otlp.exporter(config, env, "traces"), accounting, _export_bound_s(config, env, "traces"))
        )
    if "console" in exporters.traces:
        tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    for processor in extra_span_processors:
        tracer_provider.add_span_processor(processor)
    return tracer_provider


def _logger_provider(
    config: TelemetryConfig,
    env: Mapping[str, str],
    exporters: _Exporters,
    resource: Resource,
    accounting: ExportAccounting,
) -> Optional[Any]:
    if not config.log_events:
        return None
    logger_provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
    if "otlp" in exporters.logs:
        logger_provider.add_log_record_processor(
            counting_log_processor(otlp.exporter(config, env, "logs"), accounting, _export_bound_s(config, env, "logs"))
        )
    if "console" in exporters.logs:
        logger_provider.add_log_record_processor(BatchLogRecordProcessor(ConsoleLogRecordExporter()))
    return logger_provider


def _export_bound_s(config: TelemetryConfig, env: Mapping[str, str], signal: str) -> Optional[float]:
    return otlp.export_bound_s(env, signal, otlp.protocol(config, env, signal))
