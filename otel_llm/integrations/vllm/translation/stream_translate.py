"""vLLM's engine-core stream (``EngineCoreOutputs``, decoded) as otel-llm's events.

Per request, on the engine core's own clock (``time.monotonic()``, the same clock host-wide):
ARRIVED as soon as the engine core tells what it was given (:mod:`.engine_tap`), at its arrival
(vLLM's wall-clock ``arrival_time`` brought onto that clock) with its prompt length,
``max_tokens``, trace headers and tenant facts (its priority, LoRA adapter, the served model), so
that a request that causes a preemption before its first output is known; QUEUED / SCHEDULED /
PREEMPTED at the timestamps vLLM's scheduler recorded (never before the arrival taken: the two
clocks are read apart), a preemption with its cause when the engine core reported one
(:mod:`.engine_core`); FIRST_TOKEN / TOKENS at the step's timestamp; FINISHED with vLLM's finish
reason. A request whose given row was lost arrives at its first engine-core event (its tenant
facts: the served model only). Per step, ``SchedulerStats`` as ``StepStats``.

A request its frontend ends (a client gone, a stop string its detokenizer found, an explicit
abort) gets no output: the engine core's tap tells its abort at once, with its time
(:meth:`StreamTranslator.aborted`). Outputs made before it may still be on their way (vLLM's output
thread sends after its busy loop), so it finishes ``abort`` when an output made after the abort
comes, or when :meth:`StreamTranslator.settle` says its time is long past (an idle engine core
sends nothing more). A request the engine core lists as finished without a final output (vLLM's
data-parallel balancing does) finishes ``abort`` too.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Optional

from otel_llm.events import CAUSE_UNKNOWN, EventType, RequestEvent, StepStats
from otel_llm.integrations.vllm.channels.cause_channel import CauseRecord
from otel_llm.integrations.vllm.translation.enums import PREEMPTED as _PREEMPTED
from otel_llm.integrations.vllm.translation.enums import QUEUED as _QUEUED
from otel_llm.integrations.vllm.translation.enums import SCHEDULED as _SCHEDULED
from otel_llm.integrations.vllm.translation.enums import finish_reason
from otel_llm.integrations.vllm.translation.fields import FieldReader
from otel_llm.integrations.vllm.translation.translate import (
    DEFAULT_PREEMPTION_REASON,
    SCHEDULER_FIELDS,
    scheduler_gauges,
)

MAX_KNOWN = 65_536  # requests given and not yet seen finishing; the oldest forgotten past it
_RUNNING, _WAITING, _USAGE = (f.vllm for f in SCHEDULER_FIELDS)  # SchedulerStats' fields, as decoded
_TOKENS = EventType.TOKENS  # a module global: reading a member through its Enum class costs more, per output


def decoder(reader: FieldReader) -> Callable[[Any], Any]:
    """A decoder of vLLM's encoded ``EngineCoreOutputs`` (its first buffer) into what
    :meth:`StreamTranslator.outputs` reads: the fields translated, typed; every other field (the
    tensors' out-of-band buffers not looked up) as msgpack has it, mostly None. Each struct's
    fields, their order and its layout (array or map) are vLLM's own classes'; its stats
    (dataclasses) are maps, read by name: a ``SchedulerStats`` field this vLLM does not have is
    said once through ``reader``, as the stat-logger path says it (its gauge stays 0)."""
    import dataclasses

    import msgspec
    from vllm.v1.engine import EngineCoreEvent, EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats

    present = {f.name for f in dataclasses.fields(SchedulerStats)}
    for f in SCHEDULER_FIELDS:
        if f.vllm not in present:
            reader.warn_once(
                "SchedulerStats", f.vllm, f"is missing (vLLM changed its stats?): {f.metric} is not recorded"
            )

    def like(cls: Any, typed: dict[str, Any]) -> Any:
        fields = [(name, typed.get(name, Any), None) for name in cls.__struct_fields__]
        array_like = cls.__struct_config__.array_like
        return msgspec.defstruct(f"Translated{cls.__name__}", fields, array_like=array_like, gc=False)

    event = like(EngineCoreEvent, {"type": int, "timestamp": float})
    prefill = msgspec.defstruct("TranslatedPrefill", [("num_prompt_tokens", int, 0)])
    scheduler = msgspec.defstruct(
        "TranslatedScheduler",
        [(_RUNNING, int, 0), (_WAITING, int, 0), ("num_skipped_waiting_reqs", int, 0), (_USAGE, float, 0.0)],
    )
    output = like(
        EngineCoreOutput,
        {
            "request_id": str,
            "new_token_ids": Optional[list[int]],
            "finish_reason": Optional[int],
            "events": Optional[list[event]],  # type: ignore[valid-type]
            "trace_headers": Optional[dict[str, str]],
            "prefill_stats": Optional[prefill],
        },
    )
    outputs = like(
        EngineCoreOutputs,
        {
            "outputs": Optional[list[output]],  # type: ignore[valid-type]
            "scheduler_stats": Optional[scheduler],
            "timestamp": Optional[float],
            "finished_requests": Optional[list[str]],
        },
    )
    return msgspec.msgpack.Decoder(outputs).decode


class _Running:
    __slots__ = ("rid", "arrived", "preemptions", "tokens")

    def __init__(self, rid: str, arrived: float) -> None:
        # The id as first given: the telemetry's key too. Its events carry this very string (a
        # dict lookup then matches it by identity), not the equal one decoded from each output.
        self.rid = rid
        self.arrived = arrived  # the ARRIVED timestamp: no later event of the request before it
        self.preemptions = 0
        self.tokens = 0


class StreamTranslator:
    """One engine core's stream into ``publish(events, step)``; ``cause_of(victim, ordinal)``
    gives a preemption's cause record, if the engine core sent one; ``drain_causes()`` takes in
    the cause records sent so far (crediting their causes), called before an output that may
    need them (a preemption, a finish): an output of new tokens only needs none. ``reader``
    reads vLLM's stats, as the stat-logger path does."""

    def __init__(
        self,
        publish: Callable[[list[RequestEvent], Optional[StepStats]], None],
        cause_of: Callable[[str, int], Optional[CauseRecord]],
        drain_causes: Callable[[], None],
        reader: FieldReader,
        model: Optional[str] = None,
    ) -> None:
        self._publish = publish
        self._model = model  # the served model's name, from the hello: the tenant fact "model"
        self._reader = reader
        self._gauges: tuple[int, int, float] = (0, 0, 0.0)  # the last SchedulerStats read
        self._cause_of = cause_of
        self._drain_causes = drain_causes
        self._running: collections.OrderedDict[str, _Running] = collections.OrderedDict()
        self._aborts: dict[str, float] = {}  # request id -> when the engine core aborted it, not yet ended
        self.lost_requests = 0  # requests the engine core could not tell us of (its queue was full)

    def knows(self, request_id: str) -> bool:
        """``request_id`` is in flight on this engine."""
        return request_id in self._running

    def given(self, rows: list[list[Any]]) -> None:
        """The engine core's REQUESTS frame: [id, arrival (wall clock), prompt tokens, max_tokens,
        headers, priority, LoRA adapter name] per request added (a row of the first five only:
        no tenant facts but the model): each arrives, with its tenant facts."""
        now = time.monotonic()
        wall = time.time() - now
        events = []
        for row in rows:
            if row and row[0] == "lost":
                self.lost_requests += int(row[1])
                continue
            request_id, arrival, prompt_tokens, max_tokens, headers = row[:5]
            priority, lora = (row[5], row[6]) if len(row) >= 7 else (None, None)
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
                    tenant_facts={"priority": priority, "lora": lora, "model": self._model},
                )
            )
        if events:
            self._publish(events, None)

    def _track(self, rid: str, arrived: float) -> _Running:
        if len(self._running) >= MAX_KNOWN:  # the telemetry's own cap lets the oldest go too
            self._running.popitem(last=False)
        running = self._running[rid] = _Running(rid, arrived)
        return running

    def outputs(self, eco: Any) -> None:
        """One decoded ``EngineCoreOutputs``."""
        now = float(eco.timestamp or time.monotonic())
        events: list[RequestEvent] = []
        running_by_id = self._running
        drained = False
        for out in eco.outputs or ():
            running = running_by_id.get(out.request_id)
            # Most outputs, step after step: new tokens of a request past its first, nothing else.
            if running is not None and running.tokens and out.events is None and out.finish_reason is None:
                new = len(out.new_token_ids or ())
                if new:
                    running.tokens += new
                    at = max(now, running.arrived)
                    events.append(RequestEvent(_TOKENS, running.rid, at, 0, 0, new))  # num_tokens=new
            else:
                if not drained:
                    self._drain_causes()
                    drained = True
                self._output(out, running, now, events)
        if eco.finished_requests and not drained:
            self._drain_causes()
            drained = True
        for rid in eco.finished_requests or ():
            if self._running.pop(str(rid), None) is not None:  # ended with no final output: aborted
                events.append(RequestEvent(EventType.FINISHED, str(rid), now, finish_reason="abort"))
        if self._aborts:
            self._end_aborted(now, events, drained)
        self._publish(events, self._step(eco.scheduler_stats, now))

    def aborted(self, at: float, request_ids: list[str]) -> None:
        """The engine core's ABORTED frame: these requests were aborted at ``at`` (its clock);
        each ends once the outputs made before ``at`` are in."""
        aborts = self._aborts
        for rid in request_ids:
            if len(aborts) >= MAX_KNOWN:
                aborts.pop(next(iter(aborts)))
            aborts[str(rid)] = float(at)

    def settle(self, until: float) -> bool:
        """End the requests aborted at ``until`` or before: no output made before their abort is
        still on its way (the consumer's judgement, by how long ago that was). True when one ended."""
        events: list[RequestEvent] = []
        self._end_aborted(until, events, drained=False)
        if events:
            self._publish(events, None)
        return bool(events)

    def _end_aborted(self, until: float, events: list[RequestEvent], drained: bool) -> None:
        """The FINISHED events of the requests aborted at ``until`` or before, the cause records
        sent so far taken in first (``drained``: they already were)."""
        due = [(rid, at) for rid, at in self._aborts.items() if at <= until]
        if due and not drained:
            self._drain_causes()
        for rid, at in due:
            del self._aborts[rid]
            running = self._running.pop(rid, None)
            if running is not None:  # else finished by an output meanwhile, or never given
                events.append(
                    RequestEvent(EventType.FINISHED, running.rid, max(at, running.arrived), finish_reason="abort")
                )

    def _output(self, out: Any, running: Optional[_Running], now: float, events: list[RequestEvent]) -> None:
        """One request's output, whatever it holds."""
        rid = str(out.request_id)
        core_events = out.events or ()
        if running is None:
            arrived = min((e.timestamp for e in core_events), default=now)
            running = self._track(rid, arrived)
            events.append(self._arrived(rid, out, arrived, self._model))
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
            events.append(RequestEvent(_TOKENS, rid, step_at, num_tokens=new))
        if out.finish_reason is not None:
            reason = finish_reason(out.finish_reason)
            events.append(RequestEvent(EventType.FINISHED, rid, step_at, finish_reason=reason))
            del self._running[rid]

    @staticmethod
    def _arrived(rid: str, out: Any, at: float, model: Optional[str]) -> RequestEvent:
        """A request the engine core's given rows did not name (lost): what its output says (no
        priority, no adapter)."""
        prefill = getattr(out, "prefill_stats", None)
        return RequestEvent(
            EventType.ARRIVED,
            rid,
            at,
            prompt_tokens=int(getattr(prefill, "num_prompt_tokens", 0) or 0),
            trace_context=dict(out.trace_headers) if out.trace_headers else None,
            tenant_facts={"model": model},
        )

    def _preempted(self, rid: str, ordinal: int, at: float) -> RequestEvent:
        record = self._cause_of(rid, ordinal)
        kind = record.kind if record is not None else CAUSE_UNKNOWN
        causes = record.causes if record is not None else ()
        return RequestEvent(
            EventType.PREEMPTED,
            rid,
            at,
            reason=DEFAULT_PREEMPTION_REASON,
            causes=causes,
            cause_kind=kind if not causes else "",
        )

    def _step(self, stats: Any, now: float) -> Optional[StepStats]:
        if stats is None:
            return None
        running, waiting, usage = self._gauges = scheduler_gauges(self._reader, stats, self._gauges)
        # num_batched_tokens: None, a scheduler snapshot is not an iteration
        return StepStats(now, running, waiting, min(1.0, max(0.0, usage)), None)

    def drain(self) -> list[str]:
        """Forget every request in flight (the engine core is gone) and return their ids."""
        ids = list(self._running)
        self._running.clear()
        return ids
