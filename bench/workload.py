"""Synthetic event streams, generated once up front and replayed through every subscriber.

``event_mix`` simulates a busy engine in steady state: ``running`` requests decoding (one
TOKENS event per running request per step), Poisson arrivals (ARRIVED + QUEUED), schedules,
occasional bursts of recompute preemptions (victims: the most recently scheduled, as vLLM
does; they resume later with a SCHEDULED), first tokens and finishes. Times are simulated
monotonic seconds, strictly increasing between steps, so every interval is valid.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from otel_llm.events import EventType, RequestEvent, StepStats


@dataclass
class EventMix:
    warmup: list[tuple[list[RequestEvent], StepStats]]  # replayed untimed: ramps up to `running`
    steps: list[tuple[list[RequestEvent], StepStats]]  # the timed part
    counts: dict[str, int] = field(default_factory=dict)  # per event type, timed part only

    @property
    def num_events(self) -> int:
        return sum(len(events) for events, _ in self.steps)


@dataclass
class _Req:
    rid: str
    prompt: int
    target: int  # output tokens at which it finishes
    max_tokens: int
    generated: int = 0
    started: bool = False  # had its first token


TENANTS = 8


def event_mix(
    num_steps: int,
    running: int = 256,
    seed: int = 0,
    step_dt: float = 0.025,
    output_median: int = 120,
    preempt_every: int = 40,
) -> EventMix:
    """``num_steps`` timed steps after a warm-up that fills ``running`` slots."""
    rng = random.Random(seed)
    t = 1000.0
    next_id = 0
    run: list[_Req] = []
    waiting: deque[_Req] = deque()

    def new_request(ts: float, out: list[RequestEvent]) -> None:
        nonlocal next_id
        prompt = max(1, min(4000, round(rng.lognormvariate(math.log(400), 0.8))))
        target = max(1, min(2000, round(rng.lognormvariate(math.log(output_median), 0.7))))
        max_tokens = max(target, 256) if rng.random() < 0.7 else target
        req = _Req(f"req-{seed}-{next_id:07d}", prompt, target, max_tokens)
        next_id += 1
        # Eight tenants by priority (read only with OTEL_LLM_TENANT=priority: per_event's ours_tenants8).
        facts = {"priority": next_id % TENANTS}
        out.append(
            RequestEvent(
                EventType.ARRIVED, req.rid, ts, prompt_tokens=prompt, max_tokens=max_tokens, tenant_facts=facts
            )
        )
        out.append(RequestEvent(EventType.QUEUED, req.rid, ts))
        waiting.append(req)

    def step(arrivals: int, preempt: int) -> tuple[list[RequestEvent], StepStats]:
        nonlocal t
        t += step_dt * (0.9 + 0.2 * rng.random())
        ts_sched = t
        ts_out = t + step_dt * 0.8
        out: list[RequestEvent] = []
        for _ in range(arrivals):
            new_request(ts_sched, out)
        for _ in range(min(preempt, len(run))):  # recompute preemption: victim = most recently scheduled
            victim = run.pop()
            out.append(
                RequestEvent(
                    EventType.PREEMPTED,
                    victim.rid,
                    ts_sched,
                    num_computed_tokens=victim.prompt + victim.generated,
                    reason="kv_cache_full",
                )
            )
            waiting.appendleft(victim)
        if not preempt:  # vLLM admits nobody in a step that preempted
            while waiting and len(run) < running:
                req = waiting.popleft()
                out.append(RequestEvent(EventType.SCHEDULED, req.rid, ts_sched))
                run.append(req)
        still: list[_Req] = []
        batched = 0
        for req in run:
            if not req.started:
                req.started = True
                out.append(RequestEvent(EventType.FIRST_TOKEN, req.rid, ts_out))
                batched += req.prompt
            else:
                batched += 1
            req.generated += 1
            out.append(RequestEvent(EventType.TOKENS, req.rid, ts_out, num_tokens=1))
            if req.generated >= req.target:
                reason = "length" if req.generated >= req.max_tokens else "stop"
                out.append(RequestEvent(EventType.FINISHED, req.rid, ts_out, finish_reason=reason))
            else:
                still.append(req)
        run[:] = still
        stats = StepStats(
            timestamp=ts_out,
            num_running=len(run),
            num_waiting=len(waiting),
            kv_cache_usage=min(1.0, len(run) / running),
            num_batched_tokens=batched,
        )
        return out, stats

    warmup = []
    while len(run) < running:  # ramp up: arrivals until the slots are full
        warmup.append(step(min(32, running - len(run) - len(waiting) + 4), 0))
    for _ in range(output_median // 2):  # let finishes start, so the timed part is steady state
        warmup.append(step(_poisson(rng, running / output_median), 0))
    steps = []
    for i in range(num_steps):
        preempt = rng.choice((1, 2, 3, 8)) if i % preempt_every == preempt_every - 1 else 0
        steps.append(step(_poisson(rng, running / output_median), preempt))
    counts: dict[str, int] = {k.name: 0 for k in EventType}
    for events, _ in steps:
        for e in events:
            counts[e.type.name] += 1
    return EventMix(warmup, steps, counts)


def _poisson(rng: random.Random, lam: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def lifecycle_batch(
    start: int, count: int, t: float, tokens: int = 4, prefix: str = "m"
) -> tuple[list[RequestEvent], float]:
    """Complete lifecycles of ``count`` requests (arrive, queue, schedule, tokens, finish) in one batch."""
    out: list[RequestEvent] = []
    append = out.append
    for i in range(start, start + count):
        rid = f"{prefix}{i}"
        append(RequestEvent(EventType.ARRIVED, rid, t, prompt_tokens=64, max_tokens=64))
        append(RequestEvent(EventType.QUEUED, rid, t))
        append(RequestEvent(EventType.SCHEDULED, rid, t + 0.001))
        append(RequestEvent(EventType.FIRST_TOKEN, rid, t + 0.01))
        for k in range(tokens):
            append(RequestEvent(EventType.TOKENS, rid, t + 0.01 + 0.02 * k, num_tokens=1))
        append(RequestEvent(EventType.FINISHED, rid, t + 0.01 + 0.02 * tokens, finish_reason="stop"))
    return out, t + 0.01 + 0.02 * tokens + 0.001
