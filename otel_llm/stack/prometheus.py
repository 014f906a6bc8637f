"""A local Prometheus (Debian's ``prometheus``) scraping one endpoint, with exemplar storage on.

Exemplars scraped over OpenMetrics are kept only with ``--enable-feature=exemplar-storage``; they
are read back with ``/api/v1/query_exemplars``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional

from otel_llm.stack.lifetime import die_with_parent

LOOPBACK = "127.0.0.1"
READY_TIMEOUT_S = 30.0
MISSING = "apt-get install prometheus"


class PrometheusUnavailable(RuntimeError):
    """Prometheus is not installed or did not become ready in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen, log_path: Path) -> None:
        self.url = url
        self.proc = proc
        self.log_path = log_path

    def get(self, path: str, params: dict[str, str]) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        return list(self.get("/api/v1/query", {"query": expr})["result"])

    def exemplars(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        """``/api/v1/query_exemplars``: per series, its labels and exemplars (labels, value, time)."""
        return list(self.get("/api/v1/query_exemplars", {"query": expr, "start": str(start), "end": str(end)}))

    def graph_url(self, expr: str) -> str:
        """The query in Prometheus's own UI, graphed over the last 5 minutes."""
        return f"{self.url}/graph?{urllib.parse.urlencode({'g0.expr': expr, 'g0.tab': '0', 'g0.range_input': '5m'})}"

    def log(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@contextlib.contextmanager
def start_prometheus(
    target: str, port: Optional[int] = None, scrape_interval: str = "1s", ready_timeout_s: float = READY_TIMEOUT_S
) -> Iterator[Prometheus]:
    """Prometheus on 127.0.0.1:``port`` (a free one by default) scraping ``target`` (host:port)."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise PrometheusUnavailable(f"Prometheus is not installed: {MISSING}")
    workdir = Path(tempfile.mkdtemp(prefix="otel-llm-prometheus-"))
    config = {
        "global": {"scrape_interval": scrape_interval, "scrape_timeout": scrape_interval},
        "scrape_configs": [{"job_name": "otel_llm", "static_configs": [{"targets": [target]}]}],
    }
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    listen = f"{LOOPBACK}:{port or free_port()}"
    log_path = workdir / "prometheus.log"
    proc = None
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={workdir / 'data'}",
                    f"--web.listen-address={listen}",
                    "--enable-feature=exemplar-storage",
                    "--log.level=warn",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                preexec_fn=die_with_parent,
            )
        prometheus = Prometheus(f"http://{listen}", proc, log_path)
        _wait_ready(prometheus, ready_timeout_s)
        yield prometheus
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_ready(prometheus: Prometheus, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if prometheus.proc.poll() is not None:
            raise PrometheusUnavailable(f"Prometheus exited with {prometheus.proc.returncode}: {prometheus.log()}")
        try:
            with urllib.request.urlopen(prometheus.url + "/-/ready", timeout=1) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet
        if time.monotonic() >= deadline:
            raise PrometheusUnavailable(f"Prometheus not ready at {prometheus.url} after {timeout_s:g} s")
        time.sleep(0.1)
