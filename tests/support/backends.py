"""Start real components for tests: Prometheus, rotel (OTLP collector), an OTLP sink.

Everything binds 127.0.0.1 on ports chosen here; every wait has a deadline; every process is
killed by the context manager that started it. ``require_backend`` turns "cannot start" into a
skip, or into a failure under ``OTEL_LLM_REQUIRE_BACKENDS=1`` (CI).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

from otel_llm.stack import prometheus as stack_prometheus
from otel_llm.stack.ports import LOOPBACK, free_port


class BackendUnavailable(RuntimeError):
    """A component could not be started (not installed, did not become ready)."""


def backends_required() -> bool:
    return os.environ.get("OTEL_LLM_REQUIRE_BACKENDS", "") not in ("", "0", "false", "no")


def require_backend(name: str, reason: str) -> None:
    """Give up on a test whose backend cannot start: fail in CI, skip elsewhere."""
    message = f"backend {name} unavailable: {reason}"
    if backends_required():
        pytest.fail(message + " (OTEL_LLM_REQUIRE_BACKENDS=1)", pytrace=False)
    pytest.skip(message)


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Wrap the start of a component: BackendUnavailable becomes require_backend()."""
    try:
        yield
    except BackendUnavailable as exc:
        require_backend(name, str(exc))


def free_port_block(count: int, avoid: tuple[int, ...] = ()) -> int:
    """The first of ``count`` consecutive ports, all free on 127.0.0.1 now.

    Picked below the kernel's ephemeral range: a port from ``free_port()`` lies inside it, so
    the port after it (or the port itself, once released) can go to any outgoing connection
    meanwhile, such as Prometheus's own scrapes.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        base = random.randrange(max(1024, low // 2), low - count)
        if any(abs(base - other) < count for other in avoid):
            continue
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    s.bind((LOOPBACK, port))
            except OSError:
                continue
        return base
    raise BackendUnavailable(f"no {count} consecutive free ports below {low}")


def wait_until(predicate: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns a truthy value; TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
            last_exc = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else "")
            )
        time.sleep(interval)


def port_open(port: int, host: str = LOOPBACK) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def silent_collector() -> Iterator[str]:
    """The endpoint of a hung collector: a socket that listens and never reads nor answers (the
    kernel completes each connection's handshake; the exporter then waits for a reply)."""
    with socket.create_server((LOOPBACK, 0), backlog=64) as server:
        yield f"http://{LOOPBACK}:{server.getsockname()[1]}"


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _start_on_free_ports(
    launch: Callable[[], tuple[Any, Callable[[], bool], Callable[[], str]]], ready_timeout: float, what: str
) -> Any:
    """Start a server on ports picked by free_port() and wait until it is ready.

    ``launch()`` starts it and returns (handle with ``.proc``, ready check, log tail). free_port()
    can race with another process: a server that exits because its port was taken in between is
    started again on other ports (3 attempts). A failed attempt's process is always killed.
    """
    for attempt in range(3):
        handle, ready, log = launch()
        proc = handle.proc

        def check(proc: Any = proc, log: Callable[[], str] = log, ready: Callable[[], bool] = ready) -> bool:
            if proc.poll() is not None:
                raise BackendUnavailable(f"{what}: exited with {proc.returncode}: {log()}")
            return ready()

        try:
            wait_until(check, ready_timeout, interval=0.05, what=what)
            return handle
        except BackendUnavailable as exc:
            _kill(proc)
            if "in use" in str(exc).lower() and attempt < 2:
                continue
            raise
        except TimeoutError as exc:
            _kill(proc)
            raise BackendUnavailable(f"{exc}: {log()}") from None


# --------------------------------------------------------------------------------- Prometheus


def prometheus_binary() -> str | None:
    return shutil.which("prometheus") or (
        str(Path("/usr/bin/prometheus")) if Path("/usr/bin/prometheus").exists() else None
    )


class Prometheus(stack_prometheus.Prometheus):
    """The stack's Prometheus with what tests ask of it: a PromQL error as an assertion, one value,
    a wait for a result, the targets and the series names."""

    def query(self, expr: str) -> list[dict]:
        """Instant query; the ``data.result`` list. Raises on a PromQL error."""
        try:
            return super().query(expr)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"PromQL {expr!r} failed: {exc.read().decode(errors='replace')}") from exc
        except RuntimeError as exc:  # answered, with a status other than success
            raise AssertionError(f"PromQL {expr!r}: {exc}") from exc

    def value(self, expr: str) -> float | None:
        """The single value of an instant vector/scalar query, None when empty."""
        result = self.query(expr)
        if not result:
            return None
        if isinstance(result, list) and len(result) != 1:
            raise AssertionError(f"{expr!r} returned {len(result)} series: {result}")
        return float(result[0]["value"][1])

    def wait_for(self, expr: str, predicate: Callable[[list[dict]], object], timeout: float = 15) -> list[dict]:
        """The query's result once ``predicate`` finds it true (any truthy value)."""
        holder: dict[str, list[dict]] = {}

        def check() -> bool:
            holder["r"] = self.query(expr)
            return bool(predicate(holder["r"]))

        try:
            wait_until(check, timeout, interval=0.2, what=f"PromQL {expr!r}")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; last result: {holder.get('r')}; targets: {self.targets()}") from None
        return holder["r"]

    def targets(self) -> list[dict]:
        try:
            return self.get("/api/v1/targets", {})["activeTargets"]
        except Exception as exc:  # noqa: BLE001 - diagnostics only
            return [{"error": repr(exc)}]

    def series_names(self) -> list[str]:
        return self.get("/api/v1/label/__name__/values", {})


@contextlib.contextmanager
def start_prometheus(
    scrape_targets: list[str],
    scrape_interval: str = "1s",
    ready_timeout: float = 15.0,
    exemplars: bool = True,
    rule_files: tuple[Path, ...] = (),
) -> Iterator[Prometheus]:
    """A Prometheus scraping ``scrape_targets`` (``host:port`` or metrics URLs) every interval,
    evaluating ``rule_files`` at the same interval: the stack's, stopped on exit.

    Raises BackendUnavailable when the binary is missing or it does not become ready.
    """
    with contextlib.ExitStack() as started:
        try:
            server = started.enter_context(
                stack_prometheus.start_prometheus(
                    *scrape_targets,
                    scrape_interval=scrape_interval,
                    ready_timeout_s=ready_timeout,
                    exemplars=exemplars,
                    rule_files=rule_files,
                )
            )
        except stack_prometheus.PrometheusUnavailable as exc:
            raise BackendUnavailable(str(exc)) from None
        yield Prometheus(server.url, server.proc, server.log_path)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' (2.x) histogram_quantile on cumulative (le, count) buckets, +Inf last.

    Linear interpolation inside the bucket holding rank q*count, from the previous bound (0
    for the first bucket when its bound is positive); in the +Inf bucket the answer is the
    highest finite bound.
    """
    buckets = sorted(buckets)
    if len(buckets) < 2 or buckets[-1][0] != float("inf"):
        return float("nan")
    total = buckets[-1][1]
    if total == 0:
        return float("nan")
    rank = q * total
    index = next(i for i, (_, c) in enumerate(buckets) if c >= rank)
    if index == len(buckets) - 1:
        return buckets[-2][0]
    if index == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    bucket_start = 0.0
    bucket_end = buckets[index][0]
    count = buckets[index][1]
    if index > 0:
        bucket_start = buckets[index - 1][0]
        count -= buckets[index - 1][1]
        rank -= buckets[index - 1][1]
    return bucket_start + (bucket_end - bucket_start) * (rank / count)


# --------------------------------------------------------------------------------- rotel

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def rotel_binary() -> str | None:
    try:
        import rotel  # noqa: F401 - only to locate the package
    except ImportError:
        return None
    module_file = sys.modules["rotel"].__file__
    if module_file is None:  # a namespace package: no rotel-agent beside it
        return None
    path = Path(module_file).parent / "rotel-agent"
    return str(path) if path.exists() and os.access(path, os.X_OK) else None


class Rotel:
    def __init__(self, proc: subprocess.Popen, grpc_port: int, http_port: int, workdir: Path) -> None:
        self.proc = proc
        self.grpc_port = grpc_port
        self.http_port = http_port
        self.workdir = workdir
        self.grpc_endpoint = f"http://{LOOPBACK}:{grpc_port}"
        self.http_endpoint = f"http://{LOOPBACK}:{http_port}"

    def endpoint(self, protocol: str) -> str:
        return self.grpc_endpoint if protocol == "grpc" else self.http_endpoint

    def output(self) -> str:
        """Everything rotel printed (stdout, stderr, its log file), ANSI codes stripped."""
        text = _tail(self.workdir / "stdout.log", 10_000_000) + _tail(self.workdir / "rotel.log", 10_000_000)
        return _ANSI.sub("", text)


@contextlib.contextmanager
def start_rotel(
    forward_to: str | None = None,
    forward_protocol: str = "grpc",
    debug_log: tuple[str, ...] = (),
    verbosity: str = "detailed",
    ready_timeout: float = 15.0,
    extra_args: tuple[str, ...] = (),
) -> Iterator[Rotel]:
    """rotel-agent with OTLP gRPC and HTTP receivers on free loopback ports.

    ``forward_to``: an OTLP endpoint for ``--exporter otlp`` (``forward_protocol`` grpc|http;
    rotel's HTTP exporter gzips). Without it, data goes to the blackhole exporter.
    ``debug_log``: e.g. ("traces", "metrics") to print what arrived (``Rotel.output()``).
    """
    binary = rotel_binary()
    if binary is None:
        raise BackendUnavailable("rotel-agent not found (pip install rotel)")
    workdir = Path(tempfile.mkdtemp(prefix="otel-llm-rotel-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ROTEL_", "OTEL_"))}
    out = open(workdir / "stdout.log", "wb")

    def launch() -> tuple[Rotel, Callable[[], bool], Callable[[], str]]:
        grpc_port, http_port = free_port(), free_port()
        while http_port == grpc_port:
            http_port = free_port()
        args = [
            binary,
            "start",
            f"--otlp-grpc-endpoint={LOOPBACK}:{grpc_port}",
            f"--otlp-http-endpoint={LOOPBACK}:{http_port}",
            f"--pid-file={workdir / 'rotel.pid'}",
            f"--log-file={workdir / 'rotel.log'}",
            "--batch-timeout=50ms",
        ]
        if forward_to:
            args += [
                "--exporter=otlp",
                f"--otlp-exporter-endpoint={forward_to}",
                f"--otlp-exporter-protocol={forward_protocol}",
            ]
        else:
            args += ["--exporter=blackhole"]
        for signal in debug_log:
            args.append(f"--debug-log={signal}")
        if debug_log:
            args.append(f"--debug-log-verbosity={verbosity}")
        args += list(extra_args)
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir, env=env
        )
        handle = Rotel(proc, grpc_port, http_port, workdir)
        return handle, lambda: port_open(grpc_port) and port_open(http_port), lambda: handle.output()[-2000:]

    handle = None
    try:
        handle = _start_on_free_ports(launch, ready_timeout, "rotel receivers")
        yield handle
    finally:
        if handle is not None:
            _kill(handle.proc)
        out.close()
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------------- OTLP sink


class OtlpSink:
    """Decoded OTLP requests received by a sink (oteltest's servicers / HttpSink), thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.metrics: list[Any] = []  # ExportMetricsServiceRequest
        self.traces: list[Any] = []  # ExportTraceServiceRequest
        self.logs: list[Any] = []
        self.headers: list[dict] = []
        self.port = 0
        self.protocol = ""
        self.scheme = "http"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://{LOOPBACK}:{self.port}"

    # oteltest RequestHandler interface
    def handle_metrics(self, request: Any, headers: Any) -> None:
        with self.lock:
            self.metrics.append(request)
            self.headers.append(dict(headers) if isinstance(headers, dict) else {})

    def handle_trace(self, request: Any, headers: Any) -> None:
        with self.lock:
            self.traces.append(request)

    def handle_logs(self, request: Any, headers: Any) -> None:
        with self.lock:
            self.logs.append(request)

    def spans(self, service: Optional[str] = None) -> list[Any]:
        """Every span received; only those of ``service`` (its resource's ``service.name``) if given."""
        with self.lock:
            return [
                s
                for req in self.traces
                for rs in req.resource_spans
                if service is None
                or any(a.key == "service.name" and a.value.string_value == service for a in rs.resource.attributes)
                for ss in rs.scope_spans
                for s in ss.spans
            ]

    def metric_points(self, name: str) -> list[tuple[Any, Any]]:
        """(metric, data point) pairs for every received metric named ``name``, in arrival order."""
        out = []
        with self.lock:
            for req in self.metrics:
                for rm in req.resource_metrics:
                    for sm in rm.scope_metrics:
                        for m in sm.metrics:
                            if m.name == name:
                                kind = m.WhichOneof("data")
                                for p in getattr(m, kind).data_points:
                                    out.append((m, p))
        return out

    def metric_names(self) -> set[str]:
        with self.lock:
            return {
                m.name
                for req in self.metrics
                for rm in req.resource_metrics
                for sm in rm.scope_metrics
                for m in sm.metrics
            }


@contextlib.contextmanager
def start_otlp_sink(protocol: str = "grpc", tls: Optional[tuple[Path, Path]] = None) -> Iterator[OtlpSink]:
    """An OTLP receiver on 127.0.0.1 decoding into protobufs, built from oteltest's pieces.

    ``tls``: (certificate, key) PEM files; the gRPC sink then serves TLS only (https endpoint).

    oteltest's GrpcSink/HttpSink bind 0.0.0.0 (and HttpSink cannot read gzip bodies, which
    rotel's HTTP exporter always sends): the gRPC sink uses oteltest's servicers on our own
    loopback server; the HTTP sink is an HttpSink with a loopback, gzip-aware server.
    """
    try:
        import grpc
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2_grpc
        from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
        from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        from oteltest.sink import HttpSink, _parse_request
        from oteltest.sink.private import _LogsServiceServicer, _MetricsServiceServicer, _TraceServiceServicer
    except ImportError as exc:
        raise BackendUnavailable(f"oteltest/grpc not importable: {exc}") from exc

    if tls is not None and protocol != "grpc":
        raise ValueError("tls: only the gRPC sink serves TLS (test_reliability_security has a TLS HTTP receiver)")
    sink = OtlpSink()
    sink.protocol = protocol
    if protocol == "grpc":
        from concurrent import futures

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceServiceServicer(sink.handle_trace), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
            _MetricsServiceServicer(sink.handle_metrics), server
        )
        logs_service_pb2_grpc.add_LogsServiceServicer_to_server(_LogsServiceServicer(sink.handle_logs), server)
        if tls is None:
            sink.port = server.add_insecure_port(f"{LOOPBACK}:0")
        else:
            cert, key = tls
            credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
            sink.port = server.add_secure_port(f"{LOOPBACK}:0", credentials)
            sink.scheme = "https"
        if not sink.port:
            raise BackendUnavailable("grpc sink could not bind 127.0.0.1")
        server.start()
        try:
            yield sink
        finally:
            server.stop(grace=None)
        return

    classes: dict[str, tuple[type[Any], Callable[[Any, Any], None]]] = {
        "/v1/traces": (ExportTraceServiceRequest, sink.handle_trace),
        "/v1/metrics": (ExportMetricsServiceRequest, sink.handle_metrics),
        "/v1/logs": (ExportLogsServiceRequest, sink.handle_logs),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if (self.headers.get("Content-Encoding") or "").lower() == "gzip":
                body = gzip.decompress(body)
            target = classes.get(self.path.split("?", 1)[0])
            if target is None:
                self.send_response(404)
                self.end_headers()
                return
            request_class, handle = target
            handle(_parse_request(body, dict(self.headers.items()), request_class), dict(self.headers.items()))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    class LoopbackHttpSink(HttpSink):
        def run_server(self) -> None:
            self.httpd.serve_forever(poll_interval=0.1)

    import logging

    http = LoopbackHttpSink(sink, logging.getLogger("otlp-sink"), port=0)
    http.httpd = ThreadingHTTPServer((LOOPBACK, 0), Handler)
    http.httpd.daemon_threads = True
    sink.port = http.httpd.server_address[1]
    http.start()
    try:
        yield sink
    finally:
        http.stop()


@contextlib.contextmanager
def rotel_to_sink(hop: str = "grpc") -> Iterator[tuple[OtlpSink, Rotel]]:
    """The two-hop OTLP pipeline: rotel receiving (gRPC and HTTP) and forwarding over ``hop``
    (grpc|http) to a loopback sink. A component that cannot start: require_backend()."""
    with contextlib.ExitStack() as stack:
        with backend("rotel"):
            sink = stack.enter_context(start_otlp_sink(hop))
            rotel = stack.enter_context(start_rotel(forward_to=sink.endpoint, forward_protocol=hop))
        yield sink, rotel
