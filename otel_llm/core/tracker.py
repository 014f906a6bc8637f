"""Per-request lifecycle state: validates each event, derives the intervals.

Pure Python (no OpenTelemetry): the tracker turns the event stream into facts (a request
started, was preempted, produced tokens after an inter-token gap, finished with this
summary) and hands them to a :class:`TrackerSink`. Every interval comes from the one engine
clock carried by the events.

Impossible input is dropped and reported to the sink with a reason; valid requests are
unaffected. State is bounded: at most ``max_inflight`` requests are tracked (the oldest is
evicted beyond) and the ids of as many finished requests are remembered to classify late events.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, Optional, Protocol, Sequence

from otel_llm.catalogue import drops
from otel_llm.events import CAUSE_REQUEST, CAUSE_SELF, CAUSE_UNKNOWN, EventType, RequestEvent
from otel_llm.summary import RequestSummary

MAX_ID_LENGTH = 256  # longer request ids are rejected: ids go into span attributes
# Timestamps are monotonic seconds (>= 0); beyond this (~317 years) a span time no longer fits
# OTLP's uint64 nanoseconds and one such span fails the export of its whole batch.
MAX_TIMESTAMP = 1e10


_ARRIVED = EventType.ARRIVED  # module-level aliases: reading a member through its Enum class
_TOKENS = EventType.TOKENS  # costs ~60 ns, once per event


class RequestState:
    """What the tracker knows of one in-flight request."""

    __slots__ = (
        "request_id",
        "arrival",
        "queued",
        "first_scheduled",
        "first_token",
        "last_token",
        "last_ts",
        "running",
        "num_preemptions",
        "preempted_at",
        "preempted_time",
        "recomputed_tokens",
        "prompt_tokens",
        "max_tokens",
        "generation_tokens",
        "cached_tokens",
        "num_caused",
        "by_cause",
        "tenant",
        "series",
        "on_tokens",
        "span",
        "exemplar",
        "ctx",
    )

    def __init__(self, request_id: str, ts: float, prompt_tokens: int, max_tokens: int, cached_tokens: int) -> None:
        self.request_id = request_id
        self.arrival = ts
        self.last_ts = ts
        self.queued: Optional[float] = None
        self.first_scheduled: Optional[float] = None
        self.first_token: Optional[float] = None
        self.last_token: Optional[float] = None
        self.running = False
        self.num_preemptions = 0
        self.preempted_at: Optional[float] = None
        self.preempted_time = 0.0
        self.recomputed_tokens = 0
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.generation_tokens = 0
        self.cached_tokens = cached_tokens
        self.num_caused = 0  # preemptions its KV demand caused (itself included)
        self.by_cause: dict[str, int] = {}  # its own preemptions by cause kind
        self.tenant: Optional[str] = None  # its tenant label value, when a tenant source is set
        self.series: Any = None  # set by the sink: where its observations go (its tenant's series)
        self.on_tokens: Any = None  # TrackerSink.tokens for this request (the tracker sets it, the sink may change it)
        self.span: Any = None  # set by the sink: the request span, exemplar ids, context
        self.exemplar: Any = None
        self.ctx: Any = None


def summarize(req: RequestState, ts: float, finish_reason: str) -> RequestSummary:
    """vLLM's definitions (``IterationStats.update_from_finished_request``), on one clock."""
    scheduled, first, last = req.first_scheduled, req.first_token, req.last_token
    decode = last - first if first is not None and last is not None else None
    n = req.generation_tokens
    return RequestSummary(
        request_id=req.request_id,
        finish_reason=finish_reason,
        arrival_time=req.arrival,
        finish_time=ts,
        prompt_tokens=req.prompt_tokens,
        generation_tokens=n,
        max_tokens=req.max_tokens,
        num_preemptions=req.num_preemptions,
        queue_time=scheduled - (req.queued if req.queued is not None else req.arrival)
        if scheduled is not None
        else None,
        ttft=first - req.arrival if first is not None else None,
        prefill_time=first - scheduled if first is not None and scheduled is not None else None,
        decode_time=decode,
        inference_time=last - scheduled if last is not None and scheduled is not None else None,
        time_per_output_token=(decode / (n - 1) if n > 1 else 0.0) if decode is not None else None,
        preempted_time=req.preempted_time,
        recomputed_tokens=req.recomputed_tokens,
        cached_tokens=req.cached_tokens,
        preemptions_by_cause=tuple(req.by_cause.items()),
        num_preemptions_caused=req.num_caused,
    )


class TrackerSink(Protocol):
    def request_arrived(self, req: RequestState, event: RequestEvent) -> None: ...
    def request_scheduled(self, req: RequestState, ts: float, resumed: bool) -> None: ...
    # ``kind``: the cause's kind; ``causes``: (id, its state when in flight) of each cause named.
    def request_preempted(
        self, req: RequestState, event: RequestEvent, kind: str, causes: list[tuple[str, Optional[RequestState]]]
    ) -> None: ...
    def first_token(self, req: RequestState, ts: float) -> None: ...
    # New output tokens of a request (its exemplar ids and context as set by the sink at arrival);
    # the default of RequestState.on_tokens, which the sink may set per request at arrival.
    def tokens(self, n: int, itl: Optional[float], exemplar: Any, ctx: Any) -> None: ...
    def request_finished(self, req: RequestState, summary: RequestSummary, event: RequestEvent) -> None: ...
    def request_evicted(self, req: RequestState) -> None: ...
    def dropped(self, reason: str, event: Any) -> None: ...


def is_count(value: Any) -> bool:
    """A non-negative int (bool excluded)."""
    return type(value) is int and value >= 0


class Tracker:
    """Feeds events through the lifecycle; see the module docstring."""

    def __init__(self, sink: TrackerSink, max_inflight: int) -> None:
        self.sink = sink
        self.max_inflight = max_inflight
        # OrderedDicts: dropping the oldest entry is O(1) (on a dict, next(iter(d)) skips every
        # slot deleted from the front since the last resize: ~80 us per request at 10^5 ids).
        self.inflight: OrderedDict[str, RequestState] = OrderedDict()  # arrival order
        self.finished: OrderedDict[str, None] = OrderedDict()  # recently finished ids, oldest first
        # (victim id, preemption ordinal) -> the causes credited before the victim's event came.
        self.credited: OrderedDict[tuple[str, int], tuple[str, ...]] = OrderedDict()
        # Keyed by whatever an event carries as its type: garbage finds no handler.
        self._handlers: dict[object, Callable[..., None]] = {
            EventType.ARRIVED: self._arrived,
            EventType.QUEUED: self._queued,
            EventType.SCHEDULED: self._scheduled,
            EventType.PREEMPTED: self._preempted,
            EventType.FIRST_TOKEN: self._first_token,
            EventType.TOKENS: self._tokens,
            EventType.FINISHED: self._finished,
        }

    def handle(self, event: RequestEvent) -> None:
        kind = getattr(event, "type", None)
        if kind is _TOKENS:
            # The hot path: one TOKENS event per running request per step. Its common case (a
            # known request past its first token, a valid time and count) is applied right here;
            # anything else takes the generic path below.
            req = self.inflight.get(event.request_id)
            if req is not None:
                ts, n, last = event.timestamp, event.num_tokens, req.last_token
                if last is not None and req.last_ts <= ts <= MAX_TIMESTAMP and type(n) is int and n >= 0:
                    req.last_ts = req.last_token = ts
                    req.generation_tokens += n
                    req.on_tokens(n, ts - last, req.exemplar, req.ctx)
                    return
        handler = self._handlers.get(kind)
        if handler is None:
            self.sink.dropped(drops.UNKNOWN_EVENT_TYPE, event)
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
            self.sink.dropped(drops.TIME_BACKWARDS if _finite(ts) else drops.INVALID_VALUE, event)
            return
        if ts > MAX_TIMESTAMP:  # +inf passes the check above and would poison every sum it reaches
            self.sink.dropped(drops.INVALID_VALUE, event)
            return
        handler(event, req)

    def _unknown(self, event: RequestEvent) -> None:
        rid = event.request_id
        try:
            finished = rid in self.finished
        except TypeError:  # unhashable id
            self.sink.dropped(drops.INVALID_VALUE, event)
            return
        if not finished:
            self.sink.dropped(drops.UNKNOWN_REQUEST, event)
        elif event.type is EventType.FINISHED:
            self.sink.dropped(drops.DUPLICATE_FINISH, event)
        else:
            self.sink.dropped(drops.AFTER_FINISH, event)

    def _arrived(self, event: RequestEvent) -> None:
        rid, ts = event.request_id, event.timestamp
        if (
            type(rid) is not str
            or len(rid) > MAX_ID_LENGTH
            or not _valid_time(ts)
            or not is_count(event.prompt_tokens)
            or not is_count(event.max_tokens)
            or not is_count(event.num_cached_tokens)
        ):
            self.sink.dropped(drops.INVALID_VALUE, event)
            return
        if rid in self.inflight:
            self.sink.dropped(drops.DUPLICATE_ARRIVAL, event)
            return
        self.finished.pop(rid, None)  # an id may be reused once its request has finished
        if len(self.inflight) >= self.max_inflight:
            _, oldest = self.inflight.popitem(last=False)
            self._remember_finished(oldest.request_id)
            self.sink.request_evicted(oldest)
        req = RequestState(rid, ts, event.prompt_tokens, event.max_tokens, event.num_cached_tokens)
        req.on_tokens = self.sink.tokens
        self.inflight[rid] = req
        self.sink.request_arrived(req, event)

    def _queued(self, event: RequestEvent, req: RequestState) -> None:
        if req.running:
            self.sink.dropped(drops.INVALID_TRANSITION, event)
            return
        req.last_ts = event.timestamp
        if req.queued is None:
            req.queued = event.timestamp

    def _scheduled(self, event: RequestEvent, req: RequestState) -> None:
        if req.running:
            self.sink.dropped(drops.INVALID_TRANSITION, event)
            return
        ts = req.last_ts = event.timestamp
        req.running = True
        if req.first_scheduled is None:
            req.first_scheduled = ts
        preempted_at = req.preempted_at
        resumed = preempted_at is not None
        if preempted_at is not None:
            req.preempted_time += ts - preempted_at
            req.preempted_at = None
        self.sink.request_scheduled(req, ts, resumed)

    def _preempted(self, event: RequestEvent, req: RequestState) -> None:
        if not req.running:
            self.sink.dropped(drops.INVALID_TRANSITION, event)
            return
        ids = event.causes
        if (
            not is_count(event.num_computed_tokens)
            or type(event.reason) is not str
            or type(event.cause_kind) is not str
            or type(ids) not in (tuple, list)
            or not all(type(c) is str and len(c) <= MAX_ID_LENGTH for c in ids)
        ):
            self.sink.dropped(drops.INVALID_VALUE, event)
            return
        req.last_ts = req.preempted_at = event.timestamp
        req.running = False
        req.num_preemptions += 1
        req.recomputed_tokens += event.num_computed_tokens
        causes: list[tuple[str, Optional[RequestState]]] = []
        own = req.request_id
        credited = self.credited.pop((own, req.num_preemptions), ()) if self.credited else ()
        for cause_id in dict.fromkeys(ids):  # each cause once, in the order given
            cause = self.inflight.get(cause_id)
            if cause is not None and cause_id not in credited:
                cause.num_caused += 1
            causes.append((cause_id, cause))
        if causes:
            kind = CAUSE_SELF if len(causes) == 1 and causes[0][0] == own else CAUSE_REQUEST
        else:
            kind = event.cause_kind or CAUSE_UNKNOWN
        req.by_cause[kind] = req.by_cause.get(kind, 0) + 1
        self.sink.request_preempted(req, event, kind, causes)

    def _first_token(self, event: RequestEvent, req: RequestState) -> None:
        if req.first_token is not None:
            self.sink.dropped(drops.INVALID_TRANSITION, event)
            return
        req.last_ts = req.first_token = event.timestamp
        self.sink.first_token(req, event.timestamp)

    def _tokens(self, event: RequestEvent, req: RequestState) -> None:
        n = event.num_tokens
        if type(n) is not int or n < 0:
            self.sink.dropped(drops.INVALID_VALUE, event)
            return
        ts = req.last_ts = event.timestamp
        if req.first_token is None:
            req.first_token = ts
            self.sink.first_token(req, ts)
        last = req.last_token
        req.last_token = ts
        req.generation_tokens += n
        req.on_tokens(n, ts - last if last is not None else None, req.exemplar, req.ctx)

    def _finished(self, event: RequestEvent, req: RequestState) -> None:
        reason = event.finish_reason
        if type(reason) is not str:
            self.sink.dropped(drops.INVALID_VALUE, event)
            return
        del self.inflight[req.request_id]
        self._remember_finished(req.request_id)
        self.sink.request_finished(req, summarize(req, event.timestamp, reason), event)

    def _remember_finished(self, rid: str) -> None:
        self.finished[rid] = None
        if len(self.finished) > self.max_inflight:
            self.finished.popitem(last=False)

    def credit_causes(self, victim: str, ordinal: int, cause_ids: Sequence[str]) -> None:
        """The causes of ``victim``'s ``ordinal``-th preemption, known before its event comes (an
        engine core reports them at once, the victim's event comes with its next output, maybe
        after a cause finished): each cause in flight is credited now, the event credits only the
        others (a cause whose arrival is still to be applied: the report can be read ahead of it)."""
        credited = []
        for cause_id in dict.fromkeys(cause_ids):
            cause = self.inflight.get(cause_id)
            if cause is not None:
                cause.num_caused += 1
                credited.append(cause_id)
        if len(self.credited) >= self.max_inflight:
            self.credited.popitem(last=False)
        self.credited[(victim, ordinal)] = tuple(credited)

    def drain(self) -> list[RequestState]:
        """Forget every in-flight request (at shutdown) and return them."""
        requests = list(self.inflight.values())
        self.inflight.clear()
        return requests


def _valid_time(value: Any) -> bool:
    try:
        return 0 <= value <= MAX_TIMESTAMP  # False for NaN
    except TypeError:
        return False


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(value)
    except TypeError:
        return False
