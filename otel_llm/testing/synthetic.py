"""Synthetic request events, for feeding a telemetry without an engine."""

from __future__ import annotations

from otel_llm.events import EventType, RequestEvent


def lifecycle(
    request_id: str,
    t0: float,
    preemptions: int = 0,
    tokens: int = 3,
    prompt_tokens: int = 10,
    max_tokens: int = 16,
    finish_reason: str = "stop",
) -> list[RequestEvent]:
    """The events of one complete, valid request from ``t0`` (engine monotonic seconds): arrive,
    queue, schedule, ``preemptions`` preempt/resume cycles (the k-th throws away
    ``prompt_tokens + k`` computed tokens, reason ``kv_cache_full``), the first token, ``tokens``
    output steps of one token each, finish with ``finish_reason``."""
    rid = request_id
    events = [
        RequestEvent(EventType.ARRIVED, rid, t0, prompt_tokens=prompt_tokens, max_tokens=max_tokens),
        RequestEvent(EventType.QUEUED, rid, t0 + 0.001),
        RequestEvent(EventType.SCHEDULED, rid, t0 + 0.01),
    ]
    t = t0 + 0.01
    for k in range(preemptions):
        events.append(
            RequestEvent(
                EventType.PREEMPTED, rid, t + 0.002, num_computed_tokens=prompt_tokens + k, reason="kv_cache_full"
            )
        )
        events.append(RequestEvent(EventType.SCHEDULED, rid, t + 0.005))
        t += 0.005
    events.append(RequestEvent(EventType.FIRST_TOKEN, rid, t + 0.02))
    for k in range(tokens):
        events.append(RequestEvent(EventType.TOKENS, rid, t + 0.02 + 0.03 * k, num_tokens=1))
    events.append(
        RequestEvent(EventType.FINISHED, rid, t + 0.02 + 0.03 * max(tokens - 1, 0), finish_reason=finish_reason)
    )
    return events
