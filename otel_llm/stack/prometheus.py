"""A local Prometheus (Debian's ``prometheus``) scraping the endpoints given, exemplar storage on by default.

Exemplars scraped over OpenMetrics are kept only with ``--enable-feature=exemplar-storage``; they
are read back with ``/api/v1/query_exemplars``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from otel_llm.stack.lifetime import die_with_parent
from otel_llm.stack.ports import LOOPBACK, free_port

READY_TIMEOUT_S = 30.0
PORT_ATTEMPTS = 3
MISSING = "apt-get install prometheus"


class PrometheusUnavailable(RuntimeError):
    """Prometheus is not installed or did not become ready in time."""


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
    *targets: str,
    port: Optional[int] = None,
    scrape_interval: str = "1s",
    ready_timeout_s: float = READY_TIMEOUT_S,
    exemplars: bool = True,
    rule_files: Sequence[Path] = (),
) -> Iterator[Prometheus]:
    """Prometheus on 127.0.0.1:``port`` scraping ``targets`` (``host:port``, or metrics URLs: their
    path is scraped) every ``scrape_interval``, evaluating ``rule_files`` as often.

    Without ``port``, a free one: another process can take it before Prometheus binds it, and
    Prometheus is then started again on another (3 attempts). Stopped, and its folder removed, on
    exit. Raises PrometheusUnavailable when it is not installed or does not become ready in time.
    """
    binary = shutil.which("prometheus")
    if binary is None:
        raise PrometheusUnavailable(f"Prometheus is not installed: {MISSING}")
    workdir = Path(tempfile.mkdtemp(prefix="otel-llm-prometheus-"))
    try:
        _write_config(workdir / "prometheus.yml", targets, scrape_interval, rule_files)
        attempts = 1 if port else PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            prometheus = _launch(binary, workdir, port or free_port(), exemplars)
            try:
                _wait_ready(prometheus, ready_timeout_s)
                break
            except PrometheusUnavailable as exc:
                _stop(prometheus.proc)
                if attempt == attempts or "in use" not in str(exc).lower():
                    raise
        try:
            yield prometheus
        finally:
            _stop(prometheus.proc)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _write_config(path: Path, targets: Sequence[str], scrape_interval: str, rule_files: Sequence[Path]) -> None:
    addresses = []
    metrics_path = "/metrics"
    for target in targets:
        if "://" in target:  # a URL: one job, so one path for every target
            parsed = urllib.parse.urlparse(target)
            addresses.append(parsed.netloc)
            metrics_path = parsed.path or "/metrics"
        else:
            addresses.append(target)
    config = {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "evaluation_interval": scrape_interval,
        },
        "scrape_configs": [
            {"job_name": "otel_llm", "metrics_path": metrics_path, "static_configs": [{"targets": addresses}]}
        ],
        "rule_files": [str(Path(f).resolve()) for f in rule_files],
    }
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML


def _launch(binary: str, workdir: Path, port: int, exemplars: bool) -> Prometheus:
    listen = f"{LOOPBACK}:{port}"
    log_path = workdir / "prometheus.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={listen}",
                *(["--enable-feature=exemplar-storage"] if exemplars else []),
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            preexec_fn=die_with_parent,
        )
    return Prometheus(f"http://{listen}", proc, log_path)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
            raise PrometheusUnavailable(
                f"Prometheus not ready at {prometheus.url} after {timeout_s:g} s: {prometheus.log()}"
            )
        time.sleep(0.1)
