"""Plain-HTTP requests over a kept ``http.client`` connection, answered as requests' Response.

Why: the OTLP/HTTP exporters send through a requests Session, whose layers (request preparation,
hooks, cookies, adapters, urllib3's pool and retries) cost about 300 µs of CPU per export in a
serving process, against about 50 µs for the same POST with ``http.client``. The session in
:mod:`otel_llm.export.otlp` sends here only what these layers would add nothing to: ``http://``,
no proxy, no credentials, no cookies, no hooks; everything else goes through requests.

Errors are requests' own (``ConnectionError``, ``ConnectTimeout``, ``ReadTimeout``), which the
exporters retry or report as they would. A kept connection that the server has closed since
(an idle timeout) is noticed on the next request, which is sent again once on a new connection.
"""

from __future__ import annotations

import datetime
import http.client
import io
import os
import socket
import threading
import time
from typing import Mapping, Optional, Union
from urllib.parse import urlsplit

import requests
from requests.structures import CaseInsensitiveDict
from requests.utils import get_encoding_from_headers

Timeout = Union[None, float, int]

# Failures of a request on a kept connection that mean the server closed it while it was idle.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class PlainHTTP:
    """One kept connection per host and port; requests of concurrent threads do not wait for
    each other (:meth:`request` returns None when the connection is busy: send it otherwise)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connections: dict[tuple[str, int], http.client.HTTPConnection] = {}
        self._pid = os.getpid()

    def request(
        self, method: str, url: str, body: bytes, headers: Mapping[str, str], timeout: Timeout
    ) -> Optional[requests.Response]:
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._pid != os.getpid():  # a forked child: the parent's sockets are not ours
                self._connections = {}
                self._pid = os.getpid()
            return self._send(method, url, body, headers, timeout)
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            for connection in self._connections.values():
                connection.close()
            self._connections.clear()

    def _send(
        self, method: str, url: str, body: bytes, headers: Mapping[str, str], timeout: Timeout
    ) -> requests.Response:
        parts = urlsplit(url)
        key = (parts.hostname or "", parts.port or 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        started = time.monotonic()
        for attempt in (1, 2):
            connection = self._connections.get(key)
            if connection is None:
                connection = self._connections[key] = http.client.HTTPConnection(key[0], key[1])
            connection.timeout = timeout
            reused = connection.sock is not None
            try:
                if reused:
                    connection.sock.settimeout(timeout)
                else:
                    connection.connect()
            except socket.timeout as error:
                connection.close()
                raise requests.exceptions.ConnectTimeout(error) from error
            except OSError as error:
                connection.close()
                raise requests.exceptions.ConnectionError(error) from error
            try:
                connection.request(method, target, body=body, headers=dict(headers))
                answer = connection.getresponse()
                content = answer.read()
            except _STALE as error:
                connection.close()
                if reused and attempt == 1:
                    continue  # closed by the server while idle: once more, on a new connection
                raise requests.exceptions.ConnectionError(error) from error
            except socket.timeout as error:
                connection.close()
                raise requests.exceptions.ReadTimeout(error) from error
            except (OSError, http.client.HTTPException) as error:
                connection.close()
                raise requests.exceptions.ConnectionError(error) from error
            if answer.will_close:
                connection.close()
            return _response(url, answer, content, time.monotonic() - started)
        raise AssertionError("unreachable: the second attempt returns or raises")


def _response(url: str, answer: http.client.HTTPResponse, content: bytes, elapsed_s: float) -> requests.Response:
    response = requests.Response()
    response.status_code = answer.status
    response.reason = answer.reason
    response.headers = CaseInsensitiveDict(answer.getheaders())
    response.encoding = get_encoding_from_headers(response.headers)
    response.url = url
    response.raw = io.BytesIO(content)  # requests' public way in: .content reads it from there
    response.elapsed = datetime.timedelta(seconds=elapsed_s)
    return response
