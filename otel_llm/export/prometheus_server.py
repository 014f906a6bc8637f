"""The Prometheus endpoint's HTTP server: /metrics rendered from a registry, one scrape at a time,
on a thread that sleeps between requests.

One scrape at a time: the upstream collector hands collected data through a deque (``collect``
-> ``_receive_metrics`` -> ``popleft``), so two concurrent scrapes can steal each other's data and
one of them returns an empty body. The server serializes rendering.
"""

from __future__ import annotations

import gzip
import logging
import os
import selectors
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry

from otel_llm.export.prometheus_exposition import render

_logger = logging.getLogger(__name__)

# Concurrent connections served at once; more are closed at accept (bounded threads).
_MAX_CONNECTIONS = 8
# Seconds a client may take to send its request (a stuck client must not hold a thread).
_REQUEST_TIMEOUT = 10.0


class MetricsServer(ThreadingHTTPServer):
    """``registry`` served at /metrics (and /) on ``address``, bound at construction; :meth:`serve`
    runs it (on a thread of the caller's), :meth:`stop` ends it."""

    daemon_threads = True
    allow_reuse_address = False  # a taken port must fail, not be shared

    def __init__(self, address, registry: CollectorRegistry) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.registry = registry
        self.render_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        super().__init__(address, _Handler)
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
    server: MetricsServer
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
