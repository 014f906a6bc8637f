"""Event batches kept for ``defer_steps`` engine steps, and applied in order: every N batches,
when the engine goes idle, when a reader collects, on flush() and on shutdown()."""

from __future__ import annotations

from typing import Any, Sequence

from otel_llm import StepStats, TelemetryConfig, setup_telemetry
from otel_llm.config.settings import DEFAULT_DEFER_STEPS
from otel_llm.testing import in_memory_telemetry, lifecycle
from tests.support.otel_helpers import E, RequestEvent, attrs

BUSY = StepStats(1.0, num_running=3, num_waiting=1)
IDLE = StepStats(2.0, num_running=0, num_waiting=0)


def test_batches_wait_for_the_nth_step_then_apply_in_order():
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", defer_steps=4))
    events = lifecycle("a", 10.0, preemptions=1, tokens=3)  # 10 events, one per batch below
    for i, event in enumerate(events[:3]):
        r.telemetry.on_events([event])
        r.telemetry.on_step(BUSY)
        assert r.telemetry.tracker.inflight == {} and len(r.telemetry._pending) == i + 1
    r.telemetry.on_events([events[3]])  # the 4th batch: all four applied, in order
    req = r.telemetry.tracker.inflight["a"]
    assert len(r.telemetry._pending) == 0 and req.num_preemptions == 1 and not req.running
    for event in events[4:]:
        r.telemetry.on_events([event])
        assert len(r.telemetry._pending) < 4  # bounded by defer_steps batches
    r.telemetry.flush()
    assert r.telemetry.tracker.inflight == {}
    assert r.point("vllm:request_num_preemptions").sum == 1


def test_a_collection_applies_pending_batches_first():
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", defer_steps=1000))
    r.telemetry.on_events(lifecycle("a", 10.0, preemptions=2))
    r.telemetry.on_events(lifecycle("b", 11.0))
    assert len(r.telemetry._pending) == 2
    point = r.point("vllm:request_num_preemptions")  # an InMemoryMetricReader collection
    assert (point.count, point.sum) == (2, 2)
    assert r.point("vllm:num_preemptions").value == 2
    assert len(r.telemetry._pending) == 0


def test_an_idle_engine_step_applies_pending_batches():
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", defer_steps=1000))
    r.telemetry.on_events(lifecycle("a", 10.0))
    r.telemetry.on_step(BUSY)
    assert len(r.telemetry._pending) == 1
    r.telemetry.on_step(IDLE)
    assert len(r.telemetry._pending) == 0
    assert [attrs(s.attributes)["gen_ai.request.id"] for s in r.span_exporter.get_finished_spans()] == ["a"]


def test_a_gauges_only_step_waits_with_the_pending_work_the_last_one_read():
    """Steps that only set gauges (no iteration's tokens) are kept, the last replacing the one
    before: a collection reads the last values set; an idle step is applied at once."""
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", defer_steps=1000))
    r.telemetry.on_step(StepStats(1.0, num_running=3, num_waiting=1))
    r.telemetry.on_step(StepStats(1.1, num_running=5, num_waiting=2))
    assert len(r.telemetry._latest_step) == 1
    assert (r.point("vllm:num_requests_running").value, r.point("vllm:num_requests_waiting").value) == (5, 2)
    assert len(r.telemetry._latest_step) == 0
    r.telemetry.on_step(StepStats(1.2, num_running=4, num_waiting=0))
    r.telemetry.on_step(IDLE)
    assert len(r.telemetry._latest_step) == 0  # applied: the engine went idle
    assert (r.point("vllm:num_requests_running").value, r.point("vllm:num_requests_waiting").value) == (0, 0)


def test_shutdown_applies_pending_batches_before_ending_open_spans():
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", defer_steps=1000))
    r.telemetry.on_events(lifecycle("done", 10.0))
    r.telemetry.on_events([RequestEvent(E.ARRIVED, "open", 11.0, prompt_tokens=3)])
    r.telemetry.shutdown()
    spans = {attrs(s.attributes)["gen_ai.request.id"]: s for s in r.span_exporter.get_finished_spans()}
    assert set(spans) == {"done", "open"}
    assert "llm.request.incomplete" not in attrs(spans["done"].attributes)
    assert attrs(spans["open"].attributes)["llm.request.incomplete"] == "shutdown"


def test_the_engine_may_reuse_its_event_list():
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", defer_steps=2))
    events = lifecycle("a", 10.0)
    batch = list(events)
    r.telemetry.on_events(batch)
    batch.clear()  # as an engine that reuses one list per step would
    r.telemetry.flush()
    assert r.point("vllm:request_success", finished_reason="stop").value == 1


def test_setup_telemetry_defers_a_hand_built_telemetry_applies_at_once():
    handle = setup_telemetry(
        TelemetryConfig(model_name="m", metrics_exporters=("none",), traces_exporters=("none",)), environ={}
    )
    try:
        assert handle.config.defer_steps == DEFAULT_DEFER_STEPS == handle.telemetry._defer_steps == 16
        assert handle.new_telemetry(engine="1")._defer_steps == 16
    finally:
        handle.shutdown()
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny"))  # as the README's API example builds it
    r.telemetry.on_events(lifecycle("a", 10.0))
    assert len(r.telemetry._pending) == 0
    assert [attrs(s.attributes)["gen_ai.request.id"] for s in r.span_exporter.get_finished_spans()] == ["a"]


def test_an_adapters_kept_steps_are_translated_in_order_with_the_event_batches():
    """The steps kept in a row go to the translator in one call; it records through the
    telemetry's own methods, which take the lock the pending work is applied under."""
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", defer_steps=4))
    calls: list[list[int]] = []

    def translate(telemetry: Any, steps: Sequence[int]) -> None:
        calls.append(list(steps))
        for tokens in steps:
            telemetry.record_iteration(generation_tokens=tokens, num_preemptions=1)

    r.telemetry.translate_steps_with(translate)
    r.telemetry.keep_step(2)
    r.telemetry.keep_step(3)
    r.telemetry.on_events(lifecycle("a", 10.0, tokens=4))
    assert calls == [] and len(r.telemetry._pending) == 3
    r.telemetry.keep_step(5)  # the 4th: all applied, in order
    assert calls == [[2, 3], [5]] and len(r.telemetry._pending) == 0
    assert r.counter("generation_tokens") == 2 + 3 + 4 + 5
    assert r.counter("num_preemptions") == 3


def test_an_idle_kept_step_applies_everything_and_a_failing_batch_is_counted_per_step():
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", defer_steps=1000))
    r.telemetry.on_events(lifecycle("a", 10.0))

    def translate(telemetry: Any, steps: Sequence[int]) -> None:
        if 0 in steps:
            raise RuntimeError("adapter bug")
        telemetry.record_iteration(generation_tokens=sum(steps))

    r.telemetry.translate_steps_with(translate)
    r.telemetry.keep_step(0)
    r.telemetry.keep_step(7)  # lost with the failing one: translated together
    r.telemetry.on_events(lifecycle("b", 11.0))
    r.telemetry.keep_step(3)
    assert len(r.telemetry._pending) == 5
    r.telemetry.keep_step(1, idle=True)
    assert len(r.telemetry._pending) == 0
    assert sorted(attrs(s.attributes)["gen_ai.request.id"] for s in r.span_exporter.get_finished_spans()) == ["a", "b"]
    assert r.counter("dropped_events", reason="internal_error") == 2
    assert r.counter("generation_tokens") == 3 + 3 + 3 + 1  # the requests' 3 each, then the steps'


def test_steps_kept_without_a_translator_are_counted_not_raised():
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", defer_steps=1))
    r.telemetry.keep_step("a step")
    assert r.counter("dropped_events", reason="internal_error") == 1
