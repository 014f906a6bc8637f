"""``otel-llm demo --engine transformers`` given SIGTERM mid-batch: the requests in flight end
marked ``shutdown``, everything is flushed to a real OTLP receiver, one line, exit 143."""

from __future__ import annotations

import sys

from tests.support.backends import start_otlp_sink
from tests.support.sigterm import Run, check_stopped_and_flushed


def test_sigterm_mid_batch_ends_and_flushes_in_flight_spans() -> None:
    argv = [sys.executable, "-m", "otel_llm.cli", "demo", "--engine", "transformers", "--requests", "200"]
    argv += ["--prometheus-port", "{port}"]
    with start_otlp_sink("grpc") as sink:
        with Run(argv, sink.endpoint, naming="semconv") as run:
            _, err = run.proc.communicate(timeout=120)
        # Interrupted, transformers' generation thread outlives its join timeout and logs a traceback.
        check_stopped_and_flushed(run, sink, err, engine_logs_tracebacks=True)
