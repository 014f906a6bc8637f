"""The OTLP/HTTP exporters' requests Session: the environment (proxies, CA bundle, ~/.netrc) is
read once per URL, not at every export, and still applies: a proxy named in the environment
carries every export."""

from __future__ import annotations

import http.server
import threading
from collections import Counter
from typing import Any, Iterator

import pytest
import requests.sessions
import requests.utils

from otel_llm.export.otlp import _http_session

EXPORTS = 3


@pytest.fixture
def proxy() -> Iterator[tuple[str, list[str]]]:
    """An HTTP proxy on loopback that answers every request itself: (its URL, request lines seen)."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append(self.requestline)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_the_environment_is_read_once_per_url_and_still_applies(monkeypatch, proxy) -> None:
    proxy_url, seen = proxy
    monkeypatch.setenv("HTTP_PROXY", proxy_url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    calls: Counter = Counter()
    environ_proxies, netrc = requests.sessions.get_environ_proxies, requests.utils.get_netrc_auth

    def counted_proxies(*args: Any, **kwargs: Any) -> Any:
        calls["proxies"] += 1
        return environ_proxies(*args, **kwargs)

    def counted_netrc(*args: Any, **kwargs: Any) -> Any:
        calls["netrc"] += 1
        return netrc(*args, **kwargs)

    monkeypatch.setattr(requests.sessions, "get_environ_proxies", counted_proxies)
    monkeypatch.setattr(requests.utils, "get_netrc_auth", counted_netrc)
    monkeypatch.setattr(requests.sessions, "get_netrc_auth", counted_netrc)  # requests' own lookup
    session = _http_session()
    url = "http://collector.invalid:4318/v1/metrics"  # reachable only through the proxy
    for _ in range(EXPORTS):
        assert session.post(url, data=b"points", timeout=10).status_code == 200
    assert seen == [f"POST {url} HTTP/1.1"] * EXPORTS
    assert calls == {"proxies": 1, "netrc": 1}


class _Collector:
    """An OTLP/HTTP endpoint on loopback (HTTP/1.1, connections kept): what each request carried
    (headers by lower-case name), and on which client port it came."""

    def __init__(self, respond: Any = None) -> None:
        self.seen: list[tuple[int, dict[str, str], bytes]] = []
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                collector.seen.append((self.client_address[1], {k.lower(): v for k, v in self.headers.items()}, body))
                (respond or _ok)(self)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def _ok(handler: http.server.BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Length", "0")
    handler.end_headers()


@pytest.fixture
def collector() -> Iterator[Any]:
    made: list[_Collector] = []

    def make(respond: Any = None) -> _Collector:
        made.append(_Collector(respond))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_plain_http_exports_keep_one_connection_and_carry_the_exporters_headers(monkeypatch, collector) -> None:
    """Without a proxy or credentials, the SDK's HTTP exporter sends over one kept connection
    (not through requests), with the headers it sets and those of OTEL_EXPORTER_OTLP_HEADERS."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=blue")
    sent: Counter[str] = Counter()
    original = requests.Session.request
    monkeypatch.setattr(requests.Session, "request", lambda *a, **k: sent.update(["requests"]) or original(*a, **k))
    c = collector()
    exporter = OTLPMetricExporter(endpoint=f"{c.url}/v1/metrics", session=_http_session())
    reader = InMemoryMetricReader()
    counter = MeterProvider(metric_readers=[reader]).get_meter("t").create_counter("exports")
    for n in range(1, EXPORTS + 1):
        counter.add(1)
        data = reader.get_metrics_data()
        assert data is not None
        assert exporter.export(data).name == "SUCCESS"
        points = ExportMetricsServiceRequest.FromString(c.seen[-1][2]).resource_metrics[0].scope_metrics[0]
        assert points.metrics[0].sum.data_points[0].as_int == n
    assert len(c.seen) == EXPORTS and len({port for port, _, _ in c.seen}) == 1
    headers = c.seen[0][1]
    assert headers["content-type"] == "application/x-protobuf" and headers["x-tenant"] == "blue"
    assert not sent  # requests' Session.request was not reached


def test_a_kept_connection_closed_by_the_server_is_replaced(collector) -> None:
    """A server that closes the connection after answering, without saying so (an idle timeout):
    the next request finds it closed and is sent once more on a new connection."""

    def answer_then_close(handler: http.server.BaseHTTPRequestHandler) -> None:
        _ok(handler)
        handler.close_connection = True

    c = collector(answer_then_close)
    session = _http_session()
    for _ in range(EXPORTS):
        assert session.post(f"{c.url}/v1/traces", data=b"spans", timeout=10).status_code == 200
    assert [body for _, _, body in c.seen] == [b"spans"] * EXPORTS
    assert len({port for port, _, _ in c.seen}) == EXPORTS
    assert [headers["accept-encoding"] for _, headers, _ in c.seen] == ["identity"] * EXPORTS
    assert session.headers["Accept-Encoding"] == requests.utils.default_headers()["Accept-Encoding"]  # a copy


def test_plain_http_failures_are_requests_errors(collector) -> None:
    """What the exporters retry or report: requests' own exceptions."""
    import socket

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there
    session = _http_session()
    with pytest.raises(requests.exceptions.ConnectionError):
        session.post(f"http://127.0.0.1:{port}/v1/metrics", data=b"points", timeout=10)

    hold = threading.Event()

    def answer_once_released(handler: http.server.BaseHTTPRequestHandler) -> None:
        hold.wait(10)
        _ok(handler)

    c = collector(answer_once_released)
    try:
        with pytest.raises(requests.exceptions.ReadTimeout):
            session.post(f"{c.url}/v1/metrics", data=b"points", timeout=0.2)
    finally:
        hold.set()


def test_a_redirect_is_followed_where_the_caller_asks_for_it(collector) -> None:
    """Older SDKs post with requests' default (redirects followed): requests then follows it."""
    target = collector()

    def redirect(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(308)
        handler.send_header("Location", f"{target.url}/v1/metrics")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    moved = collector(redirect)
    session = _http_session()
    assert session.post(f"{moved.url}/v1/metrics", data=b"points", timeout=10).status_code == 200
    assert [body for _, _, body in target.seen] == [b"points"]
    answer = session.request("POST", f"{moved.url}/v1/metrics", data=b"points", timeout=10, allow_redirects=False)
    assert answer.status_code == 308 and len(target.seen) == 1
