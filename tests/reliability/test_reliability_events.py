"""Reliability: bad events never reach the engine, are counted by reason, and leave valid requests exact.

Property-based (hypothesis): valid request lifecycles are interleaved with adversarial garbage
(unknown ids, duplicates, FINISHED twice, events after FINISHED, backwards / NaN / inf / huge /
negative timestamps, wrong types, huge ids, non-events). Checked on every example:

* nothing raises into the engine: the hook bus records no subscriber error;
* every garbage event is dropped and counted exactly once, under the reason it deserves, on
  ``otel_llm.dropped_events``; no ``internal_error`` ever;
* each reason is logged at most once per interval;
* the valid requests are exact: every metric point (bucket counts, sums, counts, min, max,
  counter values) and every request span equals that of a clean run of the valid requests only.

Plus a fully random stream (no structure at all) and a non-hypothesis run of 10^6 distinct
unknown ids and 2*10^5 distinct arrivals under the in-flight cap, with bounded memory.
"""

from __future__ import annotations

import gc
import logging
import math
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics.export import HistogramDataPoint
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_llm import TelemetryConfig
from otel_llm.catalogue import drops as drop_reasons
from otel_llm.core import sink as request_sink
from otel_llm.core import tracker as t
from otel_llm.events import EventType, RequestEvent  # the module, so that mypy sees the types (otel_llm is lazy)
from otel_llm.hooks import HookBus
from otel_llm.testing import MetricsSnapshot, in_memory_telemetry
from tests.support.otel_helpers import BOTH_PATHS, FAST, Paths

E = EventType
DROPPED = "otel_llm.dropped_events"
FINISH_REASONS = ("stop", "length", "abort", "error")


# ----------------------------------------------------------------------------- harness


class LogCounter(logging.Handler):
    """Counts the telemetry's 'dropped an event (<reason>)' log records per reason."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.by_reason: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "dropped an event (" in message:
            reason = message.split("dropped an event (", 1)[1].split(")", 1)[0]
            self.by_reason[reason] = self.by_reason.get(reason, 0) + 1


class Rig:
    """EngineTelemetry on in-memory providers (otel_llm.testing), fed through a real HookBus (as an engine does)."""

    def __init__(self, paths: Paths, max_inflight: int = 100_000, spans: bool = True) -> None:
        self.otel = in_memory_telemetry(
            TelemetryConfig(model_name="m", max_inflight_requests=max_inflight, spans=spans), **paths
        )
        self.telemetry = self.otel.telemetry
        self.exporter = self.otel.span_exporter
        self.bus = HookBus()
        self.bus.subscribe(self.telemetry)

    def publish(self, batches: list[list[Any]]) -> None:
        for batch in batches:
            self.bus.publish(batch)  # never raises: the bus isolates, so check bus.errors too
        self.telemetry.flush()  # apply the batches the telemetry keeps (defer_steps), as a reader would

    def metrics(self) -> MetricsSnapshot:
        return self.otel.metrics()

    def close(self) -> None:
        self.otel.shutdown()


def drops(metrics: Mapping[str, list[Any]]) -> dict[str, int]:
    return {p.attributes["reason"]: p.value for p in metrics.get(DROPPED, []) if p.value}


def comparable(metrics: Mapping[str, list[Any]]) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """Every point except the dropped-events counter, keyed by (name, attributes), times removed."""
    out: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for name, points in metrics.items():
        if name == DROPPED:
            continue
        for p in points:
            key = (name, tuple(sorted(p.attributes.items())))
            if isinstance(p, HistogramDataPoint):
                assert p.count == sum(p.bucket_counts), f"torn point {name}: {p}"
                out[key] = ("h", tuple(p.bucket_counts), p.count, p.sum, p.min, p.max, tuple(p.explicit_bounds))
            else:
                out[key] = ("v", p.value)
    return out


T = TypeVar("T")


def present(value: T | None) -> T:
    """The value, asserted set (a finished span has attributes, a start and an end time)."""
    assert value is not None
    return value


def span_digest(exporter: InMemorySpanExporter) -> list[tuple[Any, ...]]:
    spans = []
    for s in exporter.get_finished_spans():
        attributes: Mapping[str, Any] = present(s.attributes)
        start, end = present(s.start_time), present(s.end_time)
        spans.append(
            (
                attributes["gen_ai.request.id"],
                tuple(sorted((k, v) for k, v in attributes.items())),
                # Each telemetry converts engine time with its own wall-clock offset: compare relative times.
                tuple((e.name, tuple(sorted(present(e.attributes).items())), e.timestamp - start) for e in s.events),
                end - start,
                s.status.status_code,
            )
        )
    return sorted(spans)


# ----------------------------------------------------------------------------- strategies


@dataclass
class Garbage:
    # Where it goes: "any", or "<rid>:inflight", "<rid>:running", "<rid>:has_token", "<rid>:waiting", "<rid>:after".
    anchor: str
    event: Any
    reason: str


@st.composite
def valid_request(draw: Any, index: int) -> list[RequestEvent]:
    """One valid lifecycle with non-decreasing timestamps (equal timestamps allowed)."""
    rid = f"v{index}"
    ts = draw(st.floats(1.0, 1000.0))
    step = st.sampled_from([0.0, 0.001, 0.01, 0.25, 1.5])
    events = [
        RequestEvent(
            E.ARRIVED,
            rid,
            ts,
            prompt_tokens=draw(st.integers(0, 4000)),
            max_tokens=draw(st.integers(0, 4000)),
            num_cached_tokens=draw(st.integers(0, 50)),
        ),
        RequestEvent(E.QUEUED, rid, ts),
    ]
    for _ in range(draw(st.integers(0, 4))):  # scheduled, maybe tokens, then preempted
        ts += draw(step)
        events.append(RequestEvent(E.SCHEDULED, rid, ts))
        for _ in range(draw(st.integers(0, 2))):
            ts += draw(step)
            events.append(RequestEvent(E.TOKENS, rid, ts, num_tokens=draw(st.integers(0, 3))))
        ts += draw(step)
        events.append(
            RequestEvent(
                E.PREEMPTED,
                rid,
                ts,
                num_computed_tokens=draw(st.integers(0, 500)),
                reason=draw(st.sampled_from(["kv_cache_full", "priority"])),
            )
        )
    if draw(st.booleans()):  # aborted while waiting, or finishes after running
        ts += draw(step)
        events.append(RequestEvent(E.SCHEDULED, rid, ts))
        if draw(st.booleans()) and not any(e.type is E.TOKENS for e in events):
            ts += draw(step)
            events.append(RequestEvent(E.FIRST_TOKEN, rid, ts))
        for _ in range(draw(st.integers(0, 5))):
            ts += draw(step)
            events.append(RequestEvent(E.TOKENS, rid, ts, num_tokens=draw(st.integers(1, 4))))
    ts += draw(step)
    events.append(RequestEvent(E.FINISHED, rid, ts, finish_reason=draw(st.sampled_from(FINISH_REASONS))))
    return events


NOT_A_NUMBER = st.sampled_from([math.nan, math.inf, -math.inf, "3", None, 2.5, -1, True, [1]])
BAD_TIMESTAMP = st.sampled_from([math.nan, math.inf, -math.inf, 1e300, 2e10, "now", None, b"1", complex(1, 1)])
NON_EVENTS = st.sampled_from(
    [
        None,
        42,
        "ARRIVED",
        b"x",
        {"type": "arrived"},
        object(),
        RequestEvent("bogus", "v0", 1.0),  # type: ignore[arg-type]  # garbage on purpose: not an EventType
        RequestEvent(None, "v0", 1.0),  # type: ignore[arg-type]  # garbage on purpose: not an EventType
    ]
)
NON_ARRIVED = st.sampled_from([E.QUEUED, E.SCHEDULED, E.PREEMPTED, E.FIRST_TOKEN, E.TOKENS, E.FINISHED])


@st.composite
def garbage_for(draw: Any, request: list[RequestEvent]) -> Garbage:
    """One event that must be dropped, with the reason it must be counted under."""
    rid = request[0].request_id
    arrival = request[0].timestamp
    end = request[-1].timestamp  # >= every timestamp of the request: passes the time check
    kinds = [
        "duplicate_arrival",
        "backwards",
        "bad_time",
        "bad_tokens",
        "bad_finish",
        "bad_preempt_value",
        "after_finish",
        "duplicate_finish",
    ]
    if any(e.type is E.SCHEDULED for e in request):
        kinds += ["scheduled_twice", "preempted_while_waiting"]
    if any(e.type in (E.FIRST_TOKEN, E.TOKENS) for e in request):
        kinds.append("first_token_twice")
    kind = draw(st.sampled_from(kinds))
    if kind == "duplicate_arrival":
        return Garbage(
            f"{rid}:inflight", RequestEvent(E.ARRIVED, rid, end, prompt_tokens=1), drop_reasons.DUPLICATE_ARRIVAL
        )
    if kind == "backwards":
        ts = arrival - draw(st.sampled_from([1e-9, 0.5, 1e6]))
        return Garbage(
            f"{rid}:inflight",
            RequestEvent(draw(NON_ARRIVED), rid, ts, finish_reason="stop"),
            drop_reasons.TIME_BACKWARDS,
        )
    if kind == "bad_time":
        ts = draw(BAD_TIMESTAMP)
        return Garbage(
            f"{rid}:inflight",
            RequestEvent(draw(NON_ARRIVED), rid, ts, finish_reason="stop"),
            drop_reasons.INVALID_VALUE,
        )
    if kind == "bad_tokens":
        return Garbage(
            f"{rid}:inflight",
            RequestEvent(E.TOKENS, rid, end, num_tokens=draw(NOT_A_NUMBER)),
            drop_reasons.INVALID_VALUE,
        )
    if kind == "bad_finish":
        reason = draw(st.sampled_from([None, 5, b"stop", ["stop"]]))
        return Garbage(
            f"{rid}:inflight", RequestEvent(E.FINISHED, rid, end, finish_reason=reason), drop_reasons.INVALID_VALUE
        )
    if kind == "bad_preempt_value":
        tokens = draw(NOT_A_NUMBER)
        return Garbage(
            f"{rid}:running",
            RequestEvent(E.PREEMPTED, rid, end, num_computed_tokens=tokens, reason="kv_cache_full"),
            drop_reasons.INVALID_VALUE,
        )
    if kind == "after_finish":
        return Garbage(
            f"{rid}:after",
            RequestEvent(
                draw(st.sampled_from([E.QUEUED, E.SCHEDULED, E.PREEMPTED, E.FIRST_TOKEN, E.TOKENS])),
                rid,
                draw(st.sampled_from([end, end + 5, 0.0])),
            ),
            drop_reasons.AFTER_FINISH,
        )
    if kind == "duplicate_finish":
        return Garbage(
            f"{rid}:after", RequestEvent(E.FINISHED, rid, end + 1, finish_reason="stop"), drop_reasons.DUPLICATE_FINISH
        )
    if kind == "scheduled_twice":
        return Garbage(f"{rid}:running", RequestEvent(E.SCHEDULED, rid, end), drop_reasons.INVALID_TRANSITION)
    if kind == "preempted_while_waiting":
        return Garbage(
            f"{rid}:waiting",
            RequestEvent(E.PREEMPTED, rid, end, num_computed_tokens=3, reason="kv_cache_full"),
            drop_reasons.INVALID_TRANSITION,
        )
    assert kind == "first_token_twice"
    return Garbage(f"{rid}:has_token", RequestEvent(E.FIRST_TOKEN, rid, end), drop_reasons.INVALID_TRANSITION)


@st.composite
def free_garbage(draw: Any) -> Garbage:
    """Garbage whose reason does not depend on any request's state."""
    kind = draw(st.sampled_from(["unknown", "non_event", "bad_arrival"]))
    rid: Any  # a str, or garbage of any type
    if kind == "unknown":
        rid = draw(
            st.one_of(st.text(min_size=0, max_size=20).map(lambda s: "g" + s), st.text(min_size=300, max_size=400))
        )
        return Garbage(
            "any", RequestEvent(draw(NON_ARRIVED), rid, draw(st.floats(allow_nan=True))), drop_reasons.UNKNOWN_REQUEST
        )
    if kind == "non_event":
        return Garbage("any", draw(NON_EVENTS), drop_reasons.UNKNOWN_EVENT_TYPE)
    # ARRIVED with a wrong id, timestamp or count: rejected whatever the id
    bad = draw(st.sampled_from(["id_huge", "id_type", "ts", "prompt", "max", "cached"]))
    rid = "b" + draw(st.text(max_size=8))
    kwargs: dict[str, Any] = {"prompt_tokens": 3, "max_tokens": 4}
    ts: Any = 5.0
    if bad == "id_huge":
        rid = "x" * draw(st.integers(t.MAX_ID_LENGTH + 1, 100_000))
    elif bad == "id_type":
        rid = draw(st.sampled_from([None, 7, b"v0", ("v0",), 1.5]))
    elif bad == "ts":
        ts = draw(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e300, "0", None]))
    else:
        kwargs[{"prompt": "prompt_tokens", "max": "max_tokens", "cached": "num_cached_tokens"}[bad]] = draw(
            NOT_A_NUMBER
        )
    return Garbage("any", RequestEvent(E.ARRIVED, rid, ts, **kwargs), drop_reasons.INVALID_VALUE)


@st.composite
def scenario(draw: Any) -> tuple[list[RequestEvent], list[Any], list[Garbage]]:
    """(valid events in stream order, the stream with garbage, the garbage)."""
    requests = [draw(valid_request(i)) for i in range(draw(st.integers(0, 6)))]
    # Interleave the requests, keeping each one's order.
    cursors = [0] * len(requests)
    valid: list[RequestEvent] = []
    while any(c < len(r) for c, r in zip(cursors, requests)):
        i = draw(st.sampled_from([i for i, r in enumerate(requests) if cursors[i] < len(r)]))
        valid.append(requests[i][cursors[i]])
        cursors[i] += 1
    garbage = [draw(free_garbage()) for _ in range(draw(st.integers(0, 12)))]
    for request in requests:
        garbage += [draw(garbage_for(request)) for _ in range(draw(st.integers(0, 4)))]
    # Legal insertion slots (slot k = before valid[k]) for each anchor.
    slots: dict[str, list[int]] = {}
    state: dict[str, dict[str, bool]] = {}
    for k in range(len(valid) + 1):
        for rid, s in state.items():
            if s["inflight"]:
                slots.setdefault(f"{rid}:inflight", []).append(k)
                slots.setdefault(f"{rid}:{'running' if s['running'] else 'waiting'}", []).append(k)
                if s["token"]:
                    slots.setdefault(f"{rid}:has_token", []).append(k)
            elif s["finished"]:
                slots.setdefault(f"{rid}:after", []).append(k)
        if k == len(valid):
            break
        e = valid[k]
        s = state.setdefault(e.request_id, {"inflight": True, "running": False, "token": False, "finished": False})
        if e.type is E.SCHEDULED:
            s["running"] = True
        elif e.type is E.PREEMPTED:
            s["running"] = False
        elif e.type in (E.FIRST_TOKEN, E.TOKENS):
            s["token"] = True
        elif e.type is E.FINISHED:
            s["inflight"], s["finished"] = False, True
    placed: dict[int, list[Any]] = {}
    kept = []
    for g in garbage:
        candidates = list(range(len(valid) + 1)) if g.anchor == "any" else slots.get(g.anchor, [])
        if not candidates:
            continue  # e.g. a request that is never running
        placed.setdefault(draw(st.sampled_from(candidates)), []).append(g.event)
        kept.append(g)
    stream: list[Any] = []
    for k in range(len(valid) + 1):
        stream.extend(placed.get(k, []))
        if k < len(valid):
            stream.append(valid[k])
    return valid, stream, kept


def batches_of(draw: Any, stream: list[Any]) -> list[list[Any]]:
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    out, start = [], 0
    for c in cuts + [len(stream)]:
        out.append(stream[start:c])
        start = c
    return out


# ----------------------------------------------------------------------------- tests


@pytest.fixture
def drop_logs():
    counter = LogCounter()
    logger = logging.getLogger("otel_llm.core.sink")
    logger.addHandler(counter)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield counter
    logger.removeHandler(counter)
    logger.setLevel(old)


@BOTH_PATHS
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_garbage_is_dropped_counted_logged_once_and_valid_requests_stay_exact(data, paths, drop_logs):
    valid, stream, garbage = data.draw(scenario())
    drop_logs.by_reason.clear()

    dirty = Rig(paths)
    clean = Rig(paths)
    try:
        dirty.publish(batches_of(data.draw, stream))
        clean.publish(batches_of(data.draw, valid))
        assert dirty.bus.errors == {} and clean.bus.errors == {}, "the telemetry raised into the engine"

        got = dirty.metrics()
        expected_drops: dict[str, int] = {}
        for g in garbage:
            expected_drops[g.reason] = expected_drops.get(g.reason, 0) + 1
        assert drops(got) == expected_drops, f"garbage: {[(g.reason, g.event) for g in garbage]}"
        assert drops(clean.metrics()) == {}
        # Logged: every reason that dropped something, at most once within the interval.
        assert drop_logs.by_reason == {reason: 1 for reason in expected_drops}
        # Valid requests exact: every point of every metric, and every span.
        assert comparable(got) == comparable(clean.metrics())
        assert span_digest(dirty.exporter) == span_digest(clean.exporter)
        assert not dirty.telemetry.tracker.inflight, "a valid request is still in flight"
    finally:
        dirty.close()
        clean.close()


ANY_ID = st.one_of(st.sampled_from(["a", "b", "c", ""]), st.text(max_size=3), st.integers(), st.none())
ANY_NUMBER = st.one_of(
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.text(max_size=2),
    st.booleans(),
)


@st.composite
def random_event(draw: Any) -> Any:
    if draw(st.integers(0, 20)) == 0:
        return draw(NON_EVENTS)
    return RequestEvent(
        draw(st.sampled_from(list(E))),
        draw(ANY_ID),
        draw(ANY_NUMBER),
        prompt_tokens=draw(ANY_NUMBER),
        max_tokens=draw(ANY_NUMBER),
        num_tokens=draw(ANY_NUMBER),
        num_computed_tokens=draw(ANY_NUMBER),
        reason=draw(st.one_of(st.text(max_size=4), st.none())),
        finish_reason=draw(st.one_of(st.sampled_from(FINISH_REASONS), st.none(), st.integers())),
        num_cached_tokens=draw(ANY_NUMBER),
    )


@BOTH_PATHS
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(random_event(), max_size=60), data=st.data())
def test_random_streams_never_raise_never_tear_and_never_hit_internal_errors(
    events: list[RequestEvent], data: st.DataObject, paths: Paths
) -> None:
    rig = Rig(paths, max_inflight=3)
    try:
        rig.publish(batches_of(data.draw, events))
        rig.bus.publish_step("not stats")  # type: ignore[arg-type]  # garbage on purpose: not StepStats
        assert rig.bus.errors == {}
        got = rig.metrics()
        reasons = drops(got)
        assert set(reasons) <= set(drop_reasons.DROP_REASONS)
        assert drop_reasons.INTERNAL_ERROR not in reasons, reasons
        comparable(got)  # asserts count == sum(bucket_counts) in every point
        for points in got.values():
            for p in points:
                for v in (p.sum, p.min, p.max) if isinstance(p, HistogramDataPoint) else (p.value,):
                    assert math.isfinite(v), f"non-finite value leaked into a metric: {p}"
        assert len(rig.telemetry.tracker.inflight) <= 3
    finally:
        rig.close()


def test_drop_log_is_rate_limited_per_reason_per_interval(monkeypatch, drop_logs):
    now = [1000.0]
    monkeypatch.setattr(request_sink.time, "monotonic", lambda: now[0])
    rig = Rig(FAST)
    try:
        unknown = [RequestEvent(E.TOKENS, f"nope-{i}", 1.0, num_tokens=1) for i in range(500)]
        rig.publish([unknown, [None] * 10])
        assert drop_logs.by_reason == {drop_reasons.UNKNOWN_REQUEST: 1, drop_reasons.UNKNOWN_EVENT_TYPE: 1}
        now[0] += 59.0
        rig.publish([unknown])
        assert drop_logs.by_reason[drop_reasons.UNKNOWN_REQUEST] == 1  # still inside the interval
        now[0] += 2.0
        rig.publish([unknown[:1]])
        assert drop_logs.by_reason[drop_reasons.UNKNOWN_REQUEST] == 2  # a new interval: one more line, with the tally
        assert drops(rig.metrics()) == {drop_reasons.UNKNOWN_REQUEST: 1001, drop_reasons.UNKNOWN_EVENT_TYPE: 10}
    finally:
        rig.close()


def test_drop_log_reports_the_count_since_the_last_line_and_never_payload_text(monkeypatch, caplog):
    now = [0.0]
    monkeypatch.setattr(request_sink.time, "monotonic", lambda: now[0])
    rig = Rig(FAST)
    caplog.set_level(logging.DEBUG, logger="otel_llm")
    try:
        secret = "PROMPT-SECRET-TEXT"
        rig.publish([[RequestEvent(E.ARRIVED, "s", math.nan, prompt_text=secret)] * 5])
        now[0] += 61.0
        rig.publish([[RequestEvent(E.ARRIVED, "s", math.nan, prompt_text=secret)]])
        lines = [r.getMessage() for r in caplog.records if "dropped an event" in r.getMessage()]
        assert len(lines) == 2 and "(+4 more since the last report)" in lines[1], lines
        assert secret not in caplog.text
    finally:
        rig.close()


def test_a_million_distinct_unknown_ids_and_evictions_stay_bounded():
    """10^6 events of distinct unknown ids, then 2*10^5 distinct arrivals over a cap of 1000."""
    cap = 1000
    rig = Rig(FAST, max_inflight=cap, spans=False)
    try:
        kinds = [E.QUEUED, E.SCHEDULED, E.TOKENS, E.FINISHED, E.PREEMPTED, E.FIRST_TOKEN]
        gc.collect()
        tracemalloc.start()
        try:
            start = time.perf_counter()
            base = tracemalloc.get_traced_memory()[0]
            n_unknown = 1_000_000
            batch = 10_000
            for b in range(n_unknown // batch):
                rig.publish(
                    [
                        [
                            RequestEvent(kinds[i % 6], f"ghost-{b}-{i}", float(i), num_tokens=1, finish_reason="stop")
                            for i in range(batch)
                        ]
                    ]
                )
            after_unknown = tracemalloc.get_traced_memory()[0] - base
            n_arrivals = 200_000
            for b in range(n_arrivals // batch):
                rig.publish(
                    [
                        [
                            RequestEvent(E.ARRIVED, f"arr-{b}-{i}", 1.0 + i, prompt_tokens=1, max_tokens=1)
                            for i in range(batch)
                        ]
                    ]
                )
            gc.collect()
            growth = tracemalloc.get_traced_memory()[0] - base
            elapsed = time.perf_counter() - start
        finally:
            tracemalloc.stop()
        assert rig.bus.errors == {}
        assert drops(rig.metrics()) == {drop_reasons.UNKNOWN_REQUEST: n_unknown, drop_reasons.EVICTED: n_arrivals - cap}
        tracker = rig.telemetry.tracker
        assert len(tracker.inflight) == cap and len(tracker.finished) <= cap
        # Unknown ids leave nothing behind; the cap bounds the rest (1000 in flight + 1000 ids remembered).
        assert after_unknown < 1_000_000, f"10^6 unknown ids grew memory by {after_unknown} bytes"
        assert growth < 5_000_000, f"memory grew by {growth} bytes"
        assert elapsed < 600, f"{elapsed:.0f} s: more than constant time per event?"  # a safety bound (~25 s here)
    finally:
        rig.close()


def test_a_batch_that_is_not_a_list_of_events_is_counted_not_raised() -> None:
    rig = Rig(FAST)
    try:
        for batch in (None, 42, RequestEvent(E.ARRIVED, "x", 1.0)):
            rig.telemetry.on_events(batch)  # type: ignore[arg-type]  # garbage on purpose: not a list of events
        rig.telemetry.on_step(None)  # type: ignore[arg-type]  # garbage on purpose: not StepStats
        got = drops(rig.metrics())
        assert sum(got.values()) == 4 and set(got) <= set(drop_reasons.DROP_REASONS), got
    finally:
        rig.close()
