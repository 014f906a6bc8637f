"""The Prometheus endpoint: opentelemetry-exporter-prometheus, extended where it falls short.

``PrometheusEndpoint`` owns a ``CollectorRegistry`` and an HTTP server of its own, so that
inside vLLM (which serves prometheus_client's global ``REGISTRY`` at its own /metrics) the
``vllm:`` names of the ``vllm`` naming profile never collide with vLLM's.

What this module adds to the upstream ``PrometheusMetricReader``, and nothing more:

* exemplars: upstream drops ``HistogramDataPoint.exemplars`` (opentelemetry-python PR #4178).
  Here each histogram bucket carries the most recent exemplar whose value falls in it, with
  ``trace_id``/``span_id`` labels, value and timestamp. Only the OpenMetrics format can carry
  them; the classic text format is rendered by prometheus_client unchanged (no exemplars).
  The SDK's exemplar reservoirs reset on every collection, so a scrape would see an exemplar
  once and the next scrape (or a scrape in the other format) would lose it; we keep the last
  exemplar per (series, bucket), as prometheus_client's own histograms do. Bounded: only
  series present in the latest collection are kept.
* ``le`` label values are rendered as canonical floats (``floatToGoString``: ``0.5``, ``1.0``,
  ``+Inf``), the way prometheus_client (and so vLLM's own endpoint) renders them, whether the
  configured boundaries are ints or floats. Upstream renders ``f"{bound}"`` (``1`` or ``1.0``
  depending on the Python type), and Prometheus 2.x stores ``le`` verbatim: a rule on
  ``le="1.0"`` would silently match nothing.
* ``:`` in names survives OpenMetrics: prometheus_client 0.23-0.26
  ``openmetrics.exposition.generate_latest`` writes each *sample* name through
  ``_escape(s.name, escaping, _is_legacy_labelname_rune)`` -- the label-name rune set, which
  has no ``:`` -- under the default ``escaping=underscores``, while ``# HELP``/``# TYPE`` keep it
  (client_python #1177). So ``vllm:request_num_preemptions_bucket`` would arrive as
  ``vllm_request_num_preemptions_bucket``. With ``escaping=allow-utf-8`` the same function
  leaves every name that is a valid *legacy* metric name (``[a-zA-Z_:][a-zA-Z0-9_:]*``) as it
  is; every name the OTel exporter produces is one (``sanitize_full_name`` maps everything
  else to ``_``), so we call it that way, per call, with no global patching (vLLM's own
  /metrics is untouched). Label names are sanitized upstream to ``[a-zA-Z0-9_]`` and are legal
  in either mode.
* one scrape at a time: the upstream collector hands collected data through a deque
  (``collect`` -> ``_receive_metrics`` -> ``popleft``), so two concurrent scrapes can steal each
  other's data and one of them returns an empty body. The server serializes rendering.
"""

from __future__ import annotations

import bisect
import gzip
import inspect
import logging
import os
import selectors
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics.export import Histogram, HistogramDataPoint, Metric, MetricReader
from prometheus_client import CollectorRegistry
from prometheus_client import exposition as text_exposition
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.openmetrics import exposition as om_exposition
from prometheus_client.samples import Exemplar, Timestamp
from prometheus_client.utils import floatToGoString

from otel_llm import _sdk
from otel_llm._sdk import prometheus_exporter as sdk_prometheus

__all__ = ["PrometheusEndpoint", "ExemplarPrometheusMetricReader", "render"]

_logger = logging.getLogger(__name__)

OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Concurrent connections served at once; more are closed at accept (bounded threads).
_MAX_CONNECTIONS = 8
# Seconds a client may take to send its request (a stuck client must not hold a thread).
_REQUEST_TIMEOUT = 10.0


class _ExemplarCollector(sdk_prometheus.CustomCollector):
    """Upstream's collector, with exemplars on histogram buckets and canonical ``le``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._exemplar_lock = threading.Lock()
        # (family name, label values) -> per bucket the latest Exemplar (or None)
        self._last_exemplars: dict[tuple, list[Exemplar | None]] = {}
        self._seen: dict[tuple, list[Exemplar | None]] = {}

    def collect(self):
        # Materialized under the lock: a lock must not be held across a generator's yields.
        with self._exemplar_lock:
            self._seen = {}
            families = list(super().collect())
            # Keep only the series present in this collection: bounded by live series.
            if self._seen:
                self._last_exemplars = self._seen
        return iter(families)

    def _translate_metric(
        self,
        metric: Metric,
        scope_attrs: dict,
        resource_attrs: dict,
        metric_family_id_metric_family: dict,
    ) -> None:
        if not isinstance(metric.data, Histogram):
            super()._translate_metric(
                metric=metric,
                scope_attrs=scope_attrs,
                resource_attrs=resource_attrs,
                metric_family_id_metric_family=metric_family_id_metric_family,
            )
            return
        metric_name = self._resolve_metric_name(metric.name)
        description = metric.description or ""
        unit = sdk_prometheus.map_unit(metric.unit or "")  # type: ignore[misc]  # set when the prometheus contract holds
        label_keys, label_rows, _ = self._collect_data_points(metric.data, scope_attrs, resource_attrs)
        per_metric_family_id = "|".join((metric_name, description, unit))
        family = sdk_prometheus.get_or_create_family(  # type: ignore[misc]  # set when the prometheus contract holds
            metric_family_id_metric_family,
            "|".join([per_metric_family_id, HistogramMetricFamily.__name__]),
            HistogramMetricFamily,
            name=metric_name,
            documentation=description,
            labels=label_keys,
            unit=unit,
        )
        for point, label_values in zip(metric.data.data_points, label_rows):
            key = (family.name, tuple(label_keys), tuple(label_values))
            exemplars = self._bucket_exemplars(key, point)
            buckets: list[tuple[str, float] | tuple[str, float, Exemplar]] = []
            total = 0
            bounds = list(point.explicit_bounds) + [float("inf")]
            for i, (bound, count) in enumerate(zip(bounds, point.bucket_counts)):
                total += count
                le = floatToGoString(bound)
                exemplar = exemplars[i]
                if exemplar is not None:
                    buckets.append((le, total, exemplar))
                else:
                    buckets.append((le, total))
            family.add_metric(labels=label_values, buckets=buckets, sum_value=point.sum)

    def _bucket_exemplars(self, key: tuple, point: HistogramDataPoint) -> list[Exemplar | None]:
        nbuckets = len(point.explicit_bounds) + 1
        previous = self._last_exemplars.get(key)
        if previous is None or len(previous) != nbuckets:
            previous = [None] * nbuckets
        current = list(previous)
        newest: list[int] = [-1] * nbuckets
        for ex in point.exemplars or ():
            if not ex.trace_id or not ex.span_id:
                continue  # an exemplar without a trace links nothing
            index = bisect.bisect_left(point.explicit_bounds, ex.value)  # le is inclusive
            if ex.time_unix_nano < newest[index]:
                continue
            newest[index] = ex.time_unix_nano
            sec, nsec = divmod(int(ex.time_unix_nano), 1_000_000_000)
            current[index] = Exemplar(
                {"trace_id": format(ex.trace_id, "032x"), "span_id": format(ex.span_id, "016x")},
                ex.value,
                Timestamp(sec, nsec),
            )
        self._seen[key] = current
        return current


class _PullReader(PrometheusMetricReader):
    """A reader that scrapes collect. It has nothing to push, so a flush does not collect: the
    exporter's collector queues every collection for the next scrape, which would then serve the
    flush's samples beside its own (every series twice)."""

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True


class ExemplarPrometheusMetricReader(_PullReader):
    """``PrometheusMetricReader`` registering an exemplar-aware collector in a given registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        disable_target_info: bool = False,
        scope_info_enabled: bool = False,
        prefix: str = "",
        **kwargs: Any,
    ) -> None:
        # Upstream registers its own _CustomCollector in `registry`; build it in a throwaway
        # registry and put ours in its place in the real one.
        super().__init__(
            disable_target_info=disable_target_info,
            prefix=prefix,
            scope_info_enabled=scope_info_enabled,
            registry=CollectorRegistry(auto_describe=False),
            **kwargs,
        )
        sdk_prometheus.replace_collector(
            self,
            _ExemplarCollector(
                disable_target_info=disable_target_info,
                prefix=prefix,
                scope_info_enabled=scope_info_enabled,
                resource_attribute_filter=kwargs.get("resource_attribute_filter"),
            ),
        )
        self._registry = registry
        self._registry.register(sdk_prometheus.collector(self))
        self._unregistered = False

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        _unregister(self, self._registry)


class UpstreamPrometheusMetricReader(_PullReader):
    """The exporter's own reader and collector (no exemplars, ``le`` as the exporter writes it),
    registered in a given registry: where the exporter's internals that
    :class:`ExemplarPrometheusMetricReader` extends are not what it relies on."""

    def __init__(
        self, registry: CollectorRegistry, *, disable_target_info: bool = False, scope_info_enabled: bool = False
    ) -> None:
        if "registry" in sdk_prometheus.READER_PARAMETERS:
            super().__init__(
                disable_target_info=disable_target_info, scope_info_enabled=scope_info_enabled, registry=registry
            )
        else:  # before exporter 0.63b0: it registers in the global REGISTRY (and has no scope labels)
            super().__init__(disable_target_info=disable_target_info)
            sdk_prometheus.move_to(self, registry)
        self._registry = registry
        self._unregistered = False

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        _unregister(self, self._registry)


def _unregister(reader: Any, registry: CollectorRegistry) -> None:
    if reader._unregistered:
        return
    reader._unregistered = True
    try:
        registry.unregister(sdk_prometheus.collector(reader))
    except KeyError:
        pass


def _openmetrics_renderer() -> Callable[[CollectorRegistry], bytes]:
    params = inspect.signature(om_exposition.generate_latest).parameters
    if "escaping" in params and hasattr(om_exposition, "ALLOWUTF8"):
        return lambda registry: om_exposition.generate_latest(registry, escaping=om_exposition.ALLOWUTF8)
    return om_exposition.generate_latest  # before 0.23: no escaping, `:` kept


_render_openmetrics = _openmetrics_renderer()


def wants_openmetrics(accept: str | None) -> bool:
    for part in (accept or "").split(","):
        if part.split(";")[0].strip().lower() == "application/openmetrics-text":
            return True
    return False


def render(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """Body and content type for a scrape with this Accept header."""
    if wants_openmetrics(accept):
        return _render_openmetrics(registry), OPENMETRICS_CONTENT_TYPE
    return text_exposition.generate_latest(registry), TEXT_CONTENT_TYPE


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = False  # a taken port must fail, not be shared

    def __init__(self, address, handler, registry: CollectorRegistry) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.registry = registry
        self.render_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        super().__init__(address, handler)
        self.timeout = 0  # handle_request() after a select: never waits (a client gone since finds none)
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self._stopped = threading.Event()

    def serve(self) -> None:
        """Serves until :meth:`stop`, asleep between requests. socketserver's serve_forever wakes
        every poll interval to look for a shutdown request, and each wake-up takes the GIL from
        the engine's event loop; here a byte on a pipe wakes it."""
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self, selectors.EVENT_READ)
                selector.register(self._wake_r, selectors.EVENT_READ)
                while not self._stopping:
                    for key, _ in selector.select():
                        if key.fileobj is self and not self._stopping:
                            self.handle_request()
        finally:
            self._stopped.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stops :meth:`serve` (waiting for it up to ``timeout``) and closes the socket."""
        self._stopping = True
        os.write(self._wake_w, b"\0")
        self._stopped.wait(timeout)
        self.server_close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = _REQUEST_TIMEOUT  # HTTP/1.0: one request per connection, short-lived threads

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in ("/metrics", "/"):
            self._send(404, b"not found\n", "text/plain; charset=utf-8")
            return
        try:
            with self.server.render_lock:
                body, ctype = render(self.server.registry, self.headers.get("Accept"))
        except Exception:  # never kill the server thread over one scrape
            _logger.exception("otel_llm prometheus endpoint: rendering failed")
            self._send(500, b"rendering failed\n", "text/plain; charset=utf-8")
            return
        encoding = None
        if "gzip" in (self.headers.get("Accept-Encoding") or ""):
            body, encoding = gzip.compress(body, compresslevel=1), "gzip"
        self._send(200, body, ctype, encoding)

    def _send(self, code: int, body: bytes, ctype: str, encoding: str | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        if encoding:
            self.send_header("Content-Encoding", encoding)
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the scraper gave up (its timeout): nothing to answer, and no traceback on stderr

    def log_message(self, format: str, *args: Any) -> None:
        pass


class PrometheusEndpoint:
    """A /metrics endpoint on a registry and port of its own.

    ``reader`` exists right after construction (pass it in ``MeterProvider(metric_readers=...)``);
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
        self.registry = CollectorRegistry(auto_describe=False)
        reader = ExemplarPrometheusMetricReader if _sdk.holds("prometheus") else UpstreamPrometheusMetricReader
        self.reader: MetricReader = reader(
            self.registry,
            disable_target_info=disable_target_info,
            scope_info_enabled=scope_info_enabled,
        )
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

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
                    server = _Server((self.host.strip("[]"), port), _Handler, self.registry)
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
