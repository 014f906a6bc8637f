"""SIGTERM to our own entry points mid-run: in-flight spans end, everything is flushed, one line.

``python -m engine_stub`` with the plugin (entry point) and ``otel-llm demo``, each a real process
exporting OTLP/gRPC to a real receiver, with export intervals of a minute: only the shutdown
flush can deliver what the test reads. The signal is sent once the process's own /metrics shows
finished requests, so that some requests have finished and others are in flight.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel_llm.export.handle import SHUTDOWN_TIMEOUT_MILLIS
from otel_llm.testing.span_receiver import attribute_value
from tests.support.backends import OtlpSink, free_port, silent_collector, start_otlp_sink, wait_until

pytest.importorskip("torch")

EXIT_STATUS = 128 + signal.SIGTERM
CUT_SHORT = re.compile(r"stopped by SIGTERM, (\d+) requests in flight cut short; flushing the telemetry")


@pytest.fixture(scope="module")
def sink() -> Iterator[OtlpSink]:
    with start_otlp_sink("grpc") as s:
        yield s


def _env(endpoint: str, port: int, instance: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
        OTEL_METRICS_EXPORTER="prometheus,otlp",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
        OTEL_BSP_SCHEDULE_DELAY="60000",
        OTEL_METRIC_EXPORT_INTERVAL="60000",
        OTEL_RESOURCE_ATTRIBUTES=f"service.instance.id={instance}",
    )
    return env


def _finished(port: int) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "vllm:request_success"
        for sample in family.samples
        if sample.name == "vllm:request_success_total"
    )


class Run:
    """A process of ``argv`` exporting to ``endpoint``, stopped by SIGTERM mid-run."""

    def __init__(self, argv: list[str], endpoint: str) -> None:
        self.port = free_port()
        self.instance = f"sigterm-{self.port}"
        argv = [a.replace("{port}", str(self.port)) for a in argv]
        env = _env(endpoint, self.port, self.instance)
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def __enter__(self) -> "Run":
        wait_until(lambda: _finished(self.port) >= 30, timeout=240, what="30 finished requests on /metrics")
        self.proc.send_signal(signal.SIGTERM)
        return self

    def cut_short_line(self) -> str:
        """Reads stderr up to the line saying what was cut short."""
        assert self.proc.stderr is not None
        while True:
            line = self.proc.stderr.readline()
            assert line, "the process ended without saying what was cut short"
            if CUT_SHORT.search(line):
                return line

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def _spans(sink: OtlpSink, instance: str) -> list[Any]:
    with sink.lock:
        requests = list(sink.traces)
    return [
        span
        for req in requests
        for rs in req.resource_spans
        if _is(rs.resource, instance)
        for ss in rs.scope_spans
        for span in ss.spans
        if span.name == "llm_request"
    ]


def _is(resource: Any, instance: str) -> bool:
    return any(a.key == "service.instance.id" and a.value.string_value == instance for a in resource.attributes)


def _success_total(sink: OtlpSink, instance: str) -> int:
    with sink.lock:
        requests = list(sink.metrics)
    totals = [
        sum(p.as_int for p in m.sum.data_points)
        for req in requests
        for rm in req.resource_metrics
        if _is(rm.resource, instance)
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "vllm:request_success"
    ]
    assert totals, "no final metric export"
    return totals[-1]


ENTRY_POINTS = [
    pytest.param([sys.executable, "-m", "engine_stub", "--requests", "400"], id="engine_stub"),
    pytest.param(
        [
            sys.executable,
            "-m",
            "otel_llm.cli",
            "demo",
            "--requests",
            "400",
            "--no-progress",
            "--prometheus-port",
            "{port}",
        ],
        id="demo",
    ),
]


@pytest.mark.parametrize("argv", ENTRY_POINTS)
def test_sigterm_mid_run_ends_and_flushes_in_flight_spans(sink: OtlpSink, argv: list[str]) -> None:
    with Run(argv, sink.endpoint) as run:
        _, err = run.proc.communicate(timeout=60)
    assert run.proc.returncode == EXIT_STATUS, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "SIGTERM" in line]
    assert len(lines) == 1, err
    match = CUT_SHORT.search(lines[0])
    assert match, err
    in_flight = int(match.group(1))
    spans = _spans(sink, run.instance)
    ids = Counter(next(attribute_value(a.value) for a in s.attributes if a.key == "gen_ai.request.id") for s in spans)
    assert set(ids.values()) == {1}, "a request has two spans"
    incomplete = [s for s in spans if any(a.key == "llm.request.incomplete" for a in s.attributes)]
    assert in_flight > 0
    assert len(incomplete) == in_flight
    for span in incomplete:
        assert {a.key: attribute_value(a.value) for a in span.attributes}["llm.request.incomplete"] == "shutdown"
        assert span.status.code == span.status.STATUS_CODE_ERROR
    # Every finished request's span and count reached the collector in the shutdown flush.
    assert len(spans) - len(incomplete) == _success_total(sink, run.instance) >= 30


@pytest.mark.parametrize("argv", ENTRY_POINTS)
def test_second_sigterm_during_the_flush_exits_at_once(argv: list[str]) -> None:
    with silent_collector() as endpoint, Run(argv, endpoint) as run:
        run.cut_short_line()
        # The flush now waits on a collector that never answers, for up to the shutdown bound.
        run.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        _, err = run.proc.communicate(timeout=60)
        waited = time.monotonic() - started
    assert run.proc.returncode == EXIT_STATUS, err
    assert "Traceback" not in err, err
    assert waited < SHUTDOWN_TIMEOUT_MILLIS / 1000, "the second SIGTERM waited for the flush"
