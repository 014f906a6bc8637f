"""Seeded synthetic workloads: Poisson arrivals, long-tailed prompt and output lengths.

Arrivals are on a simulated clock that advances ``step_time`` per engine step, so a run is
deterministic for a seed whatever the machine's speed (latencies in the events stay real).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from .engine import Engine
from .request import RequestOutput


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 200
    rate: float = 50.0  # mean arrivals per simulated second
    seed: int = 0
    prompt_median: int = 48  # lognormal lengths: median and sigma of the log
    prompt_sigma: float = 0.8
    output_median: int = 48
    output_sigma: float = 1.0
    # Tenants: each request draws one of ``num_tenants`` (0: none), as its priority (tenant k has
    # priority k) and its LoRA adapter name (``tenant-k``). A draw of its own: the lengths and
    # arrivals of a seed stay the same with or without tenants.
    num_tenants: int = 0


@dataclass(frozen=True)
class WorkloadRequest:
    request_id: str
    arrival_time: float  # simulated seconds from the start
    prompt: str
    max_tokens: int
    priority: int = 0
    lora: Optional[str] = None


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def generate(spec: WorkloadSpec, max_sequence_tokens: int) -> list[WorkloadRequest]:
    """``spec.num_requests`` requests, each with prompt + max_tokens - 1 <= max_sequence_tokens."""
    if max_sequence_tokens < 2:
        raise ValueError(f"max_sequence_tokens must be >= 2, got {max_sequence_tokens}")
    rng = random.Random(spec.seed)
    tenant_rng = random.Random(f"tenants-{spec.seed}")
    clock = 0.0
    requests = []
    for i in range(spec.num_requests):
        clock += rng.expovariate(spec.rate)
        prompt_len = _lognormal(rng, spec.prompt_median, spec.prompt_sigma, max_sequence_tokens // 2)
        max_tokens = _lognormal(rng, spec.output_median, spec.output_sigma, max_sequence_tokens + 1 - prompt_len)
        tenant = tenant_rng.randrange(spec.num_tenants) if spec.num_tenants > 0 else None
        requests.append(
            WorkloadRequest(
                f"req-{i:05d}",
                clock,
                _text(rng, prompt_len),
                max_tokens,
                priority=tenant or 0,
                lora=None if tenant is None else f"tenant-{tenant}",
            )
        )
    return requests


def _lognormal(rng: random.Random, median: int, sigma: float, upper: int) -> int:
    return max(1, min(upper, round(rng.lognormvariate(math.log(median), sigma))))


def _text(rng: random.Random, length: int) -> str:
    words = []
    size = 0
    while size < length:
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 8)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:length]


@dataclass(frozen=True)
class RunResult:
    outputs: list[RequestOutput]
    elapsed: float  # wall seconds
    steps: int

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def total_preemptions(self) -> int:
        return sum(o.num_preemptions for o in self.outputs)

    @property
    def max_preemptions(self) -> int:
        return max((o.num_preemptions for o in self.outputs), default=0)


def run_workload(
    engine: Engine,
    requests: list[WorkloadRequest],
    *,
    step_time: float = 0.01,
    temperature: float = 1.0,
    trace_context: Optional[Callable[[str], Mapping[str, str]]] = None,
    on_step: Optional[Callable[[Engine, int], None]] = None,
    between_steps: Optional[Callable[[], None]] = None,
) -> RunResult:
    """Feed ``requests`` at their arrival times and step until all finish.

    ``trace_context(request_id)`` gives a request's W3C carrier, as a client would send it;
    ``on_step(engine, num_finished)`` is called after every step (progress display);
    ``between_steps()`` before each, where it may raise to stop the run (stopping.Stop.check).
    """
    outputs: list[RequestOutput] = []
    pending = sorted(requests, key=lambda r: r.arrival_time)
    next_index = 0
    clock = 0.0
    steps = 0
    start = time.perf_counter()
    while next_index < len(pending) or engine.has_unfinished_requests():
        if between_steps is not None:
            between_steps()
        if not engine.has_unfinished_requests():
            clock = max(clock, pending[next_index].arrival_time)  # idle: skip to the next arrival
        while next_index < len(pending) and pending[next_index].arrival_time <= clock:
            r = pending[next_index]
            engine.add_request(
                r.request_id,
                r.prompt,
                max_tokens=r.max_tokens,
                trace_context=trace_context(r.request_id) if trace_context else None,
                temperature=temperature,
                priority=r.priority,
                lora=r.lora,
            )
            next_index += 1
        outputs.extend(engine.step())
        steps += 1
        clock += step_time
        if on_step is not None:
            on_step(engine, len(outputs))
    return RunResult(outputs, time.perf_counter() - start, steps)
