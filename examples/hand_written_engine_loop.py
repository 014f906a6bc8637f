"""Instrument a hand-written engine loop with the hook bus: the engine only publishes events.

The toy engine below has 6 KV blocks of 4 tokens. Each step it admits waiting requests while
blocks are free, grows every running request by one token, and when a request needs a block
that is not there it preempts the most recently scheduled request (as vLLM does). One batch of
events and one StepStats are published per step.

    python examples/hand_written_engine_loop.py
"""

import time
from collections import deque

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_llm import TelemetryConfig, setup_telemetry
from otel_llm.events import EventType as E
from otel_llm.events import RequestEvent, StepStats
from otel_llm.hooks import HookBus

NUM_BLOCKS, BLOCK_SIZE = 6, 4


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


class Request:
    def __init__(self, rid: str, prompt: int, output: int) -> None:
        self.rid, self.tokens, self.target = rid, prompt, prompt + output


bus = HookBus()
reader = InMemoryMetricReader()
handle = setup_telemetry(
    TelemetryConfig(model_name="toy", metrics_exporters=("none",), traces_exporters=("none",)),
    extra_metric_readers=[reader],
)
bus.subscribe(handle.telemetry)

waiting: deque[Request] = deque()
running: list[Request] = []
batch: list[RequestEvent] = []
now = time.monotonic()
for i, output in enumerate((3, 9, 14, 5, 11)):
    waiting.append(Request(f"r{i}", 2, output))
    batch += [
        RequestEvent(E.ARRIVED, f"r{i}", now, prompt_tokens=2, max_tokens=output),
        RequestEvent(E.QUEUED, f"r{i}", now),
    ]

preemptions = 0
while waiting or running:
    now = time.monotonic()
    while waiting and sum(blocks(r.tokens) for r in running) + blocks(waiting[0].tokens) <= NUM_BLOCKS:
        running.append(waiting.popleft())
        batch.append(RequestEvent(E.SCHEDULED, running[-1].rid, now))
    for req in list(running):
        if req not in running:  # preempted earlier in this step
            continue
        while sum(blocks(r.tokens) for r in running) - blocks(req.tokens) + blocks(req.tokens + 1) > NUM_BLOCKS:
            victim = running.pop()
            batch.append(
                RequestEvent(E.PREEMPTED, victim.rid, now, num_computed_tokens=victim.tokens, reason="kv_cache_full")
            )
            waiting.appendleft(victim)
            preemptions += 1
            if victim is req:
                break
        if req in running:
            req.tokens += 1
            batch.append(RequestEvent(E.TOKENS, req.rid, now, num_tokens=1))
            if req.tokens >= req.target:
                running.remove(req)
                batch.append(RequestEvent(E.FINISHED, req.rid, now, finish_reason="length"))
    bus.publish(batch)
    bus.publish_step(StepStats(now, len(running), len(waiting), sum(blocks(r.tokens) for r in running) / NUM_BLOCKS))
    batch = []

points = {
    m.name: m.data.data_points[0]
    for rm in reader.get_metrics_data().resource_metrics
    for sm in rm.scope_metrics
    for m in sm.metrics
}
hist = points["vllm:request_num_preemptions"]
print(f"engine preemptions: {preemptions}")
print(f"vllm:num_preemptions: {points['vllm:num_preemptions'].value}")
print(f"vllm:request_num_preemptions: count={hist.count} sum={hist.sum} buckets={list(hist.bucket_counts)}")
handle.shutdown()
