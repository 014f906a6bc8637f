"""The neutral event vocabulary that engines publish (docs/architecture.md, "Contract: the event
vocabulary").

Pure data: importing this module must never import OpenTelemetry, so that an engine can
publish events without depending on the telemetry stack.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = [
    "EventType",
    "RequestEvent",
    "StepStats",
    "CAUSE_REQUEST",
    "CAUSE_SELF",
    "CAUSE_UNKNOWN",
    "CAUSE_CACHE_RESET",
]

# Why a request was preempted (the kind of its cause): the KV demand of other requests, its own
# (the last one running), something that is no request (an engine's cache reset), or unknown
# (the engine cannot say). Engines give the request ids of the causes (``RequestEvent.causes``)
# or, where no request is the cause, a kind (``cause_kind``); the telemetry tells the rest.
CAUSE_REQUEST = "request"
CAUSE_SELF = "self"
CAUSE_UNKNOWN = "unknown"
CAUSE_CACHE_RESET = "cache_reset"


class EventType(enum.Enum):
    """What happened to a request.

    A request starts with ARRIVED and ends with FINISHED; SCHEDULED starts or resumes running;
    PREEMPTED sends it back to waiting; FIRST_TOKEN marks the first output token; TOKENS
    carries decode progress (new output tokens this step, the first step's included).
    """

    # Members are singletons compared by identity: the identity hash is consistent with that,
    # and a dict lookup keyed by a member costs ~17 ns instead of ~60 (Enum.__hash__ is Python).
    __hash__ = object.__hash__

    ARRIVED = "arrived"
    QUEUED = "queued"
    SCHEDULED = "scheduled"
    PREEMPTED = "preempted"
    FIRST_TOKEN = "first_token"
    TOKENS = "tokens"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestEvent:
    """One event of one request. ``timestamp`` is the engine's ``time.monotonic()`` in seconds."""

    type: EventType
    request_id: str
    timestamp: float
    prompt_tokens: int = 0  # ARRIVED
    max_tokens: int = 0  # ARRIVED
    num_tokens: int = 0  # TOKENS: new output tokens this step
    num_computed_tokens: int = 0  # PREEMPTED: computed tokens thrown away
    reason: str = ""  # PREEMPTED, e.g. "kv_cache_full"
    # PREEMPTED: the requests whose KV demand the preemption served (the request's own id when it
    # was its own cause); none: ``cause_kind`` says why (e.g. CAUSE_CACHE_RESET), else unknown.
    causes: tuple[str, ...] = ()
    cause_kind: str = ""
    finish_reason: str = ""  # FINISHED: stop, length, abort, error
    num_cached_tokens: int = 0  # prefix-cache hits, where the engine knows them
    trace_context: Optional[Mapping[str, str]] = None  # ARRIVED: W3C traceparent/tracestate/baggage carrier
    # ARRIVED: what a tenant can be taken from (OTEL_LLM_TENANT), as the engine knows it: "priority",
    # "lora" (adapter name), "model" (served model name), "header:<lower-case name>".
    tenant_facts: Optional[Mapping[str, Any]] = None
    prompt_text: Optional[str] = None  # ARRIVED: recorded only when the config asks for content
    output_text: Optional[str] = None  # FINISHED: recorded only when the config asks for content


@dataclass(slots=True)
class StepStats:
    """Engine-wide state, published once per engine step."""

    timestamp: float
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    # Tokens computed in this step (prefill + decode); None when the stats are a scheduler
    # snapshot rather than an engine iteration (vLLM hands those over separately).
    num_batched_tokens: Optional[int] = None
