"""The tenant setting and the resolver: sources parsed once with one clear error, values taken
from what an engine hands over, cleaned (``invalid``, ``unset``) and capped (``other``)."""

from __future__ import annotations

import pytest

from otel_llm import TelemetryConfig
from otel_llm.config.tenants import parse_source
from otel_llm.core.tenants import TenantResolver, baggage_entry


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("priority", "priority"),
        (" LoRA ", "lora"),
        ("model", "model"),
        ("header:X-Tenant", "header:x-tenant"),
        ("baggage:tenant.id", "baggage:tenant.id"),
    ],
)
def test_sources_parse_to_one_normal_form(text: str, normal: str) -> None:
    assert TelemetryConfig(tenant=text).tenant == normal
    assert TelemetryConfig.from_env({"OTEL_LLM_TENANT": text}).tenant == normal


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("user", "tenant: 'user' must be one of priority, lora, model, header:NAME, baggage:KEY (got kind 'user')"),
        ("header:", "tenant: 'header:' header: needs a name after the colon"),
        ("baggage:a b", "tenant: 'baggage:a b' baggage: needs a name after the colon"),
        ("priority:high", "tenant: 'priority:high' priority takes no name after a colon"),
    ],
)
def test_a_bad_source_is_one_error_naming_the_variable(value: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        TelemetryConfig.from_env({"OTEL_LLM_TENANT": value})
    assert str(info.value).startswith(f"OTEL_LLM_TENANT={value!r}: {message}")


def test_the_cap_must_be_a_positive_integer() -> None:
    assert TelemetryConfig().tenant_max_values == 20
    assert TelemetryConfig.from_env({"OTEL_LLM_TENANT_MAX_VALUES": "3"}).tenant_max_values == 3
    with pytest.raises(
        ValueError, match=r"^OTEL_LLM_TENANT_MAX_VALUES='0': tenant_max_values: 0 must be an integer >= 1"
    ):
        TelemetryConfig.from_env({"OTEL_LLM_TENANT_MAX_VALUES": "0"})


def test_each_source_takes_its_fact() -> None:
    facts = {"priority": 2, "lora": "a1", "model": "served", "header:x-tenant": "acme"}
    carrier = {"baggage": "k=v%20w;p=1, tenant = team-b"}
    got = {
        text: TenantResolver(parse_source(text), 20, "tiny").resolve(facts, carrier)
        for text in ("priority", "lora", "model", "header:X-Tenant", "baggage:tenant", "baggage:k", "baggage:nope")
    }
    assert got == {
        "priority": "2",
        "lora": "a1",
        "model": "served",
        "header:X-Tenant": "acme",
        "baggage:tenant": "team-b",
        "baggage:k": "v w",
        "baggage:nope": "unset",
    }
    # A base-model request (no adapter) counts as the served model; no model fact: the config's.
    assert TenantResolver(parse_source("lora"), 20, "tiny").resolve({"model": "served"}, None) == "served"
    assert TenantResolver(parse_source("lora"), 20, "tiny").resolve(None, None) == "tiny"


def test_reserved_values_do_not_use_up_the_cap() -> None:
    resolve = TenantResolver(parse_source("header:t"), 1, "tiny").resolve
    assert [resolve({"header:t": v}, None) for v in ("", "é", "a", "b", "a", None)] == [
        "unset",
        "invalid",
        "a",
        "other",
        "a",
        "unset",
    ]


def test_baggage_entry_reads_w3c_members() -> None:
    assert baggage_entry("a=1,b=2;x", "b") == "2"
    assert baggage_entry("", "b") is None
    assert baggage_entry("novalue,b", "b") is None


class _Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no")


def test_what_an_engine_hands_over_never_raises() -> None:
    resolve = TenantResolver(parse_source("priority"), 20, "tiny").resolve
    assert resolve(["not", "a", "mapping"], None) == "unset"  # type: ignore[arg-type]
    assert resolve({"priority": _Unprintable()}, None) == "invalid"
    assert TenantResolver(parse_source("baggage:k"), 20, "tiny").resolve(None, "k=v") == "unset"  # type: ignore[arg-type]


@pytest.mark.parametrize("metric_path", ["in_process", "sdk"])
def test_ten_thousand_distinct_header_values_stay_within_the_cap(metric_path: str) -> None:
    import dataclasses

    from otel_llm.testing import in_memory_telemetry
    from otel_llm.testing.synthetic import lifecycle

    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", tenant="header:x-team"), metric_path=metric_path)
    n = 10_000
    for i in range(n):
        events = lifecycle(f"r{i}", float(i), preemptions=i % 2)
        events[0] = dataclasses.replace(events[0], tenant_facts={"header:x-team": f"team-{i}"})
        r.telemetry.on_events(events)
    m = r.metrics()
    by_tenant = {p.attributes["tenant"]: p.value for p in m.points("request_success")}
    assert by_tenant == {**{f"team-{i}": 1 for i in range(20)}, "other": n - 20}
    assert {p.attributes["tenant"] for p in m.points("request_num_preemptions")} == set(by_tenant)
    matrix = {
        (p.attributes["tenant"], p.attributes["cause_tenant"]): p.value for p in m.points("num_preemptions_by_tenant")
    }
    assert matrix == {**{(f"team-{i}", "none"): 1 for i in range(1, 20, 2)}, ("other", "none"): (n - 20) // 2}
