"""The engine: requests in, one scheduled model step at a time, events out through the hook bus."""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

from otel_llm.events import EventType, RequestEvent, StepStats
from otel_llm.hooks import HookBus

from .kv_cache import KVCache
from .model import STOP_TOKEN_ID, AttentionGroup, BatchInput, ModelConfig, TinyTransformer
from .plugins import load_plugins
from .request import Request, RequestOutput, encode
from .scheduler import Scheduler, SchedulerOutput

PREEMPTION_REASON = "kv_cache_full"

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    num_kv_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    # torch's thread count is process-wide; tiny matrices run fastest on one or two threads.
    num_threads: Optional[int] = 1
    load_plugins: bool = True  # entry points in group "engine_stub.plugins"
    scheduling_policy: str = "fcfs"  # or "priority" (Scheduler)


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig()) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model = TinyTransformer(config.model, seed=config.seed)
        self.kv_cache = KVCache(config.num_kv_blocks, config.block_size, config.model)
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy
        )
        self.hooks = HookBus()
        self._requests: dict[str, Request] = {}
        self._pending_events: list[RequestEvent] = []  # published with the next step's batch
        self._pending_outputs: list[RequestOutput] = []  # aborts, returned by the next step()
        loaded = load_plugins(self) if config.load_plugins else []
        self.plugins: list[str] = [name for name, _ in loaded]
        self._plugin_results = [result for _, result in loaded]

    def shutdown(self) -> None:
        """Shut down what plugins returned (e.g. the otel plugin's telemetry: flush, stop /metrics)."""
        for result in self._plugin_results:
            stop = getattr(result, "shutdown", None)
            if callable(stop):
                try:
                    stop()
                except Exception:  # noqa: BLE001 - one plugin's failure must not block the others
                    _log.exception("engine_stub: a plugin's shutdown() failed")
        self._plugin_results = []

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: Union[str, Sequence[int]],
        max_tokens: int = 16,
        trace_context: Optional[Mapping[str, str]] = None,
        *,
        temperature: float = 0.0,
        seed: Optional[int] = None,
        stop_token_ids: Iterable[int] = (STOP_TOKEN_ID,),
        priority: int = 0,
        lora: Optional[str] = None,
    ) -> None:
        """Queue a request. ``temperature`` 0 is greedy; otherwise sampling is seeded per request
        (``seed``, default derived from the engine seed and the id), independent of batching.
        ``priority`` orders it under the priority policy (lower first); ``lora`` names an adapter
        (a label: the stub serves its one model). Both reach the telemetry as tenant facts."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if any(not 0 <= t <= STOP_TOKEN_ID for t in token_ids):
            raise ValueError(f"request {request_id!r}: token ids must be in 0..{STOP_TOKEN_ID}")
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        # The last sampled token is never fed back, so its key/value never needs a slot.
        needed = len(token_ids) + max_tokens - 1
        capacity = self.kv_cache.num_blocks * self.kv_cache.block_size
        if needed > capacity:
            raise ValueError(
                f"request {request_id!r} can never fit the KV cache: prompt ({len(token_ids)}) + "
                f"max_tokens ({max_tokens}) - 1 = {needed} tokens > {capacity} slots "
                f"({self.kv_cache.num_blocks} blocks of {self.kv_cache.block_size})"
            )
        generator = None
        if temperature > 0:
            if seed is None:
                seed = zlib.crc32(request_id.encode()) ^ self.config.seed
            generator = torch.Generator().manual_seed(seed)
        now = time.monotonic()
        request = Request(
            request_id,
            token_ids,
            max_tokens,
            arrival_time=now,
            temperature=temperature,
            stop_token_ids=frozenset(stop_token_ids),
            generator=generator,
            trace_context=trace_context,
            priority=priority,
            lora=lora,
        )
        self._requests[request_id] = request
        self.scheduler.add(request)
        if self.hooks.active:
            self._pending_events.append(
                RequestEvent(
                    EventType.ARRIVED,
                    request_id,
                    now,
                    prompt_tokens=len(token_ids),
                    max_tokens=max_tokens,
                    trace_context=trace_context,
                    tenant_facts={"priority": priority, "lora": lora},
                )
            )
            self._pending_events.append(RequestEvent(EventType.QUEUED, request_id, now))

    def abort_request(self, request_id: str) -> bool:
        """Finish an unfinished request with reason "abort"; False if there is none by that id."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, "abort")
        self._pending_outputs.append(self._output(request))
        if self.hooks.active:
            self._pending_events.append(
                RequestEvent(EventType.FINISHED, request_id, time.monotonic(), finish_reason="abort")
            )
        return True

    def has_unfinished_requests(self) -> bool:
        """True while a request is waiting or running, or an abort is not yet returned."""
        return bool(self._requests or self._pending_outputs)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once over the whole batch, sample; return what finished."""
        emit = self.hooks.active
        sched = self.scheduler.schedule()
        usage = self.kv_cache.usage
        events = self._pending_events
        self._pending_events = []
        finished = self._pending_outputs
        self._pending_outputs = []
        if emit:
            now = time.monotonic()
            events.extend(
                RequestEvent(
                    EventType.PREEMPTED,
                    request.request_id,
                    now,
                    num_computed_tokens=lost,
                    reason=PREEMPTION_REASON,
                    causes=(cause.request_id,),
                )
                for request, lost, cause in sched.preempted
            )
            events.extend(RequestEvent(EventType.SCHEDULED, request.request_id, now) for request in sched.started)

        if sched.scheduled:
            sampled = self._execute(sched)
            now = time.monotonic()
            for request, token in sampled:
                request.token_ids.append(token)
                if emit:
                    if request.num_output_tokens == 1:
                        events.append(RequestEvent(EventType.FIRST_TOKEN, request.request_id, now))
                    events.append(RequestEvent(EventType.TOKENS, request.request_id, now, num_tokens=1))
                reason = None
                if token in request.stop_token_ids:
                    reason = "stop"
                elif request.num_output_tokens >= request.max_tokens:
                    reason = "length"
                if reason is not None:
                    self.scheduler.finish(request, reason)
                    del self._requests[request.request_id]
                    finished.append(self._output(request))
                    if emit:
                        events.append(RequestEvent(EventType.FINISHED, request.request_id, now, finish_reason=reason))

        if emit:
            if events:
                self.hooks.publish(events)
            self.hooks.publish_step(
                StepStats(
                    timestamp=time.monotonic(),
                    num_running=len(self.scheduler.running),
                    num_waiting=len(self.scheduler.waiting),
                    kv_cache_usage=usage,
                    num_batched_tokens=sched.num_batched_tokens,
                )
            )
        return finished

    def run(self) -> list[RequestOutput]:
        """Step until no request is left; every output, in finishing order."""
        outputs: list[RequestOutput] = []
        while self.has_unfinished_requests():
            outputs.extend(self.step())
        return outputs

    # ------------------------------------------------------------------ model execution

    def _execute(self, sched: SchedulerOutput) -> list[tuple[Request, int]]:
        """Run the scheduled tokens; return (request, sampled token) for each completed sequence."""
        batch, samplers = self._build_batch(sched)
        with torch.inference_mode():
            logits = self.model(batch, self.kv_cache.key_cache, self.kv_cache.value_cache)
            return [(request, self._sample(request, logits[i])) for i, request in enumerate(samplers)]

    def _build_batch(self, sched: SchedulerOutput) -> tuple[BatchInput, list[Request]]:
        kv = self.kv_cache
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        samplers: list[Request] = []
        decodes: list[tuple[int, int, list[int]]] = []  # (row, position, block table)
        groups: list[AttentionGroup] = []
        for request, num_new in sched.scheduled:
            start = request.num_computed_tokens
            first_row = len(token_ids)
            request_positions = range(start, start + num_new)
            token_ids.extend(request.token_ids[start : start + num_new])
            positions.extend(request_positions)
            slots.extend(kv.slot(request.block_table, p) for p in request_positions)
            request.num_computed_tokens = start + num_new
            if num_new == 1:
                decodes.append((first_row, start, request.block_table))
            else:  # a prefill chunk attends on its own: padding it into the decodes would waste
                groups.append(
                    AttentionGroup.build(
                        torch.arange(first_row, first_row + num_new)[None],
                        torch.tensor([request.block_table]),
                        torch.tensor([list(request_positions)]),
                        kv.block_size,
                    )
                )
            if request.num_computed_tokens == request.num_tokens:
                sample_rows.append(len(token_ids) - 1)
                samplers.append(request)
        if decodes:
            width = max(len(table) for _, _, table in decodes)
            groups.append(
                AttentionGroup.build(
                    torch.tensor([[row] for row, _, _ in decodes]),
                    torch.tensor([table + [0] * (width - len(table)) for _, _, table in decodes]),
                    torch.tensor([[pos] for _, pos, _ in decodes]),
                    kv.block_size,
                )
            )
        batch = BatchInput(
            token_ids=torch.tensor(token_ids),
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slots),
            groups=groups,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long),
        )
        return batch, samplers

    @staticmethod
    def _sample(request: Request, logits: torch.Tensor) -> int:
        if request.generator is None:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / request.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=request.generator))

    def _output(self, request: Request) -> RequestOutput:
        assert request.finish_reason is not None
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            finish_reason=request.finish_reason,
            num_preemptions=request.num_preemptions,
            preempted_by=tuple(request.preempted_by),
            num_preemptions_caused=request.num_preemptions_caused,
        )
