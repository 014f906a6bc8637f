"""Tenants under vLLM's Python frontend: a scripted engine-core stream through vLLM's real
OutputProcessor and StatLoggerManager, the deep hook on, with the engine core's cause records
written as its scheduler would (the script says who preempted whom). Each request's priority and
LoRA adapter reach its summary; its tenant's series and the tenant matrix equal the script."""

from __future__ import annotations

import collections
import tempfile
import time
import urllib.request
from typing import Any, Iterator, Optional

import pytest
from samples import otel_samples, plugin_manager, vllm_samples

from otel_llm.config.tenants import SOURCES_BY_ENTRY_POINT
from otel_llm.events import CAUSE_REQUEST, CAUSE_SELF
from otel_llm.integrations.vllm.channels import cause_channel
from otel_llm.integrations.vllm.channels.cause_channel import CauseRecord
from otel_llm.integrations.vllm.frontend import attribution
from otel_llm.integrations.vllm.handle import ENTRY_POINT
from otel_llm.testing.vllm.stream import DT, Script, build, default_specs, run

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


def _three_classes() -> list[Any]:
    """The default script's requests in three priority classes, by turns."""
    specs = default_specs()
    for i, spec in enumerate(specs):
        spec.priority = i % 3
    return specs


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
    specs = _three_classes()
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


STEP_FAMILIES = {
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
}


def _latencies(script: Script) -> dict[str, tuple[list[float], list[float]]]:
    """Each request's time to first token and inter-token latencies, computed as vLLM's
    IterationStats computes them from the script's timestamps."""
    steps: dict[str, list[int]] = collections.defaultdict(list)
    for step in sorted(script.outputs):
        for out in script.outputs[step]:
            steps[out.rid].append(step)
    out = {}
    for spec in script.specs:
        first, *rest = steps[spec.rid]
        ttft = (script.w0 + first * DT + 0.0505) - (script.w0 + spec.arrive * DT)
        its = [script.output_ts(b) - script.output_ts(a) for a, b in zip(steps[spec.rid], rest)]
        out[spec.rid] = ([ttft], its)
    return out


def _unlabelled(samples: dict[Any, float]) -> dict[tuple[str, Any], float]:
    """``{(sample name, le or None): value}`` summed over every other label but the model's and engine's."""
    out: dict[tuple[str, Any], float] = collections.defaultdict(float)
    for (name, labels), value in samples.items():
        out[(name, dict(labels).get("le"))] += value
    return dict(out)


@pytest.mark.parametrize("source", ["priority", "lora"])
def test_per_step_latencies_and_tokens_are_per_tenant_and_sum_to_vllms(
    source: str, otel: Any, vllm_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Time to first token, inter-token latency and the prompt and generation token counters, which
    vLLM keeps per step without naming a request: each value under the tenant of the request it
    came from (bucket by bucket, count and sum, as computed from the script), and summed over
    tenant, vLLM's own logger's values."""
    from vllm.v1.metrics.stats import IterationStats

    from otel_llm.integrations.vllm.frontend import deep_hook

    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    o = otel(tenant_sources=SOURCES_BY_ENTRY_POINT[ENTRY_POINT], tenant=source)
    manager, ours = plugin_manager(vllm_config)
    assert getattr(IterationStats.update_from_output, deep_hook._MARK, False)
    specs = default_specs()
    for i, spec in enumerate(specs):
        spec.priority, spec.lora = i % 3, f"adapter-{i % 2}" if i % 3 else None
    script = build(specs, time.monotonic(), time.time())
    run(manager, {0: script})
    served = vllm_config.model_config.served_model_name
    tenant = {s.rid: str(s.priority) if source == "priority" else s.lora or served for s in specs}
    tenants = sorted(set(tenant.values()))
    assert len(tenants) == 3
    latencies = _latencies(script)
    samples = otel_samples(o.reader, STEP_FAMILIES)
    for family, which in (("vllm:time_to_first_token_seconds", 0), ("vllm:inter_token_latency_seconds", 1)):
        values = {t: [v for s in specs if tenant[s.rid] == t for v in latencies[s.rid][which]] for t in tenants}
        histogram = _by_tenant(samples, family + "_bucket")
        bounds = sorted({le for _, le in histogram})
        assert histogram == {(t, le): sum(v <= le for v in values[t]) for t in tenants for le in bounds}, family
        assert _by_tenant(samples, family + "_count") == {(t, None): len(values[t]) for t in tenants}
        sums = _by_tenant(samples, family + "_sum")
        assert set(sums) == {(t, None) for t in tenants}
        for t in tenants:
            assert sums[(t, None)] == pytest.approx(sum(values[t]), abs=1e-9), (family, t)
    assert _by_tenant(samples, "vllm:prompt_tokens_total") == {
        (t, None): sum(s.prompt for s in specs if tenant[s.rid] == t) for t in tenants
    }
    assert _by_tenant(samples, "vllm:generation_tokens_total") == {
        (t, None): sum(s.tokens for s in specs if tenant[s.rid] == t) for t in tenants
    }
    # Summed over tenant, vLLM's own values; no observation left without a tenant.
    theirs = _unlabelled(vllm_samples(STEP_FAMILIES))
    summed = _unlabelled({k: v for k, v in samples.items() if "tenant" in dict(k[1])})
    assert set(summed) == set(theirs)
    for key, value in theirs.items():
        assert summed[key] == (pytest.approx(value, abs=1e-9) if key[0].endswith("_sum") else value), key
    assert {v for k, v in samples.items() if "tenant" not in dict(k[1])} <= {0.0}
    assert ours.field_warnings == frozenset()


def test_with_two_engines_each_steps_values_go_to_its_engine_and_tenant(
    otel: Any, vllm_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One stat logger recording two engines (data parallelism behind one API server): each
    step's values are taken at that step, so each engine's per-tenant series hold its own
    requests' values exactly, and summed over tenant, each engine's equal vLLM's own."""
    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    o = otel(tenant_sources=SOURCES_BY_ENTRY_POINT[ENTRY_POINT], tenant="priority")
    manager, ours = plugin_manager(vllm_config, engine_idxs=(0, 1))
    scripts = {}
    for engine in (0, 1):
        specs = default_specs(prefix=f"e{engine}-")
        for i, spec in enumerate(specs):
            spec.priority = (i + engine) % 3
        scripts[engine] = build(specs, time.monotonic(), time.time())
    run(manager, scripts)
    families = {"vllm:inter_token_latency_seconds", "vllm:time_to_first_token_seconds", "vllm:generation_tokens"}
    samples = otel_samples(o.reader, families)
    theirs = vllm_samples(families)

    def by(source: dict[Any, float], name: str, *keys: str) -> dict[tuple, float]:
        out: dict[tuple, float] = collections.defaultdict(float)
        for (n, labels), value in source.items():
            labels = dict(labels)
            if n == name and all(k in labels for k in keys):
                out[tuple(labels[k] for k in keys)] += value
        return dict(out)

    for name, which in (("vllm:inter_token_latency_seconds_count", 1), ("vllm:time_to_first_token_seconds_count", 0)):
        expected: dict[tuple, float] = collections.defaultdict(float)
        for engine, script in scripts.items():
            latencies = _latencies(script)
            for spec in script.specs:
                expected[(str(engine), str(spec.priority))] += len(latencies[spec.rid][which])
        assert by(samples, name, "engine", "tenant") == expected, name
        assert by(samples, name, "engine") == by(theirs, name, "engine"), name
    tokens = {
        (str(engine), str(p)): sum(s.tokens for s in script.specs if s.priority == p)
        for engine, script in scripts.items()
        for p in range(3)
    }
    assert by(samples, "vllm:generation_tokens_total", "engine", "tenant") == tokens
    assert ours.field_warnings == frozenset()


@pytest.mark.parametrize("tenant", [None, "model"])
def test_without_a_source_that_differs_by_request_nothing_is_taken(
    tenant: Optional[str], otel: Any, vllm_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No tenant source, or the model (every request's under this frontend): vLLM's
    IterationStats.update_from_output is not wrapped, no request carries tenant values; the
    model's values are still all under its one tenant."""
    from vllm.v1.metrics.stats import IterationStats

    from otel_llm.integrations.vllm.frontend import deep_hook, tenant_steps, traces

    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    config = {} if tenant is None else {"tenant_sources": SOURCES_BY_ENTRY_POINT[ENTRY_POINT], "tenant": tenant}
    o = otel(**config)
    manager, ours = plugin_manager(vllm_config)
    assert deep_hook.is_installed()
    assert not getattr(IterationStats.update_from_output, deep_hook._MARK, False)
    assert tenant_steps.current is None
    processor = run(manager, {0: build(default_specs(), time.monotonic(), time.time())}, steps=4)
    in_flight = [traces.trace_on(state) for state in processor.request_states.values()]
    assert in_flight and all(trace.values is None for trace in in_flight)
    samples = otel_samples(o.reader, {"vllm:generation_tokens"})
    labels = {dict(k[1]).get("tenant") for k, v in samples.items() if v}
    assert labels == ({None} if tenant is None else {vllm_config.model_config.served_model_name})
    (theirs,) = vllm_samples({"vllm:generation_tokens"}).values()
    assert sum(samples.values()) == theirs > 0


def test_a_request_aborted_without_vllms_stats_has_its_preemptions_in_the_matrix_and_its_tokens_counted(
    otel: Any, vllm_config: Any, causes: cause_channel.Sender
) -> None:
    """Requests whose client went away (vLLM's output processor aborts them: no
    FinishedRequestStats, in no vLLM request metric) were preempted before: each of those
    preemptions is in the tenant matrix under its victim's and its cause's tenant, so that the
    matrix sums to vLLM's count of every preemption; their output tokens so far are their
    tenant's aborted_generation_tokens."""
    o = otel(tenant_sources=SOURCES_BY_ENTRY_POINT[ENTRY_POINT], tenant="priority")
    manager, _ = plugin_manager(vllm_config)
    specs = _three_classes()
    script = build(specs, time.monotonic(), time.time())
    scheduler = Scheduler(script, causes)
    cut = 32  # r7's six preemptions so far reported (the seventh comes later), r2's two: r2 finished
    processor = run(manager, {0: script}, steps=cut, before_outputs=scheduler)
    in_flight = sorted(processor.request_states)
    assert in_flight == ["r0c", "r1b", "r7"]
    processor.abort_requests(in_flight, internal=False)
    manager.log()  # vLLM's periodic log: the requests ended meanwhile are recorded

    tenant = {s.rid: str(s.priority) for s in specs}
    produced = collections.Counter(out.rid for step, outs in script.outputs.items() if step < cut for out in outs)
    matrix = collections.Counter(
        (tenant[victim], tenant[cause] if cause is not None else "none") for victim, cause in scheduler.record
    )
    aborted_preemptions = [victim for victim, _ in scheduler.record if victim in in_flight]
    assert aborted_preemptions == ["r7"] * 6  # in no FinishedRequestStats
    samples = otel_samples(o.reader, {"vllm:num_preemptions_by_tenant", "vllm:aborted_generation_tokens"})
    got = {
        (dict(k[1])["tenant"], dict(k[1])["cause_tenant"]): v
        for k, v in samples.items()
        if k[0] == "vllm:num_preemptions_by_tenant_total"
    }
    assert got == dict(matrix)
    (vllm_count,) = vllm_samples({"vllm:num_preemptions"}).values()
    assert sum(got.values()) == vllm_count == len(scheduler.record)
    aborted = collections.Counter()
    for rid in in_flight:
        aborted[tenant[rid]] += produced[rid]
    tokens = {dict(k[1])["tenant"]: v for k, v in samples.items() if k[0] == "vllm:aborted_generation_tokens_total"}
    assert {t: n for t, n in tokens.items() if n} == {t: n for t, n in aborted.items() if n} == {"0": 21, "1": 7}
    spans = {s.attributes["gen_ai.request.id"]: s for s in o.spans.get_finished_spans()}
    assert sorted(spans) == sorted(tenant)


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


def _endpoint_samples(port: int) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("vllm:") and not s.name.endswith("_created")
    }


def test_beside_vllms_logger_the_per_tenant_series_are_recorded_and_the_others_read(
    vllm_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the providers the plugin builds, beside vLLM's own logger (whose per-step series it
    reads at collection): with a tenant source, the steps with request outputs are kept and their
    latencies and tokens recorded by tenant, summing to vLLM's; the other per-step series (the
    preemption counter, the iteration tokens, the gauges) are still vLLM's, read."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from otel_llm.integrations import vllm as plugin
    from otel_llm.integrations.vllm.frontend import deep_hook
    from otel_llm.integrations.vllm.frontend.adapter import Keeping

    for var, value in (
        ("OTEL_METRICS_EXPORTER", "prometheus"),
        ("OTEL_EXPORTER_PROMETHEUS_PORT", "0"),
        ("OTEL_LLM_VLLM_DEEP_HOOK", "1"),
        ("OTEL_LLM_TENANT", "priority"),
    ):
        monkeypatch.setenv(var, value)
    plugin.reset()
    unregister_vllm_metrics()
    try:
        manager, ours = plugin_manager(vllm_config)
        impl = ours._impl
        assert (impl.steps_read, impl.keeping) == (True, Keeping.ITERATIONS)
        specs = _three_classes()
        run(manager, {0: build(specs, time.monotonic(), time.time())})
        got = _endpoint_samples(impl.handle.prometheus_port)
        expected = {
            (s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(generate_latest(REGISTRY).decode())
            for s in f.samples
            if s.name.startswith("vllm:") and not s.name.endswith("_created")
        }
    finally:
        plugin.reset()
        deep_hook.uninstall()
        unregister_vllm_metrics()
    tenant = {s.rid: str(s.priority) for s in specs}
    step_names = {n for f in STEP_FAMILIES for n in (f + "_bucket", f + "_sum", f + "_count", f + "_total")}
    per_tenant = {k: v for k, v in got.items() if k[0] in step_names}
    assert {dict(k[1]).get("tenant") for k, v in per_tenant.items() if v} == {"0", "1", "2"}
    assert _by_tenant(per_tenant, "vllm:generation_tokens_total") == {
        (t, None): sum(s.tokens for s in specs if tenant[s.rid] == t) for t in ("0", "1", "2")
    }
    summed = _unlabelled({k: v for k, v in per_tenant.items() if "tenant" in dict(k[1])})
    theirs = _unlabelled({k: v for k, v in expected.items() if k[0] in step_names})
    assert set(summed) == set(theirs)
    for key, value in theirs.items():
        assert summed[key] == (pytest.approx(value, abs=1e-9) if key[0].endswith("_sum") else value), key
    read = ("vllm:num_preemptions_total", "vllm:iteration_tokens_total_sum", "vllm:num_requests_running")
    assert {k: v for k, v in got.items() if k[0] in read} == {k: v for k, v in expected.items() if k[0] in read}


def test_values_are_taken_by_tenant_and_checked_against_vllms_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's real IterationStats under the wrapper: each call's values go to its request's
    tenant, those of a request that carries no values (arrived before they were taken) to no
    tenant (None: the tenant of a request with no facts, when recorded). A take that does not
    account for vLLM's counts says so: here vLLM adds an inter-token latency no call was for
    (no release does: made here)."""
    from vllm.v1.metrics.stats import IterationStats, LoRARequestStates, RequestStateStats

    from otel_llm.integrations.vllm.frontend import tenant_steps, traces
    from otel_llm.testing.vllm.stream import Output, Spec, engine_core_output

    class Drifting(IterationStats):
        drift = False

        def update_from_output(self, output, engine_core_timestamp, is_prefilling, req_stats, *args, extra=None):
            super().update_from_output(output, engine_core_timestamp, is_prefilling, req_stats, *args)
            if self.drift and output.request_id == "b":
                self.inter_token_latencies_iter.append(9.0)

    Drifting.update_from_output = tenant_steps.wrapper(Drifting.update_from_output)
    assert Drifting.update_from_output.__name__ == "update_from_output"  # the general form
    values = tenant_steps.Tenants(lambda facts: str(facts["priority"]))
    monkeypatch.setattr(tenant_steps, "current", values)
    requests = {}
    for rid, priority, prompt in (("a", 0, 10), ("b", 1, 11), ("c", None, 12)):
        stats = RequestStateStats(arrival_time=100.0)
        trace = traces.RequestTrace()
        if priority is not None:  # c: a request that arrived before the values were taken
            trace.tenant_facts = {"priority": priority}
            trace.values = values.values_for(trace.tenant_facts)
        setattr(stats, traces.TRACE_ATTR, trace)
        requests[rid] = (Spec(rid, arrive=0, queue=0, prompt=prompt, tokens=4), stats)
    taken = []
    for step, (ts, drift, rids) in enumerate(
        ((200.0, False, "ab"), (200.5, False, "ab"), (201.25, True, "ab"), (202.0, False, "abc"))
    ):
        it = Drifting()
        it.iteration_timestamp = 100.25 + step
        it.drift = drift
        for rid in rids:
            spec, stats = requests[rid]
            first = step == (3 if rid == "c" else 0)
            out = engine_core_output(spec, Output(step, rid, [], first=first, last=step == 3))
            it.update_from_output(out, ts, first, stats, LoRARequestStates(), None)
        values.expected_ttfts += len(it.time_to_first_tokens_iter)  # as the stat logger counts them
        values.expected_itls += len(it.inter_token_latencies_iter)
        taken.append(values.take())
    assert taken == [
        ([("0", [0.25], [], 10, 1), ("1", [0.25], [], 11, 1)], True),
        ([("0", [], [0.5], 0, 1), ("1", [], [0.5], 0, 1)], True),
        ([("0", [], [0.75], 0, 1), ("1", [], [9.0], 0, 1)], False),  # the drift taken for b's: told
        ([("0", [], [0.75], 0, 1), ("1", [], [0.75], 0, 1), (None, [3.25], [], 12, 1)], True),
    ]
