"""Engine-core streams of vLLM's own classes: a scripted one for vLLM's real frontend path, and
a model of vLLM's scheduler (:class:`SchedulerModel`) for the engine-core stream at any batch size.

What vLLM's engine core would send: per step, one ``EngineCoreOutput`` per request that produced
a token, carrying the request's pending ``EngineCoreEvent``s (QUEUED, SCHEDULED, PREEMPTED,
SCHEDULED again on resume: the scheduler attaches them to the request's next output). The
stream goes through vLLM's real ``OutputProcessor.process_outputs`` (which feeds the real
``IterationStats``) and then ``StatLoggerManager.record``, as ``AsyncLLM``'s output handler does.
Timestamps are synthetic (engine clock ``T0 + step * DT``) so that every value is known.
Used by the vLLM tests (tests/vllm) and the frontend benchmark (bench/vllm/record.py).

:class:`SchedulerModel` plays seeded loads through a model of vLLM's scheduler, step by step:
the ``EngineCoreOutputs`` its engine core would send (one token per scheduled request, pending
events, prefill stats, trace headers, finishes by length or stop), the requests given to it, and a
cause record per preemption. Used by the stream benchmarks (bench/vllm/stream.py, rates.py) and
their tests.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

DT = 0.1  # seconds per engine step


@dataclass
class Spec:
    rid: str
    arrive: int  # step at which the request arrives (QUEUED)
    queue: int  # steps waiting before its first SCHEDULED
    prompt: int  # prompt tokens
    tokens: int  # output tokens produced
    preempt_after: tuple[int, ...] = ()  # preempted after this many output tokens (0: during prefill)
    wait: int = 2  # steps back in the queue after each preemption
    max_tokens: Optional[int] = None
    cached: int = 0  # prefix-cache hits (prompt tokens not computed)
    finish: str = "length"  # FinishReason name, lower case
    empty_last: bool = False  # the finishing output carries no token (e.g. an error finish)

    @property
    def num_preemptions(self) -> int:
        return len(self.preempt_after)


@dataclass
class Output:
    step: int
    rid: str
    events: list  # [(EngineCoreEventType name, timestamp)]
    first: bool
    last: bool


@dataclass
class Script:
    specs: list[Spec]
    t0: float  # engine-core monotonic clock at step 0
    w0: float  # wall clock at step 0 (arrival times, iteration timestamps)
    outputs: dict[int, list[Output]] = field(default_factory=dict)
    preempted_at: dict[str, list[float]] = field(default_factory=dict)  # exact PREEMPTED timestamps
    preempted_time: dict[str, float] = field(default_factory=dict)  # exact time back in the queue
    finish_step: dict[str, int] = field(default_factory=dict)
    last_step: int = 0

    def ts(self, step: int) -> float:
        return self.t0 + step * DT

    def output_ts(self, step: int) -> float:
        """When the step's outputs leave the engine core (after the forward pass)."""
        return self.ts(step) + 0.05


def build(specs: list[Spec], t0: float, w0: float) -> Script:
    script = Script(specs, t0, w0)
    for spec in specs:
        s = spec.arrive
        pending = [("QUEUED", script.ts(s) + 0.0001)]
        s += spec.queue
        pending.append(("SCHEDULED", script.ts(s) + 0.0002))
        produced = 0
        preempts = sorted(spec.preempt_after)
        script.preempted_at[spec.rid] = []
        script.preempted_time[spec.rid] = 0.0
        while produced < spec.tokens:
            while preempts and preempts[0] == produced:
                preempts.pop(0)
                t_pre = script.ts(s) + 0.0003
                pending.append(("PREEMPTED", t_pre))
                s += spec.wait
                t_res = script.ts(s) + 0.0002
                pending.append(("SCHEDULED", t_res))
                script.preempted_at[spec.rid].append(t_pre)
                script.preempted_time[spec.rid] += t_res - t_pre
            out = Output(s, spec.rid, pending, first=produced == 0, last=produced + 1 == spec.tokens)
            script.outputs.setdefault(s, []).append(out)
            pending = []
            produced += 1
            s += 1
        assert not preempts, f"{spec.rid}: preempt_after beyond its tokens"
        script.finish_step[spec.rid] = s - 1
        script.last_step = max(script.last_step, s)
    return script


def engine_core_output(spec: Spec, out: Output) -> Any:
    from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, FinishReason
    from vllm.v1.metrics.stats import PrefillStats

    events = [EngineCoreEvent(EngineCoreEventType[name], ts) for name, ts in out.events] or None
    prefill = None
    if out.first:
        prefill = PrefillStats()
        prefill.set(spec.prompt, spec.cached, 0)
    return EngineCoreOutput(
        request_id=spec.rid,
        new_token_ids=[] if out.last and spec.empty_last else [7],
        finish_reason=FinishReason[spec.finish.upper()] if out.last else None,
        events=events,
        prefill_stats=prefill,
    )


def engine_core_request(spec: Spec, arrival_time: float) -> Any:
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id=spec.rid,
        prompt_token_ids=[5] * spec.prompt,
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=spec.max_tokens, detokenize=False, ignore_eos=True),
        pooling_params=None,
        arrival_time=arrival_time,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=spec.rid,
    )


def scheduler_stats(script: Script, step: int, outs: list[Output]) -> Any:
    from vllm.v1.metrics.stats import SchedulerStats

    running = {o.rid for o in outs}
    waiting = sum(
        1 for spec in script.specs if spec.arrive <= step <= script.finish_step[spec.rid] and spec.rid not in running
    )
    skipped = 1 if step % 4 == 3 else 0
    return SchedulerStats(
        num_running_reqs=len(outs),
        num_waiting_reqs=max(0, waiting - skipped),
        num_skipped_waiting_reqs=skipped,
        kv_cache_usage=min(1.0, 0.125 * len(outs) + 0.01 * (step % 7)),
    )


def run(manager: Any, streams: dict[int, Script], steps: Optional[int] = None) -> Any:
    """Drive the scripts of several engines (engine index -> script) through one real
    OutputProcessor and ``manager.record`` (as AsyncLLM's output handler does); only the first
    ``steps`` steps if given, the requests still in flight then left in the processor, which is
    returned."""
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import IterationStats

    processor = OutputProcessor(None, log_stats=True)
    specs = {idx: {s.rid: s for s in script.specs} for idx, script in streams.items()}
    last = max(script.last_step for script in streams.values())
    for step in range(last + 1 if steps is None else steps):
        for idx, script in streams.items():
            for spec in script.specs:
                if spec.arrive == step:
                    processor.add_request(engine_core_request(spec, script.w0 + step * DT), None)
            outs = script.outputs.get(step, [])
            engine_outputs = [engine_core_output(specs[idx][o.rid], o) for o in outs]
            iteration_stats = IterationStats() if engine_outputs else None
            if iteration_stats is not None:
                iteration_stats.iteration_timestamp = script.w0 + step * DT + 0.0505
            processed = processor.process_outputs(engine_outputs, script.output_ts(step), iteration_stats)
            assert not processed.reqs_to_abort
            sched = scheduler_stats(script, step, outs) if step % 5 != 2 or not outs else None
            processor.update_scheduler_stats(sched)
            if sched is not None or iteration_stats is not None:
                manager.record(
                    engine_idx=idx, scheduler_stats=sched, iteration_stats=iteration_stats, mm_cache_stats=None
                )
    assert steps is not None or not processor.has_unfinished_requests()
    return processor


# Requests with 0, 1, 2 and 7 preemptions (in prefill and in decode), finishes by length,
# stop and abort, a prefix-cache hit, max_tokens unset, and enough spread to fill several
# buckets of each histogram.
def default_specs(prefix: str = "") -> list[Spec]:
    return [
        Spec(prefix + "r0", arrive=0, queue=0, prompt=12, tokens=6, max_tokens=6),
        Spec(prefix + "r0b", arrive=1, queue=3, prompt=300, tokens=3, max_tokens=None, finish="stop"),
        Spec(prefix + "r1", arrive=1, queue=1, prompt=40, tokens=8, preempt_after=(3,), max_tokens=8),
        Spec(
            prefix + "r2",
            arrive=2,
            queue=0,
            prompt=64,
            tokens=5,
            preempt_after=(0, 2),
            wait=4,
            max_tokens=20,
            cached=32,
            finish="stop",
        ),
        Spec(
            prefix + "r7",
            arrive=2,
            queue=5,
            prompt=900,
            tokens=12,
            preempt_after=(0, 1, 1, 3, 5, 5, 9),
            wait=3,
            max_tokens=12,
        ),
        Spec(
            prefix + "r1b",
            arrive=6,
            queue=12,
            prompt=7,
            tokens=1,
            preempt_after=(0,),
            wait=30,
            max_tokens=4,
            finish="abort",
        ),
        Spec(prefix + "r0c", arrive=9, queue=2, prompt=2, tokens=40, max_tokens=40),
    ]


@dataclass(frozen=True)
class Shape:
    """What the modelled scheduler runs: at most ``max_num_seqs`` requests a step, over
    ``kv_blocks`` KV blocks of ``block_size`` tokens; prompt lengths and ``max_tokens`` drawn from
    their ranges; ``stop_share`` of the requests stop (EOS) before their ``max_tokens``; a step
    every ``step_s`` of engine clock (±20%)."""

    max_num_seqs: int = 16
    kv_blocks: int = 12
    block_size: int = 32
    prompt: tuple[int, int] = (8, 64)
    max_tokens: tuple[int, int] = (96, 96)
    stop_share: float = 0.0
    step_s: float = 0.002


@dataclass
class ModelStep:
    outputs: Any  # vLLM's EngineCoreOutputs
    given: list[Any]  # vLLM's EngineCoreRequest: given to the scheduler before this step
    causes: list[Any]  # a CauseRecord per preemption in the step (written before its output)
    tokens: int = 0


@dataclass
class _Modelled:
    rid: str
    prompt: int
    max_tokens: int
    ends_at: int  # tokens after which it finishes
    reason: Any  # vLLM's FinishReason then
    traceparent: str
    generated: int = 0
    blocks: int = 0
    preemptions: int = 0
    events: list[tuple[int, float]] = field(default_factory=list)
    prefilled: bool = False


class SchedulerModel:
    """vLLM's scheduler as the engine-core stream shows it: running requests first, in order, each
    taking the KV blocks its next token needs; when a block is short, the last one running is
    preempted (recompute: its blocks freed, back to the head of the queue; ``self`` when it is the
    one that needed the block, else ``request``); then the waiting, in order, while they fit (none
    in a step that preempted). Engine clock from ``clock``; arrival times on the wall clock,
    ``wall_offset`` ahead of it."""

    def __init__(self, shape: Shape, clock: float, wall_offset: float) -> None:
        self.shape = shape
        self.clock = clock
        self._wall = wall_offset
        self.requests = 0
        self.preemptions = 0

    def load(self, rng: random.Random, count: int, prefix: str) -> Iterator[ModelStep]:
        """``count`` requests given at once, played until the last finishes, then one idle step
        (a second of engine clock with nothing running)."""
        from vllm import SamplingParams
        from vllm.v1.engine import (
            EngineCoreEvent,
            EngineCoreEventType,
            EngineCoreOutput,
            EngineCoreOutputs,
            EngineCoreRequest,
            FinishReason,
        )
        from vllm.v1.metrics.stats import PrefillStats, PrefixCacheStats, SchedulerStats

        from otel_llm.events import CAUSE_REQUEST, CAUSE_SELF
        from otel_llm.integrations.vllm.channels.cause_channel import CauseRecord

        shape, arrival = self.shape, self.clock
        waiting: collections.deque[_Modelled] = collections.deque()
        given = []
        for i in range(count):
            prompt = rng.randint(*shape.prompt)
            traceparent = f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01"
            low, high = shape.max_tokens
            max_tokens = high if low == high else rng.randint(low, high)
            stops = bool(shape.stop_share) and rng.random() < shape.stop_share
            ends_at, reason = (
                (rng.randint(1, max_tokens), FinishReason.STOP) if stops else (max_tokens, FinishReason.LENGTH)
            )
            req = _Modelled(f"{prefix}{i}", prompt, max_tokens, ends_at, reason, traceparent)
            req.events.append((EngineCoreEventType.QUEUED, arrival))
            waiting.append(req)
            given.append(
                EngineCoreRequest(
                    request_id=req.rid,
                    prompt_token_ids=[5] * prompt,
                    mm_features=None,
                    sampling_params=SamplingParams(max_tokens=max_tokens, detokenize=False),
                    pooling_params=None,
                    arrival_time=self._wall + arrival,
                    lora_request=None,
                    cache_salt=None,
                    data_parallel_rank=None,
                    trace_headers={"traceparent": traceparent},
                )
            )
        self.requests += count
        running: list[_Modelled] = []
        free, size = shape.kv_blocks, shape.block_size
        while waiting or running:
            self.clock += shape.step_s * rng.uniform(0.8, 1.2)
            now = self.clock
            causes = []
            scheduled: list[_Modelled] = []
            i = 0
            while i < len(running):
                req = running[i]
                need = -(-(req.prompt + req.generated + 1) // size) - req.blocks
                while need > free:
                    victim = running.pop()
                    free += victim.blocks
                    victim.blocks, victim.prefilled = 0, False
                    victim.preemptions += 1
                    victim.events.append((EngineCoreEventType.PREEMPTED, now))
                    kind = CAUSE_SELF if victim is req else CAUSE_REQUEST
                    causes.append(CauseRecord(victim.rid, victim.preemptions, kind, (req.rid,)))
                    waiting.appendleft(victim)
                    if victim is req:
                        break
                if i < len(running) and running[i] is req:
                    free -= need
                    req.blocks += need
                    scheduled.append(req)
                i += 1
            while not causes and waiting and len(running) < shape.max_num_seqs:
                req = waiting[0]
                need = -(-(req.prompt + req.generated + 1) // size)
                if need > free:
                    break
                waiting.popleft()
                free -= need
                req.blocks = need
                req.events.append((EngineCoreEventType.SCHEDULED, now))
                running.append(req)
                scheduled.append(req)
            outputs = []
            finished = False
            for req in scheduled:
                req.generated += 1
                done = req.generated >= req.ends_at
                outputs.append(
                    EngineCoreOutput(
                        request_id=req.rid,
                        new_token_ids=[rng.randrange(3, 32000)],
                        finish_reason=req.reason if done else None,
                        events=[EngineCoreEvent(kind, ts) for kind, ts in req.events] or None,
                        prefill_stats=None if req.prefilled else PrefillStats(num_prompt_tokens=req.prompt),
                        trace_headers={"traceparent": req.traceparent},
                    )
                )
                req.events, req.prefilled = [], True
                if done:
                    free += req.blocks
                    req.blocks = -1  # finished
                    finished = True
            if finished:
                running = [r for r in running if r.blocks >= 0]
            self.preemptions += len(causes)
            stats = SchedulerStats(
                num_running_reqs=len(running),
                num_waiting_reqs=len(waiting),
                kv_cache_usage=(shape.kv_blocks - free) / shape.kv_blocks,
                prefix_cache_stats=PrefixCacheStats(requests=len(outputs), queries=len(outputs)),
            )
            eco = EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=now)
            yield ModelStep(eco, given, causes, len(outputs))
            given = []
        self.clock += 1.0
        yield ModelStep(EngineCoreOutputs(outputs=[], scheduler_stats=SchedulerStats(), timestamp=self.clock), [], [])
