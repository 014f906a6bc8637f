"""Every PromQL expression of the shipped dashboards and rules runs against a real Prometheus, for
both naming profiles.

A short engine_stub load with the plugin's Prometheus endpoint, scraped every second by a real
Prometheus that also evaluates the rule files; then each expression of the profile's dashboard and
rules (Grafana variables substituted) must parse and return data, and read only series that the
plugin really exports. The who-evicts series (preemptions caused per request, preemptions by cause)
equal the engine's own record of each preemption's cause, and the evictor alert fires on them.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

import otel_llm
from collector.generate.profiles import PROFILES, Profile, le_matcher
from engine_stub import Engine, RequestOutput
from otel_llm.config.buckets import REQUEST_NUM_PREEMPTIONS
from otel_llm.events import CAUSE_REQUEST, CAUSE_SELF, EventType, RequestEvent
from tests.support.backends import backend, free_port, start_prometheus
from tests.support.promql import (
    RULES,
    all_expressions,
    needs_a_noisy_neighbour,
    needs_history,
    query,
    referenced_series,
)
from tests.support.workloads import NUM_REQUESTS, add_requests, preempting_engine_config

pytestmark = pytest.mark.backend


@pytest.fixture(scope="module")
def ports() -> dict[str, int]:
    return {profile: free_port() for profile in PROFILES}


@pytest.fixture(scope="module")
def prometheus(ports):
    # One Prometheus for the module: both endpoints are targets from the start (down until their
    # test starts them), both rule files loaded (each profile's rules see only its own series).
    with backend("prometheus"):
        with start_prometheus([f"127.0.0.1:{p}" for p in ports.values()], rule_files=RULES) as prom:
            yield prom


# The spike alert compares the last 5 minutes with the hour that ended an hour ago: no data can
# exist for that in a test that lasts seconds, so only its parsing and its left operand are checked.
@pytest.mark.parametrize("profile", PROFILES)
def test_every_dashboard_and_rule_expression_returns_data(profile, prometheus, ports, monkeypatch):
    for key in ("OTEL_METRICS_EXPORTER", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_PROMETHEUS_PORT"):
        monkeypatch.delenv(key, raising=False)
    p = Profile(profile)
    port = ports[profile]
    config = otel_llm.TelemetryConfig(
        model_name="tiny",
        naming=profile,
        metrics_exporters=("prometheus",),
        traces_exporters=("none",),
        prometheus_port=port,
        tenant="priority",  # the tenant panels and rules have data; the others sum over tenants
    )
    drops = f'{p.series("dropped_events")}{{reason="unknown_request"}}'
    handle = otel_llm.setup_telemetry(config, tenant_sources=("priority",), entry_point="engine_stub")
    try:
        # Scraped at 0 before anything is dropped: increase() needs the series to exist first.
        prometheus.wait_for(drops, bool, timeout=20)
        engine = Engine(preempting_engine_config())
        engine.hooks.subscribe(handle.telemetry)
        add_requests(engine)
        # rate() needs two samples of a series in its window: each series is scraped once soon
        # after it is born, before the run ends (a run shorter than the scrape interval would
        # otherwise leave one sample). Series born at a finish: every request's, and the
        # preempted time (born at the first finish of a preempted request).
        births = {
            p.count("request_num_preemptions"): lambda o: True,
            p.count("request_preempted_time_seconds"): lambda o: o.num_preemptions > 0,
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
            f"sum({p.count('request_num_preemptions')})",
            lambda r: r and float(r[0]["value"][1]) == NUM_REQUESTS,
            timeout=20,
        )
        prometheus.wait_for(drops, lambda r: r and r[0]["value"][1] == "1", timeout=20)
        thrashing_rule = f"{p.level}:{p.metric_part('request_num_preemptions')}:thrashing_ratio_rate5m"
        prometheus.wait_for(thrashing_rule, bool, timeout=20)

        exported = set(prometheus.series_names())
        expressions = all_expressions("tiny", "0", profile=profile, rate_interval="1m")
        empty, unknown = [], {}
        for where, expr in expressions:
            answer = query(prometheus, expr)
            assert answer["status"] == "success", (where, answer)
            if not answer["data"]["result"] and not (needs_history(where) or needs_a_noisy_neighbour(where)):
                empty.append(where)
            if referenced_series(expr) - exported:
                unknown[where] = referenced_series(expr) - exported
        assert not unknown, f"expressions reading series the plugin does not export: {unknown}"
        assert not empty, f"expressions returning no data: {empty}"

        (spike,) = [expr for where, expr in expressions if needs_history(where)]
        left = spike.split(">")[0].strip()
        assert query(prometheus, left)["data"]["result"]
        share = float(query(prometheus, thrashing_rule)["data"]["result"][0]["value"][1])
        assert 0.05 < share <= 1 and not math.isnan(share)

        # Who evicts, exactly, against the engine's own record of each preemption's cause: the
        # distribution the panel's quantiles and exemplars read, the requests above the threshold
        # the alert and the panel's line read, the preemptions by cause kind (labels bounded to the
        # kinds that happened), and the alert firing on them.
        check_evictors(prometheus, p, outputs)
        check_tenants(prometheus, p, outputs)
    finally:
        handle.shutdown()


def check_tenants(prometheus, p: Profile, outputs: list[RequestOutput]) -> None:
    """The tenant matrix as scraped, and the noisy-neighbours table's query, against the engine's
    record and the requests' priorities (add_requests: request i has priority i % 3)."""
    tenant, cause = p.label("tenant"), p.label("cause_tenant")
    tenant_of = {o.request_id: str(int(o.request_id[4:]) % 3) for o in outputs}
    truth = Counter((tenant_of[o.request_id], tenant_of[c]) for o in outputs for c in o.preempted_by)
    assert len({v for v, _ in truth}) == 3 and any(v != c for v, c in truth)
    scraped = query(prometheus, f"sum by ({tenant}, {cause}) ({p.series('num_preemptions_by_tenant')})")
    assert {(r["metric"][tenant], r["metric"][cause]): float(r["value"][1]) for r in scraped["data"]["result"]} == truth
    per_tenant = query(prometheus, f"sum by ({tenant}) ({p.count('request_num_preemptions')})")["data"]["result"]
    assert {r["metric"][tenant]: float(r["value"][1]) for r in per_tenant} == Counter(tenant_of.values())


def check_evictors(prometheus, p: Profile, outputs: list[RequestOutput]) -> None:
    caused, by_cause = "request_num_preemptions_caused", "num_preemptions_by_cause"
    cause, model = p.extra_label(by_cause), p.model

    def value(expr: str) -> float:
        return float(query(prometheus, expr)["data"]["result"][0]["value"][1])

    for bound in REQUEST_NUM_PREEMPTIONS:
        expected = sum(o.num_preemptions_caused <= bound for o in outputs)
        assert value(f"sum({p.bucket(caused)}{{le{le_matcher(bound)}}})") == expected, bound
    assert value(f"sum({p.count(caused)})") == len(outputs)
    assert value(f"sum({p.base(caused)}_sum)") == sum(o.num_preemptions_caused for o in outputs)
    evictors = sum(o.num_preemptions_caused > p.evictor_threshold for o in outputs)
    assert evictors > 0
    assert value(f"sum({p.count(caused)}) - sum({p.bucket(caused)}{{le{p.evictor_le}}})") == evictors

    kinds = Counter(CAUSE_SELF if c == o.request_id else CAUSE_REQUEST for o in outputs for c in o.preempted_by)
    assert set(kinds) == {CAUSE_SELF, CAUSE_REQUEST} and sum(kinds.values()) == sum(o.num_preemptions for o in outputs)
    counted = query(prometheus, f"sum by ({cause}) ({p.series(by_cause)})")["data"]["result"]
    assert {r["metric"][cause]: float(r["value"][1]) for r in counted} == kinds
    panel = next(e for w, e in all_expressions("tiny", "0", profile=p.naming) if "Preemptions by cause" in w)
    assert {r["metric"][cause] for r in query(prometheus, panel)["data"]["result"]} == set(kinds)

    alert = f'ALERTS{{alertname="LLMRequestCausedManyPreemptions", alertstate="firing", {model}="tiny"}}'
    (firing,) = prometheus.wait_for(alert, bool, timeout=20)
    assert firing["metric"] == {
        "__name__": "ALERTS",
        "alertname": "LLMRequestCausedManyPreemptions",
        "alertstate": "firing",
        "severity": "warning",
        model: "tiny",
        p.engine: "0",
    }
