"""Measured proposals for the core's hot path, and diagnostics.

A variant patches one EngineTelemetry instance from outside and is timed interleaved with the
unpatched one on the same event batches as section 1, so its saving is a measured number; its
totals are checked equal to the unpatched telemetry's.

Applied to the core after they were measured here: the finished/in-flight ids in OrderedDicts
(O(1) eviction of the oldest), the TOKENS fast route in ``Tracker.handle``, module-level aliases
of Enum members, ``EventType.__hash__ = object.__hash__``, and one recorder call per TOKENS
event (``Recorder.tokens``).

* ``inline_on_events`` (not applied: it would put a second copy of the TOKENS transition in
  ``EngineTelemetry``) -- ``on_events`` applies the common TOKENS case itself, sums the
  generation tokens of the batch into one counter update, and calls only the inter-token
  cell's ``observe``; every other event goes through ``Tracker.handle`` unchanged.

Diagnostic: ``tracker_only`` is the Tracker behind the same loop with a no-op sink -- the
lifecycle validation that (b) shares with ours; the rest of ours is the metric path.
"""

from __future__ import annotations

from typing import Any, Callable, cast

from otel_llm.catalogue import drops
from otel_llm.core import tracker as _t
from otel_llm.core.tracker import Tracker, TrackerSink
from otel_llm.events import EventType

from .replay import CONFIG, replay
from .subscribers import OtelSubscriber, otel_subscriber

_TOKENS = EventType.TOKENS
# The core's upper bound on timestamps (+inf would poison sums), where this core version has one.
_MAX_TS = getattr(_t, "MAX_TIMESTAMP", float("inf"))


class _NullSink:
    """A TrackerSink that does nothing: what the lifecycle validation alone costs."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        def nothing(*args: Any) -> None:
            return None

        setattr(self, name, nothing)
        return nothing


class TrackerOnly:
    """Diagnostic: EngineTelemetry.on_events' loop (lock, try) around the Tracker, no metrics."""

    def __init__(self, tracker_cls: type = Tracker) -> None:
        import threading

        self.tracker = tracker_cls(_NullSink(), CONFIG.max_inflight_requests)
        self._lock = threading.Lock()

    def on_events(self, events: Any) -> None:
        handle = self.tracker.handle
        with self._lock:
            for event in events:
                try:
                    handle(event)
                except (TypeError, AttributeError, ValueError):
                    pass

    def on_step(self, stats: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _inline(telemetry: Any) -> None:
    """The TOKENS transition and its metrics inline in ``on_events``: one Python call (the cell's
    ``observe``) per token event; everything else goes through ``Tracker.handle`` unchanged."""

    tracker, metrics, sink = telemetry.tracker, telemetry.metrics, telemetry._sink
    lock = metrics.lock
    inflight, handle = tracker.inflight, tracker.handle
    observe = metrics.h_itl.observe

    def on_events(events: Any) -> None:
        generated = 0
        try:
            with lock:
                try:
                    for event in events:
                        try:
                            if getattr(event, "type", None) is _TOKENS:
                                req = inflight.get(event.request_id)
                                if req is not None and req.first_token is not None:
                                    ts, n = event.timestamp, event.num_tokens
                                    if req.last_ts <= ts <= _MAX_TS and type(n) is int and n >= 0:
                                        req.last_ts = ts
                                        last = req.last_token
                                        req.last_token = ts
                                        req.generation_tokens += n
                                        generated += n
                                        if last is not None:
                                            observe(ts - last, req.exemplar)
                                        continue
                            handle(event)
                        except (TypeError, AttributeError, ValueError):
                            sink.dropped(drops.INVALID_VALUE, event)
                        except Exception:  # noqa: BLE001 - never into the engine, as EngineTelemetry
                            sink.internal_error(event)
                finally:
                    metrics.counts["generation_tokens"] += generated
        except Exception:  # noqa: BLE001 - never into the engine, as EngineTelemetry
            sink.internal_error(events)

    telemetry.on_events = on_events


def _variant(inline: bool) -> Callable[[], OtelSubscriber]:
    def make() -> OtelSubscriber:
        sub = otel_subscriber(CONFIG)
        if inline:
            _inline(sub.telemetry)
        return sub

    return make


VARIANTS = {
    "ours": _variant(False),
    "inline_on_events": _variant(True),
}
DIAGNOSTICS = {
    "tracker_only": TrackerOnly,  # the shared lifecycle validation, no metrics at all
}


def check_equal(mix: Any) -> bool:
    everything = mix.warmup + mix.steps
    totals = []
    for make in VARIANTS.values():
        sub = make()
        replay(sub, everything)
        totals.append(sub.totals())
        sub.shutdown()
    return all(t == totals[0] for t in totals)


def micro(number: int = 200_000, repeat: int = 7) -> dict[str, float]:
    """ns per operation (min of repeats, timeit-style) of the pieces of the TOKENS path."""
    import enum
    import timeit
    from bisect import bisect_left

    from otel_llm.config.buckets import INTER_TOKEN_LATENCY
    from otel_llm.events import RequestEvent

    class _Null:
        def tokens(self, n: int, itl: Any, exemplar: Any, ctx: Any) -> None:
            pass

    class _PlainEnum(enum.Enum):
        X = "x"

    sub = otel_subscriber(CONFIG)
    tel = sub.telemetry
    tel.on_events(
        [
            RequestEvent(EventType.ARRIVED, "r", 1.0, prompt_tokens=3, max_tokens=10**9),
            RequestEvent(EventType.SCHEDULED, "r", 1.0),
            RequestEvent(EventType.TOKENS, "r", 1.1, num_tokens=1),
        ]
    )
    tel.flush()
    req = tel.tracker.inflight["r"]
    ev = RequestEvent(EventType.TOKENS, "r", 1.2, num_tokens=1)
    null_tracker = Tracker(cast(TrackerSink, _Null()), 10)
    null_tracker.inflight["r"] = req
    m = tel.metrics
    ix = _PlainEnum.X
    cases: dict[str, tuple[str, dict[str, Any]]] = {
        "python call of a no-op function": ("f(ev)", {"f": lambda e: None}),
        "EventType.ARRIVED (member read through the class)": ("EventType.ARRIVED", {}),
        "module-level alias read": ("T", {}),
        "dict.get(EventType member) (identity hash)": ("d.get(T)", {"d": {EventType.TOKENS: 1}}),
        "dict.get(member of an Enum with its own hash)": ("d.get(ix)", {"d": {ix: 1}, "ix": ix}),
        "Tracker.handle(TOKENS), no-op sink": ("h(ev)", {"h": null_tracker.handle}),
        "InProcessRecorder.tokens(1, x, None, ctx)": ("f(1, 0.02, None, None)", {"f": m.tokens}),
        "HistogramCell.observe(x)": ("f(0.02)", {"f": m.h_itl.observe}),
        "bisect_left over the 19 ITL bounds": ("b(B, 0.02)", {"b": bisect_left, "B": INTER_TOKEN_LATENCY}),
        "Tracker.handle(TOKENS) with EngineTelemetry (whole path)": ("h(ev)", {"h": tel.tracker.handle}),
        "floor: stats[k] += 1": ("s[k] += 1", {"s": {"k": 0}, "k": "k"}),
    }
    out = {}
    for name, (stmt, extra) in cases.items():
        g = {"ev": ev, "req": req, "T": EventType.TOKENS, "EventType": EventType, **extra}
        out[name] = round(min(timeit.repeat(stmt, globals=g, number=number, repeat=repeat)) / number * 1e9, 1)
    sub.shutdown()
    return out
