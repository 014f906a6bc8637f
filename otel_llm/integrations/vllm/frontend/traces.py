"""What the deep hook keeps of each request in vLLM's API server (:class:`RequestTrace`, on
vLLM's per-request ``RequestStateStats``, so that it lives and dies with the request), the
requests that ended without vLLM's stats (:data:`ended`), and the requests in flight by vLLM's
internal request id (:data:`in_flight`), through which the causes of preemptions that the
engine core reports (:mod:`.attribution`) reach the traces of both the victim and its cause."""

from __future__ import annotations

import collections
import time
from typing import Any, Iterable, Optional

from otel_llm.integrations.vllm.translation.enums import PREEMPTED, SCHEDULED

TRACE_ATTR = "_otel_llm_trace"
MAX_ENDED = 4096
MAX_IN_FLIGHT = 65_536  # requests whose causes can be told; the oldest are let go beyond


class RequestTrace:
    """What the hook saw of one request: its engine-core events, arrival time and TTFT, the
    causes of its preemptions and the preemptions it caused."""

    __slots__ = (
        "events",
        "arrival_time",
        "first_token_latency",
        "carrier",
        "ended",
        "stopping",
        "internal_id",
        "external_id",
        "causes",
        "caused",
        "tenant_facts",
        "values",
    )

    def __init__(self) -> None:
        self.events: list[tuple[int, float]] = []  # (EngineCoreEventType value, monotonic ts)
        self.arrival_time: Optional[float] = None  # wall clock (vLLM frontend)
        self.first_token_latency: Optional[float] = None
        self.carrier: Optional[dict] = None  # the caller's traceparent / tracestate
        self.ended = False  # its span is made (or queued to be): no second one
        self.stopping = False  # in flight when vLLM began to shut down: an abort then is the shutdown's
        self.internal_id: Optional[str] = None  # vLLM's request id in the engine core
        self.external_id: Optional[str] = None  # the id the client knows (the internal one has a suffix)
        # Preemption ordinal -> (cause kind, the causes' ids as the client knows them where this
        # server has them, their internal ids, the first cause's tenant facts if it is here), as
        # the engine core reported it.
        self.causes: dict[int, tuple[str, tuple[str, ...], tuple[str, ...], Optional[dict]]] = {}
        self.caused = 0  # preemptions this request's KV demand caused (itself included)
        # What a tenant is taken from (RequestEvent.tenant_facts): its priority and LoRA adapter.
        self.tenant_facts: Optional[dict] = None
        # Its tenant's per-step values (tenant_steps.TenantValues), with a tenant source that needs them.
        self.values: Any = None

    @property
    def preempted_at(self) -> tuple[float, ...]:
        return tuple(ts for kind, ts in self.events if kind == PREEMPTED)

    @property
    def resumed_at(self) -> tuple[float, ...]:
        """When it was scheduled again after each preemption."""
        out = []
        preempted = False
        for kind, ts in self.events:
            if kind == PREEMPTED:
                preempted = True
            elif kind == SCHEDULED and preempted:
                out.append(ts)
                preempted = False
        return tuple(out)

    def preempted_time(self, finish_time: float) -> float:
        """Sum over preemptions of (next SCHEDULED - PREEMPTED); a request still waiting at
        its finish (aborted) counts until ``finish_time`` (same monotonic clock)."""
        total = 0.0
        since: Optional[float] = None
        for kind, ts in self.events:
            if kind == PREEMPTED and since is None:
                since = ts
            elif kind == SCHEDULED and since is not None:
                total += max(0.0, ts - since)
                since = None
        if since is not None:
            total += max(0.0, finish_time - since)
        return total


class EndedRequest:
    """A request that ended without ``FinishedRequestStats``, as the output processor knew it
    (wall-clock times): aborted (``incomplete`` None), or cut short by vLLM's shutdown or by the
    death of its engine core."""

    __slots__ = (
        "request_id",
        "internal_id",
        "arrival_time",
        "end_time",
        "prompt_tokens",
        "max_tokens",
        "generation_tokens",
        "trace",
        "incomplete",
        "error_type",
    )

    def __init__(self, req_state: Any, incomplete: Optional[str] = None, error_type: Optional[str] = None) -> None:
        stats = getattr(req_state, "stats", None)
        self.internal_id = str(getattr(req_state, "request_id", ""))
        self.request_id = str(getattr(req_state, "external_req_id", None) or self.internal_id)
        self.end_time = time.time()
        arrival = getattr(stats, "arrival_time", None)
        self.arrival_time = arrival if isinstance(arrival, (int, float)) and arrival > 0 else self.end_time
        self.prompt_tokens = _count(getattr(req_state, "prompt_len", 0))
        self.max_tokens = _count(getattr(req_state, "max_tokens_param", 0))
        self.generation_tokens = _count(getattr(stats, "num_generation_tokens", 0))
        self.trace = trace_on(req_state)
        self.trace.ended = True
        self.incomplete = incomplete
        self.error_type = error_type


def trace_on(req_state: Any) -> RequestTrace:
    """The trace kept on a vLLM RequestState's stats, made there if there is none yet."""
    stats = getattr(req_state, "stats", None)
    trace = getattr(stats, TRACE_ATTR, None)
    if not isinstance(trace, RequestTrace):
        trace = RequestTrace()
        if stats is not None:
            setattr(stats, TRACE_ATTR, trace)
    return trace


def trace_of(finished_stats: Any) -> Optional[RequestTrace]:
    """The trace the hook attached to vLLM's ``FinishedRequestStats``, if any."""
    trace = getattr(finished_stats, TRACE_ATTR, None)
    return trace if isinstance(trace, RequestTrace) else None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


# Filled by the output processor's thread, drained by the stat logger (deque appends and pops are atomic).
ended: "collections.deque[EndedRequest]" = collections.deque(maxlen=MAX_ENDED)
lost = [0]  # requests pushed out of a full ``ended`` before a stat logger took them
# vLLM's internal request id -> its trace, from the request's arrival until its span is made.
in_flight: "collections.OrderedDict[str, RequestTrace]" = collections.OrderedDict()


def arrived(internal_id: str, trace: RequestTrace) -> None:
    in_flight[internal_id] = trace
    if len(in_flight) > MAX_IN_FLIGHT:
        in_flight.popitem(last=False)


def end(states: Iterable[Any], incomplete: Optional[str] = None, error_type: Optional[str] = None) -> None:
    """Queue what is known of requests that ended without vLLM's stats (once each)."""
    for state in states:
        if trace_on(state).ended:
            continue
        if len(ended) == MAX_ENDED:
            lost[0] += 1
        ended.append(EndedRequest(state, incomplete, error_type))
