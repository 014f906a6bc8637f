"""TelemetryHandle: what :func:`~otel_llm.export.setup.setup_telemetry` built, and its bounded
flush and shutdown."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import View

from otel_llm import _sdk
from otel_llm.config.settings import TelemetryConfig
from otel_llm.core.telemetry import EngineTelemetry
from otel_llm.export.shutdown import run_bounded

if TYPE_CHECKING:
    from otel_llm.export.accounting import ExportAccounting

_log = logging.getLogger(__name__)

# How long a shutdown waits for each stage of export (spans and log records, then metrics): the
# OTLP exporters' default timeout.
SHUTDOWN_TIMEOUT_MILLIS = 10_000


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
        still retrying then is left to finish in the background, with a warning. What the export
        path lost since start-up is said in one line: its counter goes nowhere once we stop."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        for telemetry in self.engines:
            telemetry.shutdown()
        self._stages("shutdown", timeout_millis)
        if self.prometheus is not None:
            self.prometheus.shutdown()
        if self.accounting is None:
            return
        self.accounting.abandon_in_flight()
        lost = self.accounting.dropped_so_far()
        if lost:  # an error, as the SDK's own export failures: hosts that quieten warnings still show it
            _log.error(
                "otel_llm: not delivered since start-up (otel_llm.dropped_events by reason): %s",
                ", ".join(f"{reason}={n}" for reason, n in sorted(lost.items())),
            )

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
