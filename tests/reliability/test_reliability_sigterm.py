"""SIGTERM to our own entry points mid-run: in-flight spans end, everything is flushed, one line.

``python -m engine_stub`` with the plugin (entry point) and ``otel-llm demo``, each a real process
exporting OTLP/gRPC to a real receiver (tests/support/sigterm.py).
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Iterator

import pytest

from otel_llm.export.handle import SHUTDOWN_TIMEOUT_MILLIS
from tests.support.backends import OtlpSink, silent_collector, start_otlp_sink
from tests.support.sigterm import EXIT_STATUS, Run, check_stopped_and_flushed

pytest.importorskip("torch")

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


@pytest.fixture(scope="module")
def sink() -> Iterator[OtlpSink]:
    with start_otlp_sink("grpc") as s:
        yield s


@pytest.mark.parametrize("argv", ENTRY_POINTS)
def test_sigterm_mid_run_ends_and_flushes_in_flight_spans(sink: OtlpSink, argv: list[str]) -> None:
    with Run(argv, sink.endpoint) as run:
        _, err = run.proc.communicate(timeout=60)
    check_stopped_and_flushed(run, sink, err)


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
