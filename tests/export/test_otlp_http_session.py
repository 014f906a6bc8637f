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
