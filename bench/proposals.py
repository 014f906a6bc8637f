"""Measured proposals for the core's hot path (the core itself is not changed here).

Each variant patches one EngineTelemetry instance from outside and is timed interleaved with
the unpatched one on the same event batches as section 1, so the saving of each proposed
change is a measured number. Their totals are checked equal to the unpatched telemetry's.

* ``enum_constants`` -- ``Tracker.handle`` as it is, but comparing with a module-level alias
  (``_ARRIVED = EventType.ARRIVED``) instead of ``EventType.ARRIVED``: on Python 3.11 reading
  an Enum member through its class costs ~100 ns (see ``micro``), once per event.
* ``tokens_fast_path`` -- ``Tracker.handle`` tests ``kind is EventType.TOKENS`` first (an
  identity test, ~96 % of events) and applies the TOKENS transition inline, before the generic
  dispatch: no ``Enum.__hash__`` (a Python-level function) for the handler-dict lookup, and
  one call less (``_tokens``). Anything unusual (unknown id, time backwards, a bad count, a first
  token) falls through to the unchanged generic path.
* ``fused_sink`` -- ``EngineTelemetry.tokens`` updates the generation counter and observes the
  inter-token latency itself (one call into the cell) instead of calling
  ``metrics.generation_tokens`` and ``metrics.itl``: two Python calls less per token event.
* ``both`` -- the two together.
* ``inline_on_events`` -- ``EngineTelemetry.on_events`` applies the common TOKENS case itself
  (the same checks as ``Tracker._tokens``), sums the generation tokens of the batch into one
  counter update, and calls only the inter-token cell's ``observe``; every other event (and
  any unusual TOKENS event) goes through ``Tracker.handle`` unchanged.

``OrderedFinishedTracker`` (measured in the memory section, steady state after the finished-id
memory filled): the finished ids in an OrderedDict, so forgetting the oldest is O(1).

Diagnostics (not proposals): ``tracker_only`` is the Tracker behind the same loop with a no-op
sink -- the lifecycle validation that (b) shares with ours; the rest of ours is the metric path.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from otel_llm import tracker as _t
from otel_llm.events import EventType
from otel_llm.tracker import RequestState, Tracker

from .per_event import CONFIG, replay
from .subscribers import OtelSubscriber, otel_subscriber

_TOKENS = EventType.TOKENS
_ARRIVED = EventType.ARRIVED
# The core's upper bound on timestamps (+inf would poison sums), where this core version has one.
_MAX_TS = getattr(_t, "MAX_TIMESTAMP", float("inf"))


class EnumConstantsTracker(Tracker):
    """``Tracker.handle`` verbatim, except ``EventType.ARRIVED`` read from a module-level alias."""

    def handle(self, event: Any) -> None:
        kind = getattr(event, "type", None)
        handler = self._handlers.get(kind)
        if handler is None:
            self.sink.dropped(_t.UNKNOWN_EVENT_TYPE, event)
            return
        if kind is _ARRIVED:
            self._arrived(event)
            return
        req = self.inflight.get(event.request_id)
        if req is None:
            self._unknown(event)
            return
        ts = event.timestamp
        if not ts >= req.last_ts:  # also catches NaN
            self.sink.dropped(_t.TIME_BACKWARDS if _t._finite(ts) else _t.INVALID_VALUE, event)
            return
        if ts > _MAX_TS:
            self.sink.dropped(_t.INVALID_VALUE, event)
            return
        handler(event, req)


class TokensFastPathTracker(Tracker):
    def handle(self, event: Any) -> None:
        if getattr(event, "type", None) is _TOKENS:
            req = self.inflight.get(event.request_id)
            if req is not None and req.first_token is not None:
                ts, n = event.timestamp, event.num_tokens
                if req.last_ts <= ts <= _MAX_TS and type(n) is int and n >= 0:
                    req.last_ts = ts
                    last = req.last_token
                    req.last_token = ts
                    req.generation_tokens += n
                    self.sink.tokens(req, n, ts - last if last is not None else None)
                    return
        Tracker.handle(self, event)


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


def _fuse(telemetry: Any) -> None:
    metrics = telemetry.metrics
    observe = metrics.h_itl.observe

    def tokens(req: RequestState, n: int, itl: Optional[float]) -> None:
        metrics.n_generation += n
        if itl is not None:
            observe(itl, req.exemplar)
    telemetry.tokens = tokens  # the tracker calls sink.tokens: the instance attribute wins


class OrderedFinishedTracker(Tracker):
    """``Tracker`` with the finished-id memory as an OrderedDict: dropping the oldest id is
    ``popitem(last=False)``, O(1). The core's ``del d[next(iter(d))]`` on a plain dict must skip
    every entry deleted from its front since the last resize: O(max_inflight_requests) per
    finished request once the memory is full (~25 us at the default 100 000)."""

    def __init__(self, sink: Any, max_inflight: int) -> None:
        from collections import OrderedDict
        super().__init__(sink, max_inflight)
        self.finished = OrderedDict()  # type: ignore[assignment]

    def _remember_finished(self, rid: str) -> None:
        self.finished[rid] = None
        if len(self.finished) > self.max_inflight:
            self.finished.popitem(last=False)  # type: ignore[call-arg]


def _inline(telemetry: Any) -> None:
    """The TOKENS transition and its metrics inline in ``on_events``: one Python call (the cell's
    ``observe``) per token event; everything else goes through ``Tracker.handle`` unchanged."""
    from otel_llm import tracker as t

    tracker, metrics, lock = telemetry.tracker, telemetry.metrics, telemetry._lock
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
                            telemetry.dropped(t.INVALID_VALUE, event)
                        except Exception:  # noqa: BLE001
                            telemetry._internal_error(event)
                finally:
                    metrics.n_generation += generated
        except Exception:  # noqa: BLE001
            telemetry._internal_error(events)
    telemetry.on_events = on_events


def _variant(fast_tracker: bool, fused: bool, tracker: type = TokensFastPathTracker,
             inline: bool = False) -> Callable[[], OtelSubscriber]:
    def make() -> OtelSubscriber:
        sub = otel_subscriber(CONFIG)
        tel = sub.telemetry
        if inline:
            _inline(tel)
        if fast_tracker:
            tel.tracker = tracker(tel, tel.config.max_inflight_requests)
        if fused:
            _fuse(tel)
        return sub
    return make


VARIANTS = {
    "ours": _variant(False, False),
    "enum_constants": _variant(True, False, EnumConstantsTracker),
    "tokens_fast_path": _variant(True, False),
    "fused_sink": _variant(False, True),
    "both": _variant(True, True),
    "inline_on_events": _variant(False, False, inline=True),
}
DIAGNOSTICS = {
    "tracker_only": TrackerOnly,  # the shared lifecycle validation, no metrics at all
    "tracker_only_fast_path": lambda: TrackerOnly(TokensFastPathTracker),
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

    from otel_llm.buckets import INTER_TOKEN_LATENCY
    from otel_llm.events import RequestEvent

    class _Null:
        def tokens(self, req: Any, n: int, itl: Any) -> None:
            pass

    class _IdentityHashEnum(enum.Enum):
        X = "x"
        __hash__ = object.__hash__

    sub = otel_subscriber(CONFIG)
    tel = sub.telemetry
    tel.on_events([RequestEvent(EventType.ARRIVED, "r", 1.0, prompt_tokens=3, max_tokens=10**9),
                   RequestEvent(EventType.SCHEDULED, "r", 1.0), RequestEvent(EventType.TOKENS, "r", 1.1, num_tokens=1)])
    req = tel.tracker.inflight["r"]
    ev = RequestEvent(EventType.TOKENS, "r", 1.2, num_tokens=1)
    null_tracker = Tracker(_Null(), 10)
    null_tracker.inflight["r"] = req
    fast_tracker = TokensFastPathTracker(_Null(), 10)
    fast_tracker.inflight["r"] = req
    m = tel.metrics
    ix = _IdentityHashEnum.X
    cases = {
        "python call of a no-op function": ("f(ev)", {"f": lambda e: None}),
        "EventType.ARRIVED (member read through the class)": ("EventType.ARRIVED", {}),
        "module-level alias read": ("T", {}),
        "dict.get(EventType member) (Enum.__hash__ in Python)": ("d.get(T)", {"d": {EventType.TOKENS: 1}}),
        "dict.get(member of an Enum with __hash__ = object.__hash__)": ("d.get(ix)", {"d": {ix: 1}, "ix": ix}),
        "Tracker.handle(TOKENS), no-op sink": ("h(ev)", {"h": null_tracker.handle}),
        "TokensFastPathTracker.handle(TOKENS), no-op sink": ("h(ev)", {"h": fast_tracker.handle}),
        "EngineTelemetry.tokens(req, 1, itl)": ("f(req, 1, 0.02)", {"f": tel.tokens}),
        "FastMetrics.generation_tokens(1)": ("f(1)", {"f": m.generation_tokens}),
        "FastMetrics.itl(x, None, ctx)": ("f(0.02, None, None)", {"f": m.itl}),
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
