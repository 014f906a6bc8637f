"""Every PromQL expression of the shipped dashboard and rules runs against a real Prometheus.

A short engine_stub load with the plugin's Prometheus endpoint, scraped every second by a real
Prometheus that also evaluates collector/rules/otel-llm.rules.yml; then each expression (Grafana
variables substituted) must parse and return data.
"""

from __future__ import annotations

import math

import pytest

import otel_llm
from engine_stub import Engine
from otel_llm.events import EventType, RequestEvent
from tests.support.backends import backend, free_port, start_prometheus
from tests.support.promql import NEEDS_HISTORY, RULES, all_expressions, query
from tests.support.workloads import NUM_REQUESTS, add_requests, preempting_engine_config


# Compares the last 5 minutes with the hour that ended an hour ago: no data can exist for that
# in a test that lasts seconds, so only its parsing and its left operand are checked.
@pytest.mark.backend
def test_every_dashboard_and_rule_expression_returns_data(monkeypatch):
    for key in ("OTEL_METRICS_EXPORTER", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_PROMETHEUS_PORT"):
        monkeypatch.delenv(key, raising=False)
    port = free_port()
    config = otel_llm.TelemetryConfig(
        model_name="tiny", metrics_exporters=("prometheus",), traces_exporters=("none",), prometheus_port=port
    )
    with backend("prometheus"), start_prometheus([f"127.0.0.1:{port}"], rule_files=(RULES,)) as prometheus:
        handle = otel_llm.setup_telemetry(config)
        try:
            # Scraped at 0 before anything is dropped: increase() needs the series to exist first.
            prometheus.wait_for('otel_llm_dropped_events_total{reason="unknown_request"}', bool, timeout=20)
            engine = Engine(preempting_engine_config())
            engine.hooks.subscribe(handle.telemetry)
            add_requests(engine)
            # rate() needs two samples of a series in its window: each series is scraped once soon
            # after it is born, before the run ends (a run shorter than the scrape interval would
            # otherwise leave one sample). Series born at a finish: every request's, and the
            # preempted time (born at the first finish of a preempted request).
            births = {
                "vllm:request_num_preemptions_count": lambda o: True,
                "vllm:request_preempted_time_seconds_count": lambda o: o.num_preemptions > 0,
            }
            outputs = []
            while engine.has_unfinished_requests():
                outputs += engine.step()
                for series, born in list(births.items()):
                    if any(born(o) for o in outputs):
                        prometheus.wait_for(series, bool, timeout=20)
                        del births[series]
            assert sum(o.num_preemptions >= 5 for o in outputs) / len(outputs) > 0.05  # the thrashing alert fires
            handle.telemetry.on_events([RequestEvent(EventType.TOKENS, "ghost", 1.0, num_tokens=1)])  # one drop
            prometheus.wait_for(
                "vllm:request_num_preemptions_count",
                lambda r: r and float(r[0]["value"][1]) == NUM_REQUESTS,
                timeout=20,
            )
            prometheus.wait_for(
                'otel_llm_dropped_events_total{reason="unknown_request"}',
                lambda r: r and r[0]["value"][1] == "1",
                timeout=20,
            )
            prometheus.wait_for(
                "model_name_engine:vllm_request_num_preemptions:thrashing_ratio_rate5m", lambda r: bool(r), timeout=20
            )

            empty = []
            for where, expr in all_expressions("tiny", "0", rate_interval="1m"):
                answer = query(prometheus, expr)
                assert answer["status"] == "success", (where, answer)
                if not answer["data"]["result"] and where not in NEEDS_HISTORY:
                    empty.append(where)
            assert not empty, f"expressions returning no data: {empty}"

            spike = dict(all_expressions("tiny", "0"))[next(iter(NEEDS_HISTORY))]
            left = spike.split(">")[0].strip()
            assert query(prometheus, left)["data"]["result"]
            thrashing = query(prometheus, "model_name_engine:vllm_request_num_preemptions:thrashing_ratio_rate5m")
            share = float(thrashing["data"]["result"][0]["value"][1])
            assert 0.05 < share <= 1 and not math.isnan(share)
        finally:
            handle.shutdown()
