"""What is known of one finished request, as plain data: the tracker derives it from the events,
and engines that hand over derived stats instead of events (vLLM's stat loggers) build it
themselves (``EngineTelemetry.record_finished``). No OpenTelemetry import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

# Why a request was cut short: RequestSummary.incomplete, the span's llm.request.incomplete.
SHUTDOWN = "shutdown"  # the engine or the telemetry stopped with the request in flight
ENGINE_DEAD = "engine_dead"  # the engine (core) died with the request in flight


@dataclass(frozen=True)
class PreemptionCause:
    """The cause of one preemption: its kind (``otel_llm.events.CAUSE_*``) and, for ``request``
    and ``self``, the ids of the requests whose KV demand it served; ``tenant_facts``: what its
    engine knows of the first of them to take a tenant from (``RequestEvent.tenant_facts``), where
    the source has it (None: its tenant is looked up by id)."""

    kind: str
    request_ids: tuple[str, ...] = ()
    tenant_facts: Optional[Mapping[str, Any]] = field(default=None, compare=False)


@dataclass(frozen=True)
class RequestSummary:
    """Everything derived for one finished request. Times: engine monotonic seconds.

    ``None`` means unknown (e.g. a request aborted before it was scheduled has no queue time);
    unknown values are not observed. ``preemptions`` lists (timestamp, num_computed_tokens,
    reason) where the source knows them, and ``preemption_causes`` their causes in the same
    order (missing ones are unknown), for a source that does not report them as events, and
    ``resumptions`` the times it was scheduled again after them.
    ``preemptions_by_cause``: the request's preemptions by cause kind, as (kind, count) pairs
    (what they leave out is unknown); ``num_preemptions_caused``: the preemptions, of any
    request, itself included, that this request's KV demand caused. ``incomplete`` says why a
    request that did not run to its end was cut short (``"shutdown"``, ``"engine_dead"``),
    ``error_type`` what failed it. ``tenant_facts``: what its engine knows of it to take a
    tenant from, as on an ARRIVED event (``RequestEvent.tenant_facts``).
    """

    request_id: str
    finish_reason: str
    arrival_time: float
    finish_time: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    max_tokens: int = 0
    num_preemptions: int = 0
    queue_time: Optional[float] = None
    ttft: Optional[float] = None
    prefill_time: Optional[float] = None
    decode_time: Optional[float] = None
    inference_time: Optional[float] = None
    time_per_output_token: Optional[float] = None
    preempted_time: Optional[float] = 0.0
    recomputed_tokens: int = 0
    cached_tokens: int = 0
    preemptions: tuple[tuple[float, int, str], ...] = ()
    resumptions: tuple[float, ...] = ()  # when it was scheduled again after each preemption, in order
    preemption_causes: tuple[PreemptionCause, ...] = ()
    preemptions_by_cause: tuple[tuple[str, int], ...] = ()
    num_preemptions_caused: int = 0
    incomplete: Optional[str] = None
    error_type: Optional[str] = None
    tenant_facts: Optional[Mapping[str, Any]] = field(default=None, compare=False)

    @property
    def e2e(self) -> float:
        return self.finish_time - self.arrival_time
