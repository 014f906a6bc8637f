"""Tenants under vLLM's Python frontend: a scripted engine-core stream through vLLM's real
OutputProcessor and StatLoggerManager, the deep hook on, with the engine core's cause records
written as its scheduler would (the script says who preempted whom). Each request's priority and
LoRA adapter reach its summary; its tenant's series and the tenant matrix equal the script."""

from __future__ import annotations

import collections
import tempfile
import time
from typing import Any, Iterator, Optional

import pytest
from samples import otel_samples, plugin_manager

from otel_llm.config.tenants import SOURCES_BY_ENTRY_POINT
from otel_llm.events import CAUSE_REQUEST, CAUSE_SELF
from otel_llm.integrations.vllm.channels import cause_channel
from otel_llm.integrations.vllm.channels.cause_channel import CauseRecord
from otel_llm.integrations.vllm.frontend import attribution
from otel_llm.integrations.vllm.handle import ENTRY_POINT
from otel_llm.testing.vllm.stream import Script, build, default_specs, run

TENANTS = ("0", "1", "2")
UNREPORTED = "r1b"  # its preemption comes with no cause record


@pytest.fixture
def causes(monkeypatch: pytest.MonkeyPatch) -> Iterator[cause_channel.Sender]:
    """This API server's cause channel of its own (made when the stat logger starts), and the
    engine core's end of it."""
    folder = tempfile.mkdtemp(prefix="otel-llm-causes-")
    monkeypatch.setenv(cause_channel.ENV, folder)
    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    monkeypatch.setattr(attribution, "_receiver", [])
    monkeypatch.setattr(attribution, "_told", [0])
    yield cause_channel.Sender(folder)
    for receiver in attribution._receiver:
        receiver.close()


class Scheduler:
    """Who preempted whom in the script: at each PREEMPTED event, before the output that carries
    it, the cause record the engine core would have written (a request of the lowest priority
    value still running after this step; the victim's own preemption every third time; none
    for :data:`UNREPORTED`, whose cause stays unknown)."""

    def __init__(self, script: Script, sender: cause_channel.Sender) -> None:
        self.script = script
        self.sender = sender
        self.ordinals: collections.Counter[str] = collections.Counter()
        self.record: list[tuple[str, Optional[str]]] = []  # (victim, cause or None), in order

    def __call__(self, step: int) -> None:
        specs = self.script.specs
        for out in self.script.outputs.get(step, []):
            for name, _ in out.events:
                if name != "PREEMPTED":
                    continue
                victim = out.rid
                self.ordinals[victim] += 1
                ordinal = self.ordinals[victim]
                if victim == UNREPORTED:
                    self.record.append((victim, None))
                    continue
                running = [
                    s for s in specs if s.rid != victim and s.arrive <= step and self.script.finish_step[s.rid] > step
                ]
                cause = (
                    victim if ordinal % 3 == 0 or not running else min(running, key=lambda s: (s.priority, s.rid)).rid
                )
                kind = CAUSE_SELF if cause == victim else CAUSE_REQUEST
                self.sender.send(CauseRecord(victim, ordinal, kind, (cause,)))
                self.record.append((victim, cause))


def _by_tenant(samples: dict[Any, float], name: str) -> dict[tuple[str, Any], float]:
    """``{(tenant, le or None): value}`` of one sample name's points with a tenant."""
    return {
        (labels["tenant"], labels.get("le")): v
        for k, v in samples.items()
        if k[0] == name and "tenant" in (labels := dict(k[1]))
    }


def test_per_tenant_series_and_the_matrix_equal_the_script(
    otel: Any, vllm_config: Any, causes: cause_channel.Sender
) -> None:
    o = otel(tenant_sources=SOURCES_BY_ENTRY_POINT[ENTRY_POINT], tenant="priority")
    manager, _ = plugin_manager(vllm_config)
    specs = default_specs()
    for i, spec in enumerate(specs):
        spec.priority = i % 3
    script = build(specs, time.monotonic(), time.time())
    scheduler = Scheduler(script, causes)
    run(manager, {0: script}, before_outputs=scheduler)

    tenant = {s.rid: str(s.priority) for s in specs}
    matrix = collections.Counter(
        (tenant[victim], tenant[cause] if cause is not None else "none") for victim, cause in scheduler.record
    )
    assert sum(matrix.values()) == sum(s.num_preemptions for s in specs) == 11
    assert matrix[(tenant[UNREPORTED], "none")] == 1
    assert {v for v, c in matrix if c not in (v, "none")}  # the classes preempt each other
    families = {
        "vllm:num_preemptions_by_tenant",
        "vllm:request_num_preemptions",
        "vllm:request_success",
        "vllm:e2e_request_latency_seconds",
    }
    samples = otel_samples(o.reader, families)
    assert {
        (dict(k[1])["tenant"], dict(k[1])["cause_tenant"]): v
        for k, v in samples.items()
        if k[0] == "vllm:num_preemptions_by_tenant_total"
    } == dict(matrix)
    # The series vLLM creates at start, at zero, keep no observation: every one has a tenant.
    assert {v for k, v in samples.items() if "tenant" not in dict(k[1]) and "cause_tenant" not in dict(k[1])} == {0.0}
    histogram = _by_tenant(samples, "vllm:request_num_preemptions_bucket")
    bounds = sorted({le for _, le in histogram})
    assert histogram == {
        (t, le): sum(s.num_preemptions <= le for s in specs if tenant[s.rid] == t) for t in TENANTS for le in bounds
    }
    assert _by_tenant(samples, "vllm:e2e_request_latency_seconds_count") == {
        (t, None): sum(tenant[s.rid] == t for s in specs) for t in TENANTS
    }
    success = collections.Counter(
        (dict(k[1])["tenant"], dict(k[1])["finished_reason"])
        for k, v in samples.items()
        if k[0] == "vllm:request_success_total"
        for _ in range(int(v))
    )
    assert success == collections.Counter((tenant[s.rid], s.finish) for s in specs)
    spans = {s.attributes["gen_ai.request.id"]: s for s in o.spans.get_finished_spans()}
    assert {rid: s.attributes["llm.tenant"] for rid, s in spans.items()} == tenant
    links = collections.Counter(
        (tenant[rid], link.attributes["llm.cause.tenant"]) for rid, s in spans.items() for link in s.links
    )
    assert links == collections.Counter((tenant[v], tenant[c]) for v, c in scheduler.record if c is not None and c != v)


def test_the_adapter_reaches_the_span_and_a_base_model_request_is_the_served_model(
    otel: Any, vllm_config: Any, causes: cause_channel.Sender
) -> None:
    o = otel(tenant_sources=SOURCES_BY_ENTRY_POINT[ENTRY_POINT], tenant="lora")
    manager, _ = plugin_manager(vllm_config)
    specs = default_specs()
    for spec in specs[:3]:
        spec.lora = f"team-{spec.rid}"
    run(manager, {0: build(specs, time.monotonic(), time.time())})
    served = vllm_config.model_config.served_model_name
    spans = {s.attributes["gen_ai.request.id"]: s for s in o.spans.get_finished_spans()}
    assert {rid: s.attributes["llm.tenant"] for rid, s in spans.items()} == {s.rid: s.lora or served for s in specs}


def test_a_header_or_baggage_source_is_refused_under_the_python_frontend(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM hands its engine only traceparent and tracestate: no header nor baggage reaches the
    stat-logger path; such a source is refused with one warning, the telemetry runs without it."""
    import otel_llm
    from otel_llm.integrations.vllm import handle

    for source, kept in (("header:x-team", None), ("baggage:team", None), ("priority", "priority")):
        caplog.clear()
        config = otel_llm.TelemetryConfig(metrics_exporters=("none",), traces_exporters=("none",), tenant=source)
        built = handle.setup(config, ())
        try:
            assert built.config.tenant == kept
            refusals = [r.getMessage() for r in caplog.records if "does not reach" in r.getMessage()]
            assert refusals == (
                []
                if kept
                else [
                    f"otel_llm: OTEL_LLM_TENANT={source} does not reach vllm, which hands over priority, lora, "
                    "model: no tenant label on any series"
                ]
            )
        finally:
            built.shutdown()
