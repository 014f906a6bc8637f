"""setup_telemetry(): providers, readers and exporters from the config and the standard environment.

The providers are our own (never installed as the process globals): a plugin must not take
over the host application's OpenTelemetry setup.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
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
from otel_llm.export import env_checks as sdk_env
from otel_llm.export import identity, otlp
from otel_llm.export.accounting import (
    CountingMetricExporter,
    ExportAccounting,
    counting_log_processor,
    counting_processor,
)
from otel_llm.export.shutdown import run_bounded
from otel_llm.recording.views import use_reader_views, views

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import ExemplarFilter

_log = logging.getLogger(__name__)

DEFAULT_PROMETHEUS_HOST = "127.0.0.1"
DEFAULT_PROMETHEUS_PORT = 9464
# How long a shutdown waits for each stage of export (spans and log records, then metrics): the
# OTLP exporters' default timeout.
SHUTDOWN_TIMEOUT_MILLIS = 10_000
_EXEMPLAR_FILTERS: dict[str, Callable[[], ExemplarFilter]] = {
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
    prometheus: Any = None  # otel_llm.export.prometheus.PrometheusEndpoint when serving /metrics
    engines: list[EngineTelemetry] = field(default_factory=list)
    accounting: Optional["ExportAccounting"] = None  # what the exporters lost (and delivered)
    extra_views: tuple[View, ...] = ()  # Views given to setup_telemetry beside otel_llm.views(config)
    logger_provider: Any = None  # built when preemptions go out as log events (preemption_events)
    _closed: bool = False

    @property
    def prometheus_port(self) -> Optional[int]:
        return self.prometheus.port if self.prometheus is not None else None

    def new_telemetry(self, **overrides: Any) -> EngineTelemetry:
        """Another engine's telemetry on the same providers, e.g. ``new_telemetry(engine="1")``."""
        sdk = isinstance(self.meter_provider, MeterProvider)  # else disabled: the no-op providers
        in_process = sdk and _sdk.in_process_metrics(self.config.exponential)
        telemetry = EngineTelemetry(
            dataclasses.replace(self.config, **overrides),
            meter_provider=self.meter_provider,
            tracer_provider=self.tracer_provider,
            logger_provider=self.logger_provider,
            metric_path="in_process" if in_process else "sdk",
            span_path="auto" if sdk else "tracer",
        )
        self.engines.append(telemetry)
        return telemetry

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        """Export what is pending; False if an export failed or had not finished within
        ``timeout_millis`` (spans and log records, then metrics: each get that long)."""
        for telemetry in self.engines:
            telemetry.flush()  # pending events first: their spans and records
        return all(self._stages("force_flush", timeout_millis, timeout_millis))

    def shutdown(self, timeout_millis: int = SHUTDOWN_TIMEOUT_MILLIS) -> None:
        """Flush and stop everything; idempotent, and run at interpreter exit if not called.
        Spans and log records, then metrics, get at most ``timeout_millis`` each: an exporter
        still retrying then is left to finish in the background, with a warning."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        for telemetry in self.engines:
            telemetry.shutdown()
        self._stages("shutdown", timeout_millis)
        if self.prometheus is not None:
            self.prometheus.shutdown()

    def _stages(self, method: str, timeout_millis: int, *args: Any) -> list[Any]:
        """``method(*args)`` of the span and log record providers side by side, then of the
        meter provider, each stage bounded by ``timeout_millis``: the calls' results, False for
        one still running."""
        results = []
        for stage in ((self.tracer_provider, self.logger_provider), (self.meter_provider,)):
            if self.meter_provider in stage and self.accounting is not None:
                self.accounting.flush()  # span losses onto dropped_events before metrics go out
            calls = [
                (f"{type(p).__name__}.{method}", functools.partial(getattr(p, method), *args))
                for p in stage
                if hasattr(p, method)
            ]
            done = run_bounded(calls, timeout_millis / 1e3)
            results += [done.get(name, False) for name, _ in calls]
        return results


def setup_telemetry(
    config: Optional[TelemetryConfig] = None,
    *,
    extra_metric_readers: Sequence[MetricReader] = (),
    extra_span_processors: Sequence[SpanProcessor] = (),
    extra_views: Sequence[View] = (),
    environ: Optional[Mapping[str, str]] = None,
) -> TelemetryHandle:
    """Build providers, readers and exporters, and the engine's :class:`EngineTelemetry`.

    ``extra_views``: Views for instruments of your own on the same MeterProvider (the vLLM
    plugin's :class:`~otel_llm.integrations.vllm.series.VllmSeries` passes its own).

    Settings left ``None`` in ``config`` come from the standard ``OTEL_*`` variables.
    Raises ValueError (bad settings) or OSError (Prometheus port taken) at once.
    """
    env = os.environ if environ is None else environ
    config = (config or TelemetryConfig.from_env(env)).with_env_defaults(env)
    if config.defer_steps is None:
        config = dataclasses.replace(config, defer_steps=DEFAULT_DEFER_STEPS)
    if config.sdk_disabled:
        telemetry = EngineTelemetry(
            config,
            meter_provider=NoOpMeterProvider(),
            tracer_provider=trace.NoOpTracerProvider(),
            logger_provider=NoOpLoggerProvider(),
            metric_path="sdk",
            span_path="tracer",
        )
        return TelemetryHandle(config, telemetry, None, None, engines=[telemetry], extra_views=tuple(extra_views))

    resource = _resource(config)
    if _user_given_instance_id(config, env):  # the SDK's own per-process UUIDs are unique already
        identity.claim(str(resource.attributes["service.instance.id"]))
    metrics_exporters = config.metrics_exporters or (
        ("prometheus",) if config.prometheus_port is not None else ("otlp",)
    )
    traces_exporters = config.traces_exporters or ("otlp",)
    # Log records are only the preemption events: no LoggerProvider unless they are on.
    logs_exporters = (config.logs_exporters or ("otlp",)) if config.log_events else ()

    # Every exporter setting is checked before anything binds a port or starts a thread.
    protocols = {}
    for signal, names in (("metrics", metrics_exporters), ("traces", traces_exporters), ("logs", logs_exporters)):
        if "otlp" in names:
            protocols[signal] = otlp.protocol(config, env, signal)
            otlp.endpoint(config, env, signal, protocols[signal])
    sdk_env.check(env, protocols)

    prometheus = None
    readers: list[MetricReader] = []
    if "prometheus" in metrics_exporters:
        from otel_llm.export.prometheus import PrometheusEndpoint

        host = config.prometheus_host or DEFAULT_PROMETHEUS_HOST
        port = DEFAULT_PROMETHEUS_PORT if config.prometheus_port is None else config.prometheus_port
        prometheus = PrometheusEndpoint(host, port, ports=config.prometheus_ports)
        prometheus.start()
        readers.append(prometheus.reader)
    interval = config.metric_export_interval_ms or 60_000
    accounting = ExportAccounting()
    otlp_reader = None
    if "otlp" in metrics_exporters:
        exporter = otlp.exporter(config, env, "metrics")
        if _sdk.holds("metric_exporter"):
            exporter = CountingMetricExporter(exporter, accounting, _export_bound_s(config, env, "metrics"))
        otlp_reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval)
        readers.append(otlp_reader)
    if "console" in metrics_exporters:
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
    tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    if "otlp" in traces_exporters:
        tracer_provider.add_span_processor(
            counting_processor(otlp.exporter(config, env, "traces"), accounting, _export_bound_s(config, env, "traces"))
        )
    if "console" in traces_exporters:
        tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    for processor in extra_span_processors:
        tracer_provider.add_span_processor(processor)
    logger_provider = None
    if config.log_events:
        logger_provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
        if "otlp" in logs_exporters:
            logger_provider.add_log_record_processor(
                counting_log_processor(
                    otlp.exporter(config, env, "logs"), accounting, _export_bound_s(config, env, "logs")
                )
            )
        if "console" in logs_exporters:
            logger_provider.add_log_record_processor(BatchLogRecordProcessor(ConsoleLogRecordExporter()))

    telemetry = EngineTelemetry(
        config,
        meter_provider=meter_provider,
        tracer_provider=tracer_provider,
        logger_provider=logger_provider,
        metric_path="in_process" if _sdk.in_process_metrics(config.exponential) else "sdk",
    )
    accounting.telemetry = telemetry
    _log.info(
        "otel_llm telemetry: metrics=%s traces=%s logs=%s prometheus=%s settings=%s",
        metrics_exporters,
        traces_exporters,
        logs_exporters,
        prometheus.url if prometheus else None,
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


def _export_bound_s(config: TelemetryConfig, env: Mapping[str, str], signal: str) -> Optional[float]:
    return otlp.export_bound_s(env, signal, otlp.protocol(config, env, signal))


def _user_given_instance_id(config: TelemetryConfig, env: Mapping[str, str]) -> bool:
    pairs = (item.split("=", 1)[0].strip() for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","))
    return "service.instance.id" in config.resource_attributes or "service.instance.id" in pairs


def _resource(config: TelemetryConfig) -> Resource:
    # Resource.create() honours OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
    resource = Resource.create(dict(config.resource_attributes))
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "otel-llm"}))
    if "service.instance.id" not in resource.attributes:  # an SDK without the service_instance detector
        resource = resource.merge(Resource({"service.instance.id": _process_instance_id()}))
    return resource


_instance_lock = threading.Lock()
_instance_id: Optional[tuple[int, str]] = None


def _process_instance_id() -> str:
    """A UUID v4 for this process, a new one in a forked child (as the SDK's service_instance
    resource detector gives, where the SDK has it)."""
    global _instance_id
    with _instance_lock:
        if _instance_id is None or _instance_id[0] != os.getpid():
            _instance_id = (os.getpid(), str(uuid.uuid4()))
        return _instance_id[1]
