"""One of our entry points, a real process exporting OTLP, stopped by SIGTERM mid-run; and what
reached the receiver from it.

The export intervals are a minute, so only the flush at exit can deliver what a test reads; the
signal is sent once the process's own /metrics shows finished requests, so that some requests
have finished and others are in flight.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import urllib.request
from typing import Any

from otel_llm.catalogue.metrics import BY_KEY
from otel_llm.testing.span_receiver import attribute_value
from tests.support.backends import OtlpSink, free_port, wait_until

EXIT_STATUS = 128 + signal.SIGTERM
CUT_SHORT = re.compile(r"stopped by SIGTERM.*, (\d+) requests in flight cut short; flushing the telemetry")
FINISHED_BEFORE_SIGNAL = 30


class Run:
    """``with Run(argv, endpoint, naming) as run:`` starts ``argv`` (``{port}`` in it: the port of
    its /metrics), sends SIGTERM once it has finished requests, and kills it on the way out."""

    def __init__(self, argv: list[str], endpoint: str, naming: str = "vllm") -> None:
        self.port = free_port()
        self.instance = f"sigterm-{self.port}"
        self.success = BY_KEY["request_success"].name(naming)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_METRICS_EXPORTER="prometheus,otlp",
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_PROMETHEUS_PORT=str(self.port),
            OTEL_BSP_SCHEDULE_DELAY="60000",
            OTEL_METRIC_EXPORT_INTERVAL="60000",
            OTEL_RESOURCE_ATTRIBUTES=f"service.instance.id={self.instance}",
        )
        argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def _finished(self) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
            text = response.read().decode()
        total = self.success.replace(".", "_") + "_total"
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == total)

    def __enter__(self) -> "Run":
        try:
            wait_until(lambda: self._finished() >= FINISHED_BEFORE_SIGNAL, timeout=300, what="finished requests")
        except TimeoutError:
            self.proc.kill()
            raise AssertionError(f"no finished requests on /metrics:\n{self.proc.communicate()[1][-3000:]}") from None
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

    def _mine(self, resource: Any) -> bool:
        return any(
            a.key == "service.instance.id" and a.value.string_value == self.instance for a in resource.attributes
        )

    def spans(self, sink: OtlpSink, name: str = "llm_request") -> list[Any]:
        with sink.lock:
            requests = list(sink.traces)
        return [
            span
            for req in requests
            for rs in req.resource_spans
            if self._mine(rs.resource)
            for ss in rs.scope_spans
            for span in ss.spans
            if span.name == name
        ]

    def success_total(self, sink: OtlpSink) -> int:
        """The request count in the process's last metric export."""
        with sink.lock:
            requests = list(sink.metrics)
        totals = [
            sum(p.as_int for p in m.sum.data_points)
            for req in requests
            for rm in req.resource_metrics
            if self._mine(rm.resource)
            for sm in rm.scope_metrics
            for m in sm.metrics
            if m.name == self.success
        ]
        assert totals, "no final metric export"
        return totals[-1]


def _cut_short(span: Any) -> bool:
    """Ended before its end: by the telemetry (status ERROR, marked incomplete), or by the engine
    itself (transformers fails the requests of a stopped batch: ERROR, or cancels them: abort)."""
    reasons = [
        v.string_value
        for a in span.attributes
        if a.key == "gen_ai.response.finish_reasons"
        for v in a.value.array_value.values
    ]
    return span.status.code == span.status.STATUS_CODE_ERROR or reasons == ["abort"]


def check_stopped_and_flushed(run: Run, sink: OtlpSink, err: str, engine_logs_tracebacks: bool = False) -> None:
    """Exit 143, no traceback, one line saying how many requests were in flight; exactly one span
    per request, those in flight cut short (the telemetry's marked ``shutdown``); the final export
    counts every request the telemetry saw finish. ``engine_logs_tracebacks``: the engine's own
    threads log theirs as it stops (transformers' generation thread): only ours are errors."""
    assert run.proc.returncode == EXIT_STATUS, err
    if engine_logs_tracebacks:
        assert not re.search(r'File ".*/(otel_llm|engine_stub)/', err), err
    else:
        assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "SIGTERM" in line]
    assert len(lines) == 1, err
    match = CUT_SHORT.search(lines[0])
    assert match, err
    in_flight = int(match.group(1))
    spans = run.spans(sink)
    ids = [next(attribute_value(a.value) for a in s.attributes if a.key == "gen_ai.request.id") for s in spans]
    assert len(ids) == len(set(ids)), "a request has two spans"
    incomplete = [s for s in spans if any(a.key == "llm.request.incomplete" for a in s.attributes)]
    assert in_flight > 0
    assert sum(map(_cut_short, spans)) == in_flight
    for span in incomplete:
        assert {a.key: attribute_value(a.value) for a in span.attributes}["llm.request.incomplete"] == "shutdown"
        assert span.status.code == span.status.STATUS_CODE_ERROR
    assert len(spans) - len(incomplete) == run.success_total(sink) >= FINISHED_BEFORE_SIGNAL
