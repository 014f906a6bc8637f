"""Arize Phoenix, a real OTLP trace store, started locally and read back through its REST API.

Phoenix (PyPI ``arize-phoenix``, installed in a venv of its own by ``make setup-phoenix``: it is
large and pins its own dependencies) takes OTLP/HTTP traces at ``/v1/traces`` on the port of its
UI and REST API. Its gRPC server binds every interface whatever it is told, so Phoenix runs in a
network namespace of its own (:mod:`otel_llm.stack.netns`) and only its HTTP port is reachable,
on 127.0.0.1.

Phoenix keeps no span links (read in arize-phoenix 20.26: its OTLP decoder, ``decode_otlp_span``
in ``phoenix/trace/otel.py``, never reads them, its span table has no column for them, and neither
its REST spans nor its GraphQL ``Span`` has a field for them). A request span is found by its
request id instead (:meth:`Phoenix.request_span`), which is how a victim leads to its evictor.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from otel_llm.config.settings import from_environment
from otel_llm.stack.netns import IsolationUnavailable, start_isolated

REQUEST_ID = "gen_ai.request.id"  # the request span's attribute that names its request
VENV = ".venv-phoenix"  # where `make setup-phoenix` installs it, in the repository
ENV_EXECUTABLE = "OTEL_LLM_PHOENIX"  # the `phoenix` executable, where it is elsewhere
READY_TIMEOUT_S = 120.0  # Phoenix is ready in about 20 s on two idle cores
HTTP_PORT, GRPC_PORT = 6006, 4317  # inside the namespace: nothing else listens there
MISSING = "run `make setup-phoenix` (installs arize-phoenix in .venv-phoenix), or set OTEL_LLM_PHOENIX"


class PhoenixUnavailable(RuntimeError):
    """Phoenix is not installed, cannot be isolated, or did not become ready in time."""


class TraceNotFound(AssertionError):
    """Phoenix did not hold the spans asked for within the time given."""


def executable(explicit: Optional[str] = None) -> Optional[str]:
    """The ``phoenix`` executable: ``explicit``, else $OTEL_LLM_PHOENIX, else .venv-phoenix in the
    current folder or in the repository of this checkout, else ``phoenix`` on PATH."""
    given = explicit or from_environment(ENV_EXECUTABLE)
    if given:
        return given if os.access(given, os.X_OK) else None
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = root / VENV / "bin" / "phoenix"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("phoenix")


class Phoenix:
    """A running Phoenix: ``url`` (UI and REST API), ``otlp_endpoint`` (OTLP/HTTP base endpoint)."""

    def __init__(self, port: int, log_path: Path, relay: subprocess.Popen) -> None:
        self.relay = relay  # the process in the namespace that runs Phoenix and bridges its port
        self.url = f"http://127.0.0.1:{port}"
        self.otlp_endpoint = self.url  # the exporter appends /v1/traces
        self.log_path = log_path

    def get(self, path: str, params: Optional[list[tuple[str, str]]] = None, timeout_s: float = 10.0) -> Any:
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    def spans(
        self,
        trace_id: Optional[str] = None,
        name: Optional[str] = None,
        project: str = "default",
        page_size: int = 100,
        attributes: Optional[Mapping[str, str]] = None,
    ) -> list[dict[str, Any]]:
        """The spans in ``project``, of the trace ``trace_id`` (32 hex digits), named ``name`` and
        with each of the string ``attributes`` where given, page after page (each page's
        ``next_cursor`` asks for the next)."""
        spans: list[dict[str, Any]] = []
        params = [("limit", str(page_size))]
        params += [("trace_id", trace_id)] if trace_id else []
        params += [("name", name)] if name else []
        # Phoenix parses a filter's value as JSON: quoted, an id such as 12 stays a string.
        params += [("attribute", f"{key}:{json.dumps(value)}") for key, value in (attributes or {}).items()]
        cursor: Optional[str] = None
        while True:
            body = self.get(f"/v1/projects/{project}/spans", params + ([("cursor", cursor)] if cursor else []))
            spans.extend(body["data"])
            cursor = body.get("next_cursor")
            if not cursor:
                return spans

    def wait_for_spans(
        self, trace_id: str, found: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 30.0
    ) -> list[dict[str, Any]]:
        """The trace's spans once ``found(spans)`` holds: Phoenix stores what it receives in batches,
        so a span exported a moment ago may not be readable yet. TraceNotFound after ``timeout_s``."""
        return self._wait(lambda: self.spans(trace_id), found, timeout_s, f"trace {trace_id}")

    def request_span(self, request_id: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """The ``llm_request`` span of the request ``request_id`` (its ``gen_ai.request.id``), once
        Phoenix holds it; TraceNotFound after ``timeout_s``, or where it holds more than one."""
        [span] = self._wait(
            lambda: self.spans(name="llm_request", attributes={REQUEST_ID: request_id}),
            lambda spans: len(spans) == 1,
            timeout_s,
            f"request span of {request_id}",
        )
        return span

    def _wait(
        self,
        read: Callable[[], list[dict[str, Any]]],
        found: Callable[[list[dict[str, Any]]], bool],
        timeout_s: float,
        what: str,
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while True:
            spans = read()
            if found(spans):
                return spans
            if time.monotonic() >= deadline:
                names = sorted(s.get("name", "?") for s in spans)
                raise TraceNotFound(
                    f"{what} not in Phoenix at {self.url} after {timeout_s:g} s "
                    f"({len(spans)} spans of it there: {names})"
                )
            time.sleep(0.2)

    def trace_url(self, trace_id: str) -> str:
        """The trace's page in Phoenix's UI (its own redirect finds the project)."""
        return f"{self.url}/redirects/traces/{trace_id}"

    def log(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@contextlib.contextmanager
def start_phoenix(explicit: Optional[str] = None, ready_timeout_s: float = READY_TIMEOUT_S) -> Iterator[Phoenix]:
    """Phoenix in a loopback-only network namespace, with a fresh working folder, its HTTP port
    bridged to 127.0.0.1; ready at /healthz. Stopped, and its folder removed, on exit."""
    binary = executable(explicit)
    if binary is None:
        raise PhoenixUnavailable(f"Phoenix is not installed: {MISSING}")
    workdir = Path(tempfile.mkdtemp(prefix="otel-llm-phoenix-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHOENIX_", "OTEL_"))}
    env.update(
        PHOENIX_WORKING_DIR=str(workdir / "data"),
        PHOENIX_HOST="127.0.0.1",
        PHOENIX_PORT=str(HTTP_PORT),
        PHOENIX_GRPC_PORT=str(GRPC_PORT),
        PHOENIX_TELEMETRY_ENABLED="false",
    )
    log_path = workdir / "phoenix.log"
    isolated = None
    try:
        with open(log_path, "wb") as log:
            try:
                isolated = start_isolated([binary, "serve"], HTTP_PORT, env, log, cwd=workdir)
            except IsolationUnavailable as exc:
                raise PhoenixUnavailable(f"Phoenix needs a network namespace of its own: {exc}") from None
        phoenix = Phoenix(isolated.port, log_path, isolated.proc)
        _wait_ready(phoenix, ready_timeout_s)
        yield phoenix
    finally:
        if isolated is not None:
            isolated.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_ready(phoenix: Phoenix, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if phoenix.relay.poll() is not None:
            raise PhoenixUnavailable(
                f"Phoenix exited with {phoenix.relay.returncode} before it was ready: {phoenix.log()}"
            )
        try:
            with urllib.request.urlopen(phoenix.url + "/healthz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet
        if time.monotonic() >= deadline:
            raise PhoenixUnavailable(
                f"Phoenix not ready at {phoenix.url}/healthz after {timeout_s:g} s: {phoenix.log()}"
            )
        time.sleep(0.25)
