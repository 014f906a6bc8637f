"""vLLM's engine-core stream (``EngineCoreOutputs``, decoded) as otel-llm's events.

Per request, on the engine core's own clock (``time.monotonic()``, the same clock host-wide):
ARRIVED as soon as the engine core tells what it was given (:mod:`.engine_tap`), at its arrival
(vLLM's wall-clock ``arrival_time`` brought onto that clock) with its prompt length,
``max_tokens`` and trace headers, so that a request that causes a preemption before its first
output is known; QUEUED / SCHEDULED / PREEMPTED at the timestamps vLLM's scheduler recorded (never
before the arrival taken: the two clocks are read apart), a preemption with its cause when the
engine core reported one (:mod:`.engine_core`); FIRST_TOKEN / TOKENS at the step's timestamp;
FINISHED with vLLM's finish reason. A request whose given row was lost arrives at its first
engine-core event. Per step, ``SchedulerStats`` as ``StepStats``. A request the engine core lists as
finished without a final output (aborted by its frontend) finishes ``abort``.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Optional

from otel_llm.events import CAUSE_UNKNOWN, EventType, RequestEvent, StepStats
from otel_llm.integrations.vllm.cause_channel import CauseRecord
from otel_llm.integrations.vllm.translate import SCHEDULER_FIELDS

PREEMPTED_REASON = "kv_cache_full"
MAX_KNOWN = 65_536  # requests given and not yet seen finishing; the oldest forgotten past it
_QUEUED, _SCHEDULED, _PREEMPTED = 1, 2, 3  # vLLM's EngineCoreEventType
_FINISH = {0: "stop", 1: "length", 2: "abort", 3: "error", 4: "stop"}  # vLLM's FinishReason: repetition stops


class _Running:
    __slots__ = ("arrived", "preemptions", "tokens")

    def __init__(self, arrived: float) -> None:
        self.arrived = arrived  # the ARRIVED timestamp: no later event of the request before it
        self.preemptions = 0
        self.tokens = 0


class StreamTranslator:
    """One engine core's stream into ``publish(events, step)``; ``cause_of(victim, ordinal)``
    gives a preemption's cause record, if the engine core sent one."""

    def __init__(
        self,
        publish: Callable[[list[RequestEvent], Optional[StepStats]], None],
        cause_of: Callable[[str, int], Optional[CauseRecord]],
    ) -> None:
        self._publish = publish
        self._cause_of = cause_of
        self._running: collections.OrderedDict[str, _Running] = collections.OrderedDict()
        self.lost_requests = 0  # requests the engine core could not tell us of (its queue was full)

    def knows(self, request_id: str) -> bool:
        """``request_id`` is in flight on this engine."""
        return request_id in self._running

    def given(self, rows: list[list[Any]]) -> None:
        """The engine core's REQUESTS frame: [id, arrival (wall clock), prompt tokens, max_tokens,
        headers] per request added: each arrives."""
        now = time.monotonic()
        wall = time.time() - now
        events = []
        for row in rows:
            if row and row[0] == "lost":
                self.lost_requests += int(row[1])
                continue
            request_id, arrival, prompt_tokens, max_tokens, headers = row
            rid = str(request_id)
            if rid in self._running:
                continue
            at = min(float(arrival) - wall, now)
            self._track(rid, at)
            events.append(
                RequestEvent(
                    EventType.ARRIVED,
                    rid,
                    at,
                    prompt_tokens=int(prompt_tokens),
                    max_tokens=int(max_tokens),
                    trace_context=dict(headers) if headers else None,
                )
            )
        if events:
            self._publish(events, None)

    def _track(self, rid: str, arrived: float) -> _Running:
        if len(self._running) >= MAX_KNOWN:  # the telemetry's own cap lets the oldest go too
            self._running.popitem(last=False)
        running = self._running[rid] = _Running(arrived)
        return running

    def outputs(self, eco: Any) -> None:
        """One decoded ``EngineCoreOutputs``."""
        now = float(eco.timestamp or time.monotonic())
        events: list[RequestEvent] = []
        for out in eco.outputs or ():
            rid = str(out.request_id)
            running = self._running.get(rid)
            core_events = out.events or ()
            if running is None:
                arrived = min((e.timestamp for e in core_events), default=now)
                running = self._track(rid, arrived)
                events.append(self._arrived(rid, out, arrived))
            for e in core_events:
                kind, at = int(e.type), max(e.timestamp, running.arrived)
                if kind == _QUEUED:
                    events.append(RequestEvent(EventType.QUEUED, rid, at))
                elif kind == _SCHEDULED:
                    events.append(RequestEvent(EventType.SCHEDULED, rid, at))
                elif kind == _PREEMPTED:
                    running.preemptions += 1
                    events.append(self._preempted(rid, running.preemptions, at))
            step_at = max(now, running.arrived)
            new = len(out.new_token_ids or ())
            if new:
                if running.tokens == 0:
                    events.append(RequestEvent(EventType.FIRST_TOKEN, rid, step_at))
                running.tokens += new
                events.append(RequestEvent(EventType.TOKENS, rid, step_at, num_tokens=new))
            if out.finish_reason is not None:
                reason = _FINISH.get(int(out.finish_reason), "stop")
                events.append(RequestEvent(EventType.FINISHED, rid, step_at, finish_reason=reason))
                del self._running[rid]
        for rid in eco.finished_requests or ():
            if self._running.pop(str(rid), None) is not None:  # ended with no final output: aborted
                events.append(RequestEvent(EventType.FINISHED, str(rid), now, finish_reason="abort"))
        self._publish(events, self._step(eco.scheduler_stats, now))

    @staticmethod
    def _arrived(rid: str, out: Any, at: float) -> RequestEvent:
        """A request the engine core's given rows did not name (lost): what its output says."""
        prefill = getattr(out, "prefill_stats", None)
        return RequestEvent(
            EventType.ARRIVED,
            rid,
            at,
            prompt_tokens=int(getattr(prefill, "num_prompt_tokens", 0) or 0),
            trace_context=dict(out.trace_headers) if out.trace_headers else None,
        )

    def _preempted(self, rid: str, ordinal: int, at: float) -> RequestEvent:
        record = self._cause_of(rid, ordinal)
        kind = record.kind if record is not None else CAUSE_UNKNOWN
        causes = record.causes if record is not None else ()
        return RequestEvent(
            EventType.PREEMPTED, rid, at, reason=PREEMPTED_REASON, causes=causes, cause_kind=kind if not causes else ""
        )

    @staticmethod
    def _step(stats: Any, now: float) -> Optional[StepStats]:
        if stats is None:
            return None
        running, waiting, usage = (getattr(stats, f.vllm, None) for f in SCHEDULER_FIELDS)
        skipped = getattr(stats, "num_skipped_waiting_reqs", 0)
        return StepStats(
            now,
            num_running=int(running or 0),
            num_waiting=int(waiting or 0) + (skipped if type(skipped) is int else 0),
            kv_cache_usage=min(1.0, max(0.0, float(usage or 0.0))),
            num_batched_tokens=None,
        )

    def drain(self) -> list[str]:
        """Forget every request in flight (the engine core is gone) and return their ids."""
        ids = list(self._running)
        self._running.clear()
        return ids
