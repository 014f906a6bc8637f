"""Tenants on engine_stub: every per-tenant series and the tenant matrix against the engine's truth.

engine_stub records who evicted whom at its preemption point (``preempted_by`` of each output);
with each request's tenant known from the workload, that gives the exact matrix, and the outputs
give each tenant's requests, tokens and preemption counts. The same run without a tenant source
gives today's series, which the per-tenant ones must add up to. Then the cap (``other``, said
once), values that are no name (``invalid``), and a source the engine cannot hand over (refused).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Optional

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from engine_stub import Engine, EngineConfig
from otel_llm import TelemetryConfig
from otel_llm.testing import in_memory_telemetry
from otel_llm.testing.read import collect_metrics
from tests.support.otel_helpers import attrs

BUCKETS = (0.5, 1, 2, 3, 4, 5, 10, 20)
PATHS = pytest.mark.parametrize("metric_path", ["in_process", "sdk"])
N = 30


def _engine(policy: str = "priority") -> Engine:
    # 12 blocks of 16 tokens for 30 requests of up to ~190 tokens: many preemptions, within and across classes.
    return Engine(
        EngineConfig(
            num_kv_blocks=12,
            block_size=16,
            max_num_seqs=16,
            max_num_batched_tokens=64,
            seed=0,
            load_plugins=False,
            scheduling_policy=policy,
        )
    )


def _add(engine: Engine, n: int = N, carrier: Optional[Callable[[int], dict[str, str]]] = None) -> None:
    for i in range(n):
        engine.add_request(
            f"req-{i:03d}",
            "hello world " * (1 + i % 3),
            max_tokens=min(150, 20 + (i * 37) % 150),
            priority=i % 3,
            lora=None if i % 3 == 0 else f"adapter-{i % 3}",  # priority 0: the base model
            trace_context=carrier(i) if carrier else None,
        )


def _run(tenant: Optional[str], metric_path: str, **config: Any) -> tuple[Any, dict[str, Any]]:
    r = in_memory_telemetry(
        TelemetryConfig(model_name="tiny", preemption_buckets=BUCKETS, tenant=tenant, **config),
        metric_path=metric_path,
    )
    engine = _engine()
    engine.hooks.subscribe(r.telemetry)
    _add(engine)
    outputs = {o.request_id: o for o in engine.run()}
    r.telemetry.flush()
    return r, outputs


def _buckets(values: list[int]) -> tuple[int, ...]:
    counts = [0] * (len(BUCKETS) + 1)
    for v in values:
        counts[next((i for i, b in enumerate(BUCKETS) if v <= b), len(BUCKETS))] += 1
    return tuple(counts)


@PATHS
def test_per_tenant_series_and_matrix_equal_the_engines_record(metric_path: str) -> None:
    r, outputs = _run("priority", metric_path)
    tenant = {rid: str(int(rid[4:]) % 3) for rid in outputs}
    matrix = Counter((tenant[rid], tenant[cause]) for rid, o in outputs.items() for cause in o.preempted_by)
    assert sum(matrix.values()) == sum(o.num_preemptions for o in outputs.values()) >= 40
    assert {victim for victim, cause in matrix if victim != cause} and {cause for cause, _ in matrix} == {"0", "1", "2"}
    m = r.metrics()
    assert {
        (p.attributes["tenant"], p.attributes["cause_tenant"]): p.value for p in m.points("num_preemptions_by_tenant")
    } == dict(matrix)
    assert m.counter("num_preemptions_by_tenant") == m.counter("num_preemptions")
    for t in ("0", "1", "2"):
        mine = [o for rid, o in outputs.items() if tenant[rid] == t]
        suffered = m.histogram("request_num_preemptions", tenant=t)
        assert suffered.bucket_counts == _buckets([o.num_preemptions for o in mine])
        assert suffered.sum == sum(o.num_preemptions for o in mine)
        caused = m.histogram("request_num_preemptions_caused", tenant=t)
        assert caused.bucket_counts == _buckets([o.num_preemptions_caused for o in mine])
        assert m.counter("generation_tokens", tenant=t) == sum(len(o.token_ids) for o in mine)
        assert m.counter("prompt_tokens", tenant=t) == sum(len(o.prompt_token_ids) for o in mine)
        by_reason = Counter(o.finish_reason for o in mine)
        assert {p.attributes["finished_reason"]: p.value for p in m.points("request_success", tenant=t)} == by_reason
        for key in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
            assert m.point(key, tenant=t).count == len(mine), key
        assert m.point("inter_token_latency_seconds", tenant=t).count == sum(len(o.token_ids) - 1 for o in mine)
    # Series that are not per tenant carry no tenant label.
    assert all("tenant" not in p.attributes for p in m.points("num_preemptions"))
    assert all("tenant" not in p.attributes for p in m.points("request_prefill_time_seconds"))


@PATHS
def test_summed_over_tenant_every_series_equals_the_one_without_a_tenant_source(metric_path: str) -> None:
    with_tenants, outputs = _run("priority", metric_path)
    without, same = _run(None, metric_path)
    assert {rid: o.preempted_by for rid, o in outputs.items()} == {rid: o.preempted_by for rid, o in same.items()}
    a, b = with_tenants.metrics(), without.metrics()
    for key in (
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "num_preemptions",
    ):
        assert a.counter(key) == b.counter(key), key
    for key in ("request_num_preemptions", "request_num_preemptions_caused"):
        summed = [sum(col) for col in zip(*(h.bucket_counts for h in a.histograms(key)))]
        assert summed == list(b.histogram(key).bucket_counts), key
    for key in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert sum(p.count for p in a.points(key)) == b.point(key).count, key
    # Without a source: no tenant label anywhere, no series of the tenant source's own.
    assert not b.points("num_preemptions_by_tenant") and not b.points("aborted_generation_tokens")
    assert all("tenant" not in p.attributes for points in b.values() for p in points)


def test_spans_and_links_carry_the_tenants() -> None:
    r, outputs = _run("lora", "in_process")
    tenant = {rid: ("tiny" if int(rid[4:]) % 3 == 0 else f"adapter-{int(rid[4:]) % 3}") for rid in outputs}
    spans = {rid: r.span(rid) for rid in outputs}
    contexts = {spans[rid].context.span_id: rid for rid in outputs}
    for rid, o in outputs.items():
        assert attrs(spans[rid].attributes)["llm.tenant"] == tenant[rid]
        linked = [
            (attrs(link.attributes)["llm.cause.tenant"], contexts[link.context.span_id]) for link in spans[rid].links
        ]
        assert linked == [(tenant[c], c) for c in o.preempted_by if c != rid], rid
    assert {p.attributes["tenant"] for p in r.metrics().points("request_num_preemptions")} == {
        "tiny",
        "adapter-1",
        "adapter-2",
    }


def test_aborted_requests_count_the_tokens_they_produced_per_tenant() -> None:
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", tenant="priority"))
    engine = _engine()
    engine.hooks.subscribe(r.telemetry)
    _add(engine, 6)
    for _ in range(12):
        engine.step()
    produced = {}
    for rid in ("req-001", "req-004", "req-002"):
        produced[rid] = engine._requests[rid].num_output_tokens
        assert engine.abort_request(rid)
    engine.run()
    r.telemetry.flush()
    m = r.metrics()
    assert produced["req-001"] + produced["req-004"] > 0
    assert m.counter("aborted_generation_tokens", tenant="1") == produced["req-001"] + produced["req-004"]
    assert m.counter("aborted_generation_tokens", tenant="2") == produced["req-002"]
    assert m.counter("aborted_generation_tokens", tenant="0") == 0
    assert m.counter("request_success", tenant="1", finished_reason="abort") == 2


def test_beyond_the_cap_tenants_are_other_said_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    r, outputs = _run("priority", "in_process", tenant_max_values=2)
    m = r.metrics()
    counts = Counter(str(int(rid[4:]) % 3) for rid in outputs)
    assert {p.attributes["tenant"]: p.count for p in m.points("request_num_preemptions")} == {
        "0": counts["0"],
        "1": counts["1"],
        "other": counts["2"],
    }
    assert sum("OTEL_LLM_TENANT_MAX_VALUES" in rec.getMessage() for rec in caplog.records) == 1


def test_baggage_values_too_long_or_not_printable_ascii_are_invalid() -> None:
    values = ["team-a", "x" * 64, "x" * 65, "caf%C3%A9", "tab%09in", "team-a"]
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", tenant="baggage:tenant"))
    engine = _engine("fcfs")
    engine.hooks.subscribe(r.telemetry)
    _add(engine, len(values), carrier=lambda i: {"baggage": f"other=1,tenant={values[i]};prop=2"})
    outputs = engine.run()
    r.telemetry.flush()
    got = {o.request_id: attrs(r.span(o.request_id).attributes)["llm.tenant"] for o in outputs}
    assert got == {
        "req-000": "team-a",
        "req-001": "x" * 64,
        "req-002": "invalid",
        "req-003": "invalid",
        "req-004": "invalid",
        "req-005": "team-a",
    }


def test_a_source_engine_stub_cannot_hand_over_is_refused_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    from otel_llm.integrations.engine_stub import register

    caplog.set_level(logging.WARNING)
    engine = _engine("fcfs")
    reader = InMemoryMetricReader()
    config = TelemetryConfig(
        model_name="tiny", tenant="header:X-Tenant", metrics_exporters=("none",), traces_exporters=("none",)
    )
    handle = register(engine, config, extra_metric_readers=[reader])
    try:
        _add(engine, 4)
        engine.run()
        handle.force_flush()
        m = collect_metrics(reader)
        assert handle.telemetry.config.tenant is None
        assert m.counter("request_success") == 4
        assert all("tenant" not in p.attributes for points in m.values() for p in points)
        refusals = [rec.getMessage() for rec in caplog.records if "OTEL_LLM_TENANT" in rec.getMessage()]
        assert refusals == [
            "otel_llm: OTEL_LLM_TENANT=header:x-tenant does not reach engine_stub, which hands over "
            "priority, lora, model, baggage: no tenant label on any series"
        ]
    finally:
        handle.shutdown()


@PATHS
def test_exemplars_on_a_tenants_series_lead_to_its_own_requests_traces(metric_path: str) -> None:
    r, outputs = _run("priority", metric_path)
    tenant_of_trace = {r.span(rid).context.trace_id: str(int(rid[4:]) % 3) for rid in outputs}
    m = r.metrics()
    for key in ("request_num_preemptions", "e2e_request_latency_seconds", "time_to_first_token_seconds"):
        for t in ("0", "1", "2"):
            exemplars = m.point(key, tenant=t).exemplars
            assert exemplars, (key, t)
            assert {tenant_of_trace[e.trace_id] for e in exemplars} == {t}, (key, t)
