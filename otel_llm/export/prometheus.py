"""The Prometheus endpoint: opentelemetry-exporter-prometheus, extended where it falls short.

``PrometheusEndpoint`` owns a ``CollectorRegistry`` and an HTTP server of its own, so that
inside vLLM (which serves prometheus_client's global ``REGISTRY`` at its own /metrics) the
``vllm:`` names of the ``vllm`` naming profile never collide with vLLM's.

What it adds to the upstream exporter, each in a module of its own: exemplars on histogram
buckets and canonical ``le`` values (:mod:`otel_llm.export.prometheus_reader`), ``:`` in names
kept in OpenMetrics (:mod:`otel_llm.export.prometheus_exposition`), one scrape at a time on a
thread that sleeps between requests (:mod:`otel_llm.export.prometheus_server`).
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Iterator

from opentelemetry.sdk.metrics.export import MetricReader
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from otel_llm import _sdk
from otel_llm.export.prometheus_exposition import render
from otel_llm.export.prometheus_reader import ExemplarPrometheusMetricReader, UpstreamPrometheusMetricReader
from otel_llm.export.prometheus_server import MetricsServer

__all__ = ["PrometheusEndpoint", "ExemplarPrometheusMetricReader", "render"]


class _MergingRegistry(CollectorRegistry):
    """A registry that yields each family once: the readers of several MeterProviders served on
    one endpoint (one per engine, each with a resource of its own) each collect every family,
    and an exposition that repeats a family is invalid. Their series differ by the ``engine``
    label; ``target_info`` then has one series per resource. A family is merged into a copy: a
    collector may yield the same family object at every collection (the exporter keeps its
    ``target_info``), which would otherwise grow by the others' series at each scrape."""

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        copied: set[str] = set()
        for family in super().collect():
            first = merged.setdefault(family.name, family)
            if first is family:
                continue
            if family.name not in copied:
                copied.add(family.name)
                first = merged[family.name] = copy.copy(first)
                first.samples = list(first.samples)
            first.samples.extend(family.samples)
        yield from merged.values()


class PrometheusEndpoint:
    """A /metrics endpoint on a registry and port of its own.

    ``reader`` exists right after construction (pass it in ``MeterProvider(metric_readers=...)``);
    :meth:`new_reader` gives another MeterProvider a reader of its own on the same endpoint;
    ``start()`` binds and serves in a daemon thread; ``shutdown()`` stops and unregisters.
    ``ports``: how many consecutive ports from ``port`` to try, the first free one taken (each
    engine process on a host then gets its own: ``port``, ``port + 1``, ...).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 9464,
        *,
        ports: int = 1,
        # The otel_scope_name/version/schema_url labels would double the output (and the time a
        # scrape holds the GIL: docs/architecture.md, "Cost facts") while carrying nothing: all
        # our instruments come from one scope. Off.
        scope_info_enabled: bool = False,
        # target_info is one series with the resource (service.name, ...), for joins: kept.
        disable_target_info: bool = False,
    ) -> None:
        self.host = host
        self.port = int(port)
        self.ports = int(ports)
        self.registry = _MergingRegistry(auto_describe=False)
        self._disable_target_info, self._scope_info_enabled = disable_target_info, scope_info_enabled
        self.reader: MetricReader = self.new_reader()
        self._server: MetricsServer | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    def new_reader(self) -> MetricReader:
        """A reader for one more MeterProvider, served on this endpoint (until it shuts down)."""
        reader = ExemplarPrometheusMetricReader if _sdk.holds("prometheus") else UpstreamPrometheusMetricReader
        return reader(
            self.registry, disable_target_info=self._disable_target_info, scope_info_enabled=self._scope_info_enabled
        )

    @property
    def url(self) -> str:
        host = self.host.strip("[]")
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("PrometheusEndpoint was shut down")
            if self._server is not None:
                return
            server = None
            candidates = [self.port] if self.port == 0 else list(range(self.port, min(self.port + self.ports, 65536)))
            for port in candidates:
                try:
                    server = MetricsServer((self.host.strip("[]"), port), self.registry)
                    break
                except OSError as exc:
                    error = exc
            if server is None:
                where = f"{self.host}:{self.port}" + (f"..{candidates[-1]}" if len(candidates) > 1 else "")
                raise OSError(
                    error.errno, f"otel_llm Prometheus endpoint cannot bind {where}: {error.strerror or error}"
                ) from error
            self._server = server
            self.port = server.server_address[1]
            self._thread = threading.Thread(
                target=server.serve,
                name=f"otel-llm-prometheus-{self.port}",
                daemon=True,
            )
            self._thread.start()

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """What a scrape would return, without HTTP (for tests and the CLI)."""
        if self._server is not None:
            with self._server.render_lock:
                return render(self.registry, accept)
        return render(self.registry, accept)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is not None:
            server.stop()
        if thread is not None:
            thread.join(timeout=5)
        self.reader.shutdown()

    def __enter__(self) -> "PrometheusEndpoint":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
