"""Bad input on the real engine: vLLM keeps serving, the plugin says what is wrong in one log
line, and what can still work keeps working.

* The plugin's Prometheus port already taken (another process on the host has it): no /metrics
  from this process, request spans still exported over OTLP.
* A bad OTEL_* value: the plugin is off with one line naming the variable; vLLM serves.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from otel_llm.testing.vllm.server import LOOPBACK, Load, VllmServer, run_load
from tests.support.backends import wait_until

LOAD = Load(requests=4, concurrency=4, max_tokens=8, seed=2)


def test_prometheus_port_taken_leaves_metrics_endpoint_out_and_spans_on(tiny_model: Path, otlp_sink: Any) -> None:
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_sink.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
        }
        with VllmServer(tiny_model, env=env) as server:
            assert [c.status for c in run_load(server.url, LOAD)] == [200] * LOAD.requests
            wait_until(
                lambda: sum(s.name == "llm_request" for s in otlp_sink.spans()) == LOAD.requests,
                60,
                interval=0.2,
                what="the request spans",
            )
            lines = [line for line in server.log_text().splitlines() if "otel-llm" in line]
    said = [line for line in lines if "no /metrics endpoint in this process" in line]
    assert len(said) == 1 and f"{LOOPBACK}:{port}" in said[0], lines
    assert not any("telemetry disabled" in line for line in lines), lines


def test_a_bad_otel_value_disables_the_plugin_in_one_line_and_vllm_serves(tiny_model: Path) -> None:
    with VllmServer(tiny_model, env={"OTEL_EXPORTER_OTLP_TIMEOUT": "soon", "OTEL_TRACES_EXPORTER": "otlp"}) as server:
        assert [c.status for c in run_load(server.url, LOAD)] == [200] * LOAD.requests
        log = server.log_text()
    lines = [line for line in log.splitlines() if "otel-llm" in line]
    disabled = [line for line in lines if "telemetry disabled" in line]
    assert len(disabled) == 1 and "OTEL_EXPORTER_OTLP_TIMEOUT" in disabled[0], lines
    following = log.split(disabled[0], 1)[1].splitlines()[1:2]
    assert not any("Traceback" in line for line in following)  # the line says it all
