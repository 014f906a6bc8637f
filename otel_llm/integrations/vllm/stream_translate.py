"""vLLM's engine-core stream (``EngineCoreOutputs``, decoded) as otel-llm's events.

Per request, on the engine core's own clock (``time.monotonic()``, the same clock host-wide):
ARRIVED at its arrival (vLLM's wall-clock ``arrival_time`` brought onto that clock, never after
its first engine-core event) with its prompt length, ``max_tokens`` and trace headers (from what
the engine core was given, :mod:`.engine_tap`); QUEUED / SCHEDULED / PREEMPTED at the timestamps
vLLM's scheduler recorded (a preemption carries its cause when the engine core reported one:
:mod:`.engine_core`); FIRST_TOKEN / TOKENS at the step's timestamp; FINISHED with vLLM's finish
reason. Per step, ``SchedulerStats`` as ``StepStats``. A request the engine core lists as
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


class _Given:
    """What the engine core was given for one request."""

    __slots__ = ("arrival", "prompt_tokens", "max_tokens", "headers")

    def __init__(self, arrival: float, prompt_tokens: int, max_tokens: int, headers: Optional[dict]) -> None:
        self.arrival, self.prompt_tokens, self.max_tokens, self.headers = arrival, prompt_tokens, max_tokens, headers


class _Running:
    __slots__ = ("preemptions", "tokens")

    def __init__(self) -> None:
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
        self._given: collections.OrderedDict[str, _Given] = collections.OrderedDict()
        self._running: dict[str, _Running] = {}
        self.lost_requests = 0  # requests the engine core could not tell us of (its queue was full)

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def given(self, rows: list[list[Any]]) -> None:
        """The engine core's REQUESTS frame: [id, arrival (wall clock), prompt tokens, max_tokens, headers]."""
        wall = time.time() - time.monotonic()
        for row in rows:
            if row and row[0] == "lost":
                self.lost_requests += int(row[1])
                continue
            request_id, arrival, prompt_tokens, max_tokens, headers = row
            if len(self._given) >= MAX_KNOWN:
                self._given.popitem(last=False)
            self._given[str(request_id)] = _Given(float(arrival) - wall, int(prompt_tokens), int(max_tokens), headers)

    def outputs(self, eco: Any) -> None:
        """One decoded ``EngineCoreOutputs``."""
        now = float(eco.timestamp or time.monotonic())
        events: list[RequestEvent] = []
        for out in eco.outputs or ():
            rid = str(out.request_id)
            running = self._running.get(rid)
            core_events = out.events or ()
            if running is None:
                running = self._running[rid] = _Running()
                events.append(self._arrived(rid, out, min((e.timestamp for e in core_events), default=now)))
            for e in core_events:
                kind = int(e.type)
                if kind == _QUEUED:
                    events.append(RequestEvent(EventType.QUEUED, rid, e.timestamp))
                elif kind == _SCHEDULED:
                    events.append(RequestEvent(EventType.SCHEDULED, rid, e.timestamp))
                elif kind == _PREEMPTED:
                    running.preemptions += 1
                    events.append(self._preempted(rid, running.preemptions, e.timestamp))
            new = len(out.new_token_ids or ())
            if new:
                if running.tokens == 0:
                    events.append(RequestEvent(EventType.FIRST_TOKEN, rid, now))
                running.tokens += new
                events.append(RequestEvent(EventType.TOKENS, rid, now, num_tokens=new))
            if out.finish_reason is not None:
                reason = _FINISH.get(int(out.finish_reason), "stop")
                events.append(RequestEvent(EventType.FINISHED, rid, now, finish_reason=reason))
                del self._running[rid]
        for rid in eco.finished_requests or ():
            if self._running.pop(str(rid), None) is not None:  # ended with no final output: aborted
                events.append(RequestEvent(EventType.FINISHED, str(rid), now, finish_reason="abort"))
        self._publish(events, self._step(eco.scheduler_stats, now))

    def _arrived(self, rid: str, out: Any, first_event: float) -> RequestEvent:
        given = self._given.pop(rid, None)
        prefill = getattr(out, "prefill_stats", None)
        prompt_tokens = given.prompt_tokens if given else int(getattr(prefill, "num_prompt_tokens", 0) or 0)
        headers = out.trace_headers or (given.headers if given else None)
        return RequestEvent(
            EventType.ARRIVED,
            rid,
            min(given.arrival, first_event) if given else first_event,
            prompt_tokens=prompt_tokens,
            max_tokens=given.max_tokens if given else 0,
            trace_context=dict(headers) if headers else None,
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
