"""The deep hook, on by default: one ``preempted`` span event per PREEMPTED EngineCoreEvent, at its
timestamp; the exact preempted time; a guarded fallback when it cannot attach; off when told."""

from __future__ import annotations

import logging
import time

import pytest
from samples import otel_samples, plugin_manager

from otel_llm.testing.vllm.stream import build, default_specs, run


def _spans_by_request(o):
    return {s.attributes["gen_ai.request.id"]: s for s in o.spans.get_finished_spans()}


def test_deep_hook_puts_a_span_event_at_each_preemption(otel, vllm_config, monkeypatch):
    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    o = otel()
    manager, ours = plugin_manager(vllm_config)
    from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook

    assert vllm_deep_hook.is_installed()
    script = build(default_specs(), time.monotonic(), time.time())
    run(manager, {0: script})

    tel = ours.telemetry[0]
    spans = _spans_by_request(o)
    assert sorted(spans) == sorted(s.rid for s in script.specs)
    total_events = 0
    for spec in script.specs:
        span = spans[spec.rid]
        events = [e for e in span.events if e.name == "preempted"]
        assert span.attributes["llm.request.num_preemptions"] == spec.num_preemptions
        assert len(events) == spec.num_preemptions == len(script.preempted_at[spec.rid])
        assert [e.timestamp for e in events] == [tel.spans.wall_ns(ts) for ts in script.preempted_at[spec.rid]]
        assert [e.attributes["ordinal"] for e in events] == list(range(1, spec.num_preemptions + 1))
        assert all(e.attributes["reason"] == "kv_cache_full" for e in events)
        total_events += len(events)
        # The span covers the request: from vLLM's (wall-clock) arrival to the finishing iteration.
        arrival_wall = script.w0 + spec.arrive * 0.1
        assert abs(span.start_time / 1e9 - arrival_wall) < 1e-3
        if spec.num_preemptions:
            assert span.attributes["llm.request.preempted_time"] == pytest.approx(
                script.preempted_time[spec.rid], abs=1e-9
            )
    assert total_events == 11

    # The preempted-time histogram is exact: one observation per preempted request.
    model = vllm_config.model_config.served_model_name
    e0 = frozenset({"model_name": model, "engine": "0"}.items())
    got = otel_samples(o.reader, {"vllm:request_preempted_time_seconds"})
    preempted = [spec.rid for spec in script.specs if spec.num_preemptions]
    assert got[("vllm:request_preempted_time_seconds_count", e0)] == len(preempted) == 4
    assert got[("vllm:request_preempted_time_seconds_sum", e0)] == pytest.approx(
        sum(script.preempted_time[r] for r in preempted), abs=1e-9
    )
    assert ours.field_warnings == frozenset()


@pytest.mark.parametrize("off", ["0", "off"])
def test_without_deep_hook_spans_carry_the_exact_count_only(otel, vllm_config, monkeypatch, off):
    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", off)
    o = otel()
    manager, _ = plugin_manager(vllm_config)
    from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook

    assert not vllm_deep_hook.is_installed()
    script = build(default_specs(), time.monotonic(), time.time())
    run(manager, {0: script})
    spans = _spans_by_request(o)
    for spec in script.specs:
        assert spans[spec.rid].attributes["llm.request.num_preemptions"] == spec.num_preemptions
        assert [e for e in spans[spec.rid].events if e.name == "preempted"] == []
        assert "llm.request.preempted_time" not in spans[spec.rid].attributes
    # Preempted time unknown: not observed at all (rather than a wrong zero).
    assert otel_samples(o.reader, {"vllm:request_preempted_time_seconds"}) == {}


@pytest.mark.parametrize("version", ["0.99.0", "1.0.0rc2.dev7+gabc", "not-a-version"])
def test_deep_hook_attaches_by_structure_on_a_release_ci_does_not_prove(
    otel, vllm_config, monkeypatch, caplog, version
):
    """Whatever the version string says, the checks decide: one info line names the release."""
    import vllm

    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    monkeypatch.setattr(vllm, "__version__", version)
    o = otel()
    with caplog.at_level(logging.INFO, logger="otel_llm.integrations.vllm.frontend.deep_hook"):
        manager, _ = plugin_manager(vllm_config)
        plugin_manager(vllm_config)  # a second logger: no second line
    lines = [r for r in caplog.records if r.name == "otel_llm.integrations.vllm.frontend.deep_hook"]
    assert [r.levelno for r in lines] == [logging.INFO]
    assert f"vLLM {version} is not among the releases CI proves" in lines[0].getMessage()
    script = build(default_specs()[:3], time.monotonic(), time.time())
    run(manager, {0: script})
    spans = _spans_by_request(o)
    assert spans["r1"].attributes["llm.request.num_preemptions"] == 1
    assert [e.attributes["ordinal"] for e in spans["r1"].events if e.name == "preempted"] == [1]


def test_deep_hook_is_on_by_default_and_says_what_it_does_in_one_line(otel, vllm_config, monkeypatch, caplog):
    """Unset, the deep hook attaches; on a proven release its one line says what it gives and how
    to turn it off, nothing of the release."""
    from otel_llm.integrations.vllm import package
    from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook

    monkeypatch.delenv("OTEL_LLM_VLLM_DEEP_HOOK")
    otel()
    with caplog.at_level(logging.INFO, logger="otel_llm.integrations.vllm.frontend.deep_hook"):
        plugin_manager(vllm_config)
    assert vllm_deep_hook.is_installed()
    lines = [r.getMessage() for r in caplog.records if r.name == "otel_llm.integrations.vllm.frontend.deep_hook"]
    assert package.proven(package.installed())
    assert lines == [
        "otel-llm deep hook: attached to vLLM's IterationStats: a span event at each preemption with its time "
        "and cause, the caller's traceparent, spans for aborted and cut-off requests "
        "(OTEL_LLM_VLLM_DEEP_HOOK=0 turns it off)"
    ]


def test_deep_hook_refuses_a_changed_shape(otel, vllm_config, monkeypatch, caplog):
    from vllm.v1.metrics.stats import IterationStats

    def update_from_events(self, events, req_stats):  # a future vLLM's signature
        pass

    monkeypatch.setattr(IterationStats, "update_from_events", update_from_events)
    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook

    with caplog.at_level(logging.WARNING, logger="otel_llm.integrations.vllm.frontend.deep_hook"):
        assert vllm_deep_hook.install() is False
        assert vllm_deep_hook.install() is False
    warnings = [r for r in caplog.records if r.name == "otel_llm.integrations.vllm.frontend.deep_hook"]
    assert len(warnings) == 1 and "update_from_events has parameters" in warnings[0].getMessage()
    assert IterationStats.update_from_events is update_from_events


def test_general_plugin_entry_point_installs_only_when_enabled(monkeypatch):
    from vllm.plugins import load_plugins_by_group
    from vllm.v1.metrics.stats import IterationStats

    from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook

    register = load_plugins_by_group("vllm.general_plugins")["otel_llm_deep_hook"]
    try:
        register()
        assert not vllm_deep_hook.is_installed()
        monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
        register()
        register()  # idempotent
        assert vllm_deep_hook.is_installed()
        assert IterationStats.update_from_events.__wrapped__.__qualname__ == "IterationStats.update_from_events"
        assert not hasattr(IterationStats.update_from_events.__wrapped__, "__wrapped__")
    finally:
        vllm_deep_hook.uninstall()
    assert not hasattr(IterationStats.update_from_events, "__wrapped__")


@pytest.mark.parametrize("fault", ["shutdown", "engine_dead"])
def test_requests_in_flight_when_vllm_stops_or_its_engine_dies_get_one_span_each(otel, vllm_config, monkeypatch, fault):
    """Stopped mid-script: the requests in flight end with what was known (their preemptions so
    far, their tokens), marked with why; those that finished keep their ordinary span; nothing is
    counted in vLLM's metrics for them, and a later abort of the same requests adds nothing."""
    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    o = otel()
    manager, ours = plugin_manager(vllm_config)
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    script = build(default_specs(), time.monotonic(), time.time())
    steps = 12
    processor = run(manager, {0: script}, steps=steps)
    in_flight = sorted(processor.request_states)
    finished = sorted(s.rid for s in script.specs if s.rid not in in_flight and s.arrive < steps)
    assert in_flight and finished  # the cut falls mid-load
    if fault == "shutdown":
        llm = AsyncLLM.__new__(AsyncLLM)  # only what AsyncLLM.shutdown reads
        llm.output_processor = processor
        llm.shutdown()
    else:
        errors = []
        for state in processor.request_states.values():
            state.queue = type("Stream", (), {"put": staticmethod(errors.append)})()  # a generate() stream
        processor.propagate_error(EngineDeadError())
        assert len(errors) == len(in_flight)  # vLLM's own propagation still ran
    processor.abort_requests(in_flight, internal=True)  # as vLLM's streams do as they end
    ours.log()  # a later stat-logger call finds nothing more to end

    spans = _spans_by_request(o)
    assert sorted(spans) == sorted(in_flight + finished)
    tel = ours.telemetry[0]
    for rid in finished:
        assert "llm.request.incomplete" not in spans[rid].attributes
    for rid in in_flight:
        span = spans[rid]
        seen = [o for step, outs in script.outputs.items() if step < steps for o in outs if o.rid == rid]
        preempted_so_far = [ts for o in seen for name, ts in o.events if name == "PREEMPTED"]
        events = [e for e in span.events if e.name == "preempted"]
        assert [e.timestamp for e in events] == [tel.spans.wall_ns(ts) for ts in preempted_so_far]
        assert span.attributes["llm.request.num_preemptions"] == len(preempted_so_far)
        assert span.attributes["gen_ai.usage.output_tokens"] == len(seen)
        assert span.attributes["llm.request.incomplete"] == fault
        assert span.status.status_code.name == "ERROR"
        if fault == "engine_dead":
            assert span.attributes["error.type"] == "EngineDeadError"
            assert span.attributes["gen_ai.response.finish_reasons"] == ("error",)
        else:
            assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    success = otel_samples(o.reader, {"vllm:request_success"})
    assert sum(v for (name, _), v in success.items() if name == "vllm:request_success_total") == len(finished)


def test_the_stat_loggers_hear_of_an_llm_shutdown_once(monkeypatch):
    """vLLM's finalizer shuts an AsyncLLM down again after its explicit shutdown, maybe while
    another AsyncLLM of the process runs (the garbage collector finalizing the old one): the
    listeners are told of the first shutdown only, each AsyncLLM's own."""
    import gc

    from vllm.v1.engine.async_llm import AsyncLLM

    from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook

    class Listener:
        calls = 0

        def stopped(self):
            self.calls += 1

    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    listener = Listener()
    try:
        assert vllm_deep_hook.install()
        vllm_deep_hook.listen(listener.stopped)
        old, new = AsyncLLM.__new__(AsyncLLM), AsyncLLM.__new__(AsyncLLM)  # only what shutdown reads
        old.cycle = old  # freed by the garbage collector, which clears weak references first
        old.shutdown()
        assert listener.calls == 1
        gc.disable()
        try:
            del old
            gc.collect()  # vLLM's __del__ shuts it down again
        finally:
            gc.enable()
        assert listener.calls == 1
        new.shutdown()
        new.shutdown()
        assert listener.calls == 2
    finally:
        vllm_deep_hook.uninstall()


def test_the_trace_headers_reach_the_request_passed_by_keyword_or_position(monkeypatch):
    """The headers given to AsyncLLM.add_request are what the output processor's wrapper sees, as
    vLLM passes them (by keyword) and by position; headers that are not a mapping are dropped, the
    request added all the same."""
    import asyncio
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook

    seen = []

    async def add_request(self, *args, **kwargs):  # in place of vLLM's: what the hook has set
        seen.append(vllm_deep_hook._adding_headers.get())

    add_request.__signature__ = inspect.signature(AsyncLLM.add_request)
    monkeypatch.setattr(AsyncLLM, "add_request", add_request)
    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    headers = {"traceparent": "00-0000000000000000000000000000000a-000000000000000b-01"}
    names = list(inspect.signature(AsyncLLM.add_request).parameters)
    positional = [None] * (names.index("trace_headers") - 1) + [headers]
    try:
        assert vllm_deep_hook.install()
        wrapped = AsyncLLM.add_request
        asyncio.run(wrapped(object(), "r1", None, None, trace_headers=headers))
        asyncio.run(wrapped(object(), *positional))
        asyncio.run(wrapped(object(), "r2", None, None))
        asyncio.run(wrapped(object(), "r3", None, None, trace_headers=42))
    finally:
        vllm_deep_hook.uninstall()
    assert seen == [headers, headers, None, None]
    assert vllm_deep_hook._adding_headers.get() is None


def test_the_causes_are_read_from_this_vllms_scheduler_and_another_shape_is_refused():
    """vLLM's own Scheduler has what the engine core's cause reports read (its loop's locals are
    closure cells); a scheduler whose ``schedule`` is its own code, or whose ``_preempt_request``
    takes other parameters, is refused (its causes unknown), and a call from anywhere but vLLM's
    loop reports ``unknown``, never a guessed cause."""
    import sys

    from vllm.v1.core.sched.scheduler import Scheduler

    from otel_llm.integrations.vllm.engine_core import engine_core

    assert engine_core.shape_problem(Scheduler) is None

    class OwnLoop(Scheduler):
        def schedule(self, *args, **kwargs):
            return None

    class OtherParameters(Scheduler):
        def _preempt_request(self, victim, when):
            return None

    assert "no locals" in engine_core.shape_problem(OwnLoop)
    assert "parameters" in engine_core.shape_problem(OtherParameters)

    sent = []

    class Victim:
        request_id, num_preemptions = "v-1", 1

    class Sender:
        send = sent.append

    engine_core._sender[:] = [Sender()]
    try:

        def schedule():  # named as vLLM's, without its locals
            engine_core.report(Victim(), sys._getframe(0))

        schedule()
    finally:
        engine_core._sender.clear()
    assert [(r.victim, r.ordinal, r.kind, r.causes) for r in sent] == [("v-1", 1, "unknown", ())]
