"""The tracker's validation: each bad event kind is dropped, counted by reason, and harmless."""

from __future__ import annotations

import logging
from typing import cast

import pytest

from otel_llm import StepStats, TelemetryConfig
from otel_llm.testing import in_memory_telemetry, lifecycle
from tests.support.otel_helpers import E, RequestEvent, attrs

NAN = float("nan")


def dropped(r):
    return {p.attributes["reason"]: p.value for p in r.metrics().get("otel_llm.dropped_events", []) if p.value}


BAD: dict[str, list[RequestEvent]] = {
    "unknown_request": [RequestEvent(E.TOKENS, "ghost", 1.0, num_tokens=1)],
    "duplicate_arrival": [RequestEvent(E.ARRIVED, "v0", 1.0)],
    "duplicate_finish": [RequestEvent(E.FINISHED, "done", 99.0, finish_reason="stop")],
    "after_finish": [RequestEvent(E.TOKENS, "done", 99.0, num_tokens=1)],
    "time_backwards": [RequestEvent(E.TOKENS, "v1", 0.5, num_tokens=1)],
    "invalid_value": [
        RequestEvent(E.TOKENS, "v1", NAN, num_tokens=1),
        RequestEvent(E.TOKENS, "v1", 2.0, num_tokens=-3),
        RequestEvent(E.TOKENS, "v1", "soon", num_tokens=1),  # type: ignore[arg-type]  # garbage on purpose
        RequestEvent(E.ARRIVED, "x" * 10_000, 1.0),
        RequestEvent(E.ARRIVED, "nan-arrival", NAN),
    ],
    "invalid_transition": [RequestEvent(E.PREEMPTED, "v2", 2.0, reason="kv_cache_full")],  # v2 is waiting
    "unknown_event_type": cast("list[RequestEvent]", ["not an event", None]),  # not events, on purpose
}


VALID = (("v0", 1), ("v1", 2), ("v2", 3))


def histograms(r):
    return {
        name: [(p.bucket_counts, p.count, p.sum) for p in points]
        for name, points in r.metrics().items()
        if hasattr(points[0], "bucket_counts")
    }


@pytest.mark.parametrize("reason", sorted(BAD))
def test_each_bad_event_is_dropped_counted_and_leaves_valid_requests_exact(reason):
    clean, r = in_memory_telemetry(), in_memory_telemetry()
    for target in (clean, r):
        target.telemetry.on_events(lifecycle("done", 0.0))
    clean.telemetry.on_events([e for rid, k in VALID for e in lifecycle(rid, 1.0, preemptions=k)])
    # Interleaved: the valid requests start, garbage arrives mid-flight, then they finish.
    starts = [lifecycle(rid, 1.0, preemptions=k) for rid, k in VALID]
    r.telemetry.on_events([e for evs in starts for e in evs[:2]])
    r.telemetry.on_events(BAD[reason])
    r.telemetry.on_events([e for evs in starts for e in evs[2:]])
    assert dropped(r) == {reason: len(BAD[reason])}
    assert histograms(r) == histograms(clean)


def test_equal_timestamps_are_fine():
    r = in_memory_telemetry()
    t = 5.0
    r.telemetry.on_events(
        [
            RequestEvent(E.ARRIVED, "a", t),
            RequestEvent(E.QUEUED, "a", t),
            RequestEvent(E.SCHEDULED, "a", t),
            RequestEvent(E.TOKENS, "a", t, num_tokens=1),
            RequestEvent(E.FINISHED, "a", t, finish_reason="stop"),
        ]
    )
    assert dropped(r) == {}
    assert r.point("vllm:e2e_request_latency_seconds").sum == 0


def test_inflight_cap_evicts_oldest_and_counts():
    r = in_memory_telemetry(TelemetryConfig(model_name="m", max_inflight_requests=3))
    r.telemetry.on_events([RequestEvent(E.ARRIVED, f"r{i}", float(i)) for i in range(5)])
    assert dropped(r) == {"evicted": 2}
    assert list(r.telemetry.tracker.inflight) == ["r2", "r3", "r4"]
    evicted = {attrs(s.attributes)["gen_ai.request.id"] for s in r.finished_spans()}
    assert evicted == {"r0", "r1"}
    r.telemetry.on_events([RequestEvent(E.TOKENS, "r0", 9.0, num_tokens=1)])
    assert dropped(r)["after_finish"] == 1


def test_finished_ids_memory_is_bounded():
    r = in_memory_telemetry(TelemetryConfig(model_name="m", max_inflight_requests=10))
    for i in range(100):
        r.telemetry.on_events(lifecycle(f"r{i}", float(i)))
    assert len(r.telemetry.tracker.finished) == 10 and not r.telemetry.tracker.inflight


def test_bad_step_stats_dropped() -> None:
    r = in_memory_telemetry()
    r.telemetry.on_step(StepStats(1.0, num_running=-1))
    r.telemetry.on_step(StepStats(1.0, kv_cache_usage=NAN))
    r.telemetry.on_step(None)  # type: ignore[arg-type]  # garbage on purpose: not StepStats
    assert dropped(r) == {"invalid_value": 3}


def test_drops_logged_once_per_reason_per_interval(caplog):
    r = in_memory_telemetry()
    with caplog.at_level(logging.WARNING, logger="otel_llm"):
        for _ in range(50):
            r.telemetry.on_events([RequestEvent(E.TOKENS, "ghost", 1.0, num_tokens=1)])
    assert len([m for m in caplog.messages if "unknown_request" in m]) == 1
    assert dropped(r) == {"unknown_request": 50}


def test_internal_error_never_reaches_the_caller(monkeypatch):
    r = in_memory_telemetry()
    monkeypatch.setattr(r.telemetry.metrics, "preempted", lambda *a: 1 / 0)  # a fault we cannot cause otherwise
    r.telemetry.on_events(lifecycle("a", 1.0, preemptions=1))
    assert dropped(r) == {"internal_error": 1}
