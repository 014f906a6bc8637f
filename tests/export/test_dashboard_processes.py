"""The dashboards and the rules aggregate over processes, for both naming profiles: a real
Prometheus scrapes two engine processes' endpoints (ports from one base,
``OTEL_LLM_PROMETHEUS_PORTS=2``: two targets, two ``instance`` labels, the same model and engine),
and every expression answers with the processes summed (no target label left); percentiles come
from summed buckets, never from averaged percentiles.
"""

from __future__ import annotations

import re

import pytest

import otel_llm
from collector.generate.profiles import PROFILES, Profile
from engine_stub import Engine
from otel_llm.events import EventType, RequestEvent
from tests.support.backends import backend, free_port_block, start_prometheus
from tests.support.promql import RULES, all_expressions, needs_a_noisy_neighbour, needs_history, query
from tests.support.workloads import NUM_REQUESTS, add_requests, preempting_engine_config

PROCESSES = 2


@pytest.mark.parametrize("profile", PROFILES)
def test_every_percentile_comes_from_summed_buckets(profile) -> None:
    for where, expr in all_expressions("tiny", "0", profile=profile):
        for inner in re.findall(r"histogram_quantile\(\s*[0-9.]+\s*,\s*(\w+)", expr):
            assert inner == "sum", (where, expr)
        assert not re.search(r"\bavg\b[^(]*\([^)]*histogram_quantile", expr), (where, expr)


@pytest.fixture(scope="module")
def bases() -> dict[str, int]:
    """Per profile the first of PROCESSES consecutive ports (free when picked)."""
    out: dict[str, int] = {}
    for profile in PROFILES:
        out[profile] = free_port_block(PROCESSES, avoid=tuple(out.values()))
    return out


@pytest.fixture(scope="module")
def prometheus(bases):
    targets = [f"127.0.0.1:{base + i}" for base in bases.values() for i in range(PROCESSES)]
    with backend("prometheus"), start_prometheus(targets, rule_files=RULES) as prom:
        yield prom


@pytest.mark.backend
@pytest.mark.parametrize("profile", PROFILES)
def test_expressions_sum_the_processes_into_one_series_per_model_and_engine(
    profile, prometheus, bases, monkeypatch
) -> None:
    for key in ("OTEL_METRICS_EXPORTER", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_PROMETHEUS_PORT"):
        monkeypatch.delenv(key, raising=False)
    p = Profile(profile)
    base = bases[profile]
    config = otel_llm.TelemetryConfig(
        model_name="tiny",
        naming=profile,
        metrics_exporters=("prometheus",),
        traces_exporters=("none",),
        prometheus_port=base,
        prometheus_ports=PROCESSES,
        tenant="priority",  # the tenant panels have data too
    )
    preemptions_total, count = p.series("num_preemptions"), p.count("request_num_preemptions")
    handles = [
        otel_llm.setup_telemetry(config, tenant_sources=("priority",), entry_point="engine_stub")
        for _ in range(PROCESSES)
    ]
    try:
        assert [h.prometheus_port for h in handles] == [base + i for i in range(PROCESSES)]
        prometheus.wait_for(f"count({preemptions_total})", lambda r: r and r[0]["value"][1] == str(PROCESSES), 20)

        def run(handle: otel_llm.TelemetryHandle) -> int:
            engine = Engine(preempting_engine_config())
            engine.hooks.subscribe(handle.telemetry)
            add_requests(engine)
            return sum(o.num_preemptions for o in engine.run())

        # A histogram series appears at its first observation, and rate() misses the increase a
        # series was born with: the first process's runs are scraped apart, its second one counts.
        preemptions = run(handles[0])
        prometheus.wait_for(f"sum({count})", lambda r: r and float(r[0]["value"][1]) == NUM_REQUESTS, timeout=20)
        preemptions += sum(run(handle) for handle in handles)
        handles[0].telemetry.on_events([RequestEvent(EventType.TOKENS, "ghost", 1.0, num_tokens=1)])  # one drop
        total = (PROCESSES + 1) * NUM_REQUESTS
        prometheus.wait_for(f"sum({count})", lambda r: r and float(r[0]["value"][1]) == total, timeout=20)
        assert float(query(prometheus, f"sum({preemptions_total})")["data"]["result"][0]["value"][1]) == preemptions
        # Per target: each process's own series (two instances, the same model and engine).
        per_instance = query(prometheus, f"sum by (instance) ({count})")["data"]["result"]
        assert sorted(float(s["value"][1]) for s in per_instance) == [NUM_REQUESTS, 2 * NUM_REQUESTS]
        assert len({s["metric"]["instance"] for s in per_instance}) == PROCESSES
        prometheus.wait_for(f"{p.level}:{p.metric_part('request_num_preemptions')}:thrashing_ratio_rate5m", bool, 20)
        prometheus.wait_for(
            f'sum({p.series("dropped_events")}{{reason="unknown_request"}})',
            lambda r: r and r[0]["value"][1] == "1",
            timeout=20,
        )

        for where, expr in all_expressions("tiny", "0", profile=profile, rate_interval="1m"):
            answer = query(prometheus, expr)
            assert answer["status"] == "success", (where, answer)
            series = answer["data"]["result"]
            assert series or needs_history(where) or needs_a_noisy_neighbour(where), f"{where}: no data"
            # Summed over the processes: the targets' labels are gone.
            assert all({"instance", "job"}.isdisjoint(s["metric"]) for s in series), (where, series)
    finally:
        for handle in handles:
            handle.shutdown()
