"""BatchObserver: what one continuous-batching engine did, as otel-llm events.

One observer per engine (per ``OutputRouter``, which a manager and its batch processor share),
called by the instrumentor's wrappers on transformers' generation thread:

- ``queued(state)``: ``Scheduler.add_waiting_request`` of a request not seen before: ARRIVED (at
  the request's own ``created_time``) and QUEUED; the same id again is an evicted request re-queued.
- ``offloaded(before, scheduler, starved)``: after ``OffloadingManager.offload_requests``: each
  request that left the active set for the waiting queue was evicted: PREEMPTED, with the tokens
  whose KV cache was freed (``position_offset``; 0 when the cache went to CPU and comes back) and
  its causes (below).
- ``batch_prepared(processor)``: after ``prepare_next_batch``: each active request not yet running
  was SCHEDULED (started, or resumed after an eviction).
- ``batch_updated(processor)``: after ``update_batch``: FIRST_TOKEN / TOKENS for the new output
  tokens, FINISHED (``stop`` on an EOS token, else ``length``), then the step's StepStats.
- ``cancelled(states)`` (``clear_cancelled_requests``): FINISHED ``abort``; ``failed(state)``
  (``OutputRouter.fail_and_deliver``): FINISHED ``error`` (ARRIVED first for a request the
  scheduler never saw).

The cause of an eviction: ``offload_requests`` takes its victims from
``Scheduler.starved_requests`` (the active requests that could not get the KV blocks of the batch
being prepared, in scheduling order), popping the last one until the starved requests left can
all allocate, or one active request is left. The starved requests left are the causes of every
eviction of that call (a set; a victim is never among them); none left: every starved request was
evicted for its own KV demand (the batch just scheduled is never touched), each its own cause.
When the starved requests cannot be read, or the victims are not the ones popped (another
release's logic), the causes are unknown, with one warning: never a guessed cause.

A soft reset folds a request's output into a new prompt (a new ``RequestState``, same id, no
generated tokens): the tokens generated before are kept in ``_Request.base`` so that the output
count goes on where it was. Timestamps are ``time.monotonic()``; transformers stamps
``created_time`` with ``time.perf_counter()``, converted with an offset taken once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Collection, Iterable, Optional

from otel_llm.events import EventType, RequestEvent, StepStats

PREEMPTION_REASON = "kv_cache_full"  # soft reset: KV cache freed, to be recomputed
CPU_OFFLOAD_REASON = "kv_cache_full_cpu_offload"  # KV cache copied to CPU, restored when rescheduled
FINISHED_STATUS = 3  # RequestStatus.FINISHED; FAILED (4) above it (internals.check_request_state)
FAILED_STATUS = 4
_PERF_TO_MONOTONIC = time.monotonic() - time.perf_counter()
_log = logging.getLogger(__name__)
_warned = threading.Event()  # the warning that causes are unknown: once


class _Request:
    __slots__ = ("state", "emitted", "base", "running")

    def __init__(self, state: Any) -> None:
        self.state = state  # transformers' RequestState (a new one after a soft reset)
        self.emitted = 0  # output tokens published so far
        self.base = 0  # output tokens generated before the current state (soft resets)
        self.running = False


class BatchObserver:
    """Translate one engine's state changes into events for an ``EngineTelemetry``."""

    def __init__(
        self, telemetry: Any, carriers: Any, max_requests: int, client_ids: Any = None, tenant_facts: Any = None
    ) -> None:
        self.telemetry = telemetry
        self._carriers = carriers  # request id -> W3C carrier, filled by add_request (caller's thread)
        # request id -> the tenant facts of its HTTP request (transformers serve), filled likewise
        self._tenant_facts = tenant_facts if tenant_facts is not None else {}
        # transformers' request id -> the client's (transformers serve's engine process): the
        # telemetry names the request by the latter, from its arrival to its finish.
        self._client_ids = client_ids if client_ids is not None else {}
        self._names: dict[str, str] = {}
        self._max_requests = max_requests
        self._requests: OrderedDict[str, _Request] = OrderedDict()  # waiting and running, oldest first
        self._running: dict[str, _Request] = {}
        self._events: list[RequestEvent] = []  # published at the end of the current engine call
        self._batched_tokens: Optional[int] = None

    # -- called inside prepare_next_batch / update_batch ---------------------------------

    def queued(self, state: Any) -> None:
        rid = state.request_id
        req = self._requests.get(rid)
        if req is not None:
            req.state = state  # an evicted request re-queued (offloaded() publishes the eviction)
            return
        if len(self._requests) >= self._max_requests:
            old_rid, _ = self._requests.popitem(last=False)  # the telemetry's own cap evicts it too
            self._running.pop(old_rid, None)
            self._names.pop(old_rid, None)
        self._requests[rid] = _Request(state)
        client_id = self._client_ids.pop(rid, None)
        if client_id is not None:
            self._names[rid] = client_id
        self._arrived(state, rid)

    def _arrived(self, state: Any, rid: str) -> None:
        ts = min(state.created_time + _PERF_TO_MONOTONIC, time.monotonic())
        max_tokens = state.max_new_tokens
        self._events += (
            RequestEvent(
                EventType.ARRIVED,
                rid,
                ts,
                prompt_tokens=len(state.initial_tokens),
                max_tokens=max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0,
                trace_context=self._carriers.pop(rid, None),
                tenant_facts=self._tenant_facts.pop(rid, None),
            ),
            RequestEvent(EventType.QUEUED, rid, ts),
        )

    def offloaded(self, before: dict[str, Any], scheduler: Any, starved: Optional[list[str]]) -> None:
        """``before``, ``starved``: the active requests and the starved ones' ids
        (``starved_ids``) when offload_requests was called."""
        active, waiting = scheduler.active_requests, scheduler.waiting_requests
        victims = [rid for rid in before if rid not in active and rid in waiting]
        if not victims:
            return
        causes = kept_starved(victims, starved, starved_ids(scheduler))
        now = time.monotonic()
        for rid in victims:
            req = self._requests.get(rid)
            if req is None:
                continue
            old, new = before[rid], waiting[rid]
            soft_reset = new is not old
            if not req.running:  # became active within this same call, then evicted
                self._events.append(RequestEvent(EventType.SCHEDULED, rid, now))
            self._events.append(
                RequestEvent(
                    EventType.PREEMPTED,
                    rid,
                    now,
                    num_computed_tokens=old.position_offset if soft_reset else 0,
                    reason=PREEMPTION_REASON if soft_reset else CPU_OFFLOAD_REASON,
                    causes=() if causes is None else causes or (rid,),
                )
            )
            if soft_reset:
                req.base = req.emitted
            req.state, req.running = new, False
            self._running.pop(rid, None)

    def cancelled(self, states: Iterable[Any]) -> None:
        now = time.monotonic()
        for state in states:
            rid = state.request_id
            req = self._requests.pop(rid, None)
            if req is not None:
                self._running.pop(rid, None)
                self._events.append(RequestEvent(EventType.FINISHED, rid, now, finish_reason="abort"))

    def failed(self, state: Any) -> None:
        rid = state.request_id
        if not isinstance(rid, str):
            return
        req = self._requests.pop(rid, None)
        if req is None:
            self._arrived(state, rid)  # failed before the scheduler saw it (e.g. bad logits-processor kwargs)
        self._running.pop(rid, None)
        self._events.append(RequestEvent(EventType.FINISHED, rid, time.monotonic(), finish_reason="error"))

    def batch_prepared(self, processor: Any, has_batch: bool) -> None:
        scheduler = processor.scheduler
        now = time.monotonic()
        for rid in scheduler.active_requests:
            req = self._requests.get(rid)
            if req is not None and not req.running:
                req.running = True
                req.state = scheduler.active_requests[rid]
                self._running[rid] = req
                self._events.append(RequestEvent(EventType.SCHEDULED, rid, now))
        self._batched_tokens = _batched_tokens(processor) if has_batch else None
        if not has_batch:  # idle or stopping: the step stats say so, and pending events are applied
            self.publish(_step(processor, now, None))

    def batch_updated(self, processor: Any) -> None:
        now = time.monotonic()
        events = self._events
        finished = []
        for rid, req in self._running.items():
            state = req.state
            total = req.base + len(state.generated_tokens)
            if total > req.emitted:
                if req.emitted == 0:
                    events.append(RequestEvent(EventType.FIRST_TOKEN, rid, now))
                events.append(RequestEvent(EventType.TOKENS, rid, now, num_tokens=total - req.emitted))
                req.emitted = total
            status = int(state.status)
            if status >= FINISHED_STATUS:
                reason = "error" if status >= FAILED_STATUS else _finish_reason(state)
                events.append(RequestEvent(EventType.FINISHED, rid, now, finish_reason=reason))
                finished.append(rid)
        for rid in finished:
            del self._running[rid]
            self._requests.pop(rid, None)
        self.publish(_step(processor, now, self._batched_tokens))

    # -- publishing -----------------------------------------------------------------------

    def publish(self, stats: Optional[StepStats] = None) -> None:
        if self._events:
            events, self._events = self._events, []
            if self._names:
                events = [self._named(e) for e in events]
            self.telemetry.on_events(events)
        if stats is not None:
            self.telemetry.on_step(stats)

    def _named(self, event: RequestEvent) -> RequestEvent:
        """``event`` with the client's ids for transformers' (its request and its causes)."""
        names = self._names
        name = names.get(event.request_id)
        causes = tuple(names.get(c, c) for c in event.causes)
        if event.type is EventType.FINISHED:
            names.pop(event.request_id, None)
        if name is None and causes == event.causes:
            return event
        return dataclasses.replace(event, request_id=name or event.request_id, causes=causes)

    def in_flight(self) -> int:
        return len(self._requests)


def _finish_reason(state: Any) -> str:
    eos = state.eos_token_id
    ids = {eos} if isinstance(eos, int) else set(eos or ())
    tokens = state.generated_tokens
    return "stop" if tokens and tokens[-1] in ids and tokens[-1] >= 0 else "length"


def _batched_tokens(processor: Any) -> Optional[int]:
    """Tokens in the batch just prepared: the scheduled requests' query lengths."""
    io = processor.inputs_and_outputs
    pairs = getattr(io, "io_pairs", None)  # asynchronous batching: the current pair's host side
    if pairs is not None:
        io = pairs[io.current_pair].host_io
    batch = getattr(io, "requests_in_batch", None)
    if batch is None:
        return None
    return sum(future.query_length for future in batch)


def _step(processor: Any, now: float, batched_tokens: Optional[int]) -> StepStats:
    scheduler = processor.scheduler
    free = processor.cache.compute_free_capacity()
    return StepStats(
        now,
        num_running=len(scheduler.active_requests),
        num_waiting=len(scheduler.waiting_requests),
        kv_cache_usage=min(1.0, max(0.0, 1.0 - float(free))),
        num_batched_tokens=batched_tokens,
    )


def starved_ids(scheduler: Any) -> Optional[list[str]]:
    """The request ids of ``scheduler.starved_requests`` (``(state, tokens)`` pairs), in order;
    ``None`` when that is not what it holds."""
    starved = getattr(scheduler, "starved_requests", None)
    if not isinstance(starved, list):
        return None
    ids = []
    for entry in starved:
        rid = getattr(entry[0], "request_id", None) if isinstance(entry, tuple) and entry else None
        if not isinstance(rid, str):
            return None
        ids.append(rid)
    return ids


def kept_starved(
    victims: Collection[str], before: Optional[list[str]], after: Optional[list[str]]
) -> Optional[tuple[str, ...]]:
    """The starved requests that one ``offload_requests`` call kept (``before`` and ``after`` it),
    the causes of its ``victims``; ``()``: none kept, each victim its own cause; ``None``: the
    engine cannot say."""
    if before is not None and after is not None and before[: len(after)] == after:
        if set(before[len(after) :]) == set(victims):
            return tuple(after)
    if not _warned.is_set():
        _warned.set()
        _log.warning(
            "otel-llm transformers instrumentation: the evicted requests are not the starved requests that "
            "OffloadingManager.offload_requests popped (Scheduler.starved_requests %s); the causes of "
            "evictions are unknown (logged once)",
            "unreadable" if before is None or after is None else "not as relied on",
        )
    return None
