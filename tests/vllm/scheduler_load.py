"""vLLM's real ``Scheduler`` driven in-process on a seeded load that preempts, and a record of its
preemptions taken by wrapping vLLM's own methods (no otel-llm code).

The builders adapt to the installed release by signature and dataclass fields. The only stand-in
is the model: :func:`model_output` samples one token for every scheduled request whose prefill is
complete, as vLLM's model runner does (a partial prefill samples nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import random
from typing import Any, Callable, NamedTuple, Optional

BLOCK_SIZE = 16
TOKEN = 7  # every sampled token; never a stop token (ignore_eos)


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes (a parameter an older release lacks is left out)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def build_scheduler(
    model_dir: str,
    *,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    policy: str = "fcfs",
) -> Any:
    """A real ``vllm.v1.core.sched.scheduler.Scheduler`` over ``num_blocks`` KV blocks of
    :data:`BLOCK_SIZE` tokens, ``policy`` (vLLM's ``fcfs`` or ``priority``), chunked prefill, no
    prefix caching, synchronous, stats on."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from otel_llm.testing.vllm.config import class_level_config

    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        **_accepted(
            SchedulerConfig,
            {
                "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max_num_batched_tokens,
                "max_model_len": max_model_len,  # an InitVar where the model config holds it
                "is_encoder_decoder": False,
                "enable_chunked_prefill": True,
                "async_scheduling": False,
                "policy": policy,
            },
        )
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)
    vllm_config = class_level_config(model_config, scheduler_config=scheduler_config, cache_config=cache_config)
    spec = FullAttentionSpec(
        **_accepted(
            FullAttentionSpec,
            {"block_size": BLOCK_SIZE, "num_kv_heads": 1, "head_size": 1, "dtype": torch.float32},
        )
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        **_accepted(
            Scheduler.__init__,
            {
                "vllm_config": vllm_config,
                "kv_cache_config": kv_cache_config,
                "structured_output_manager": StructuredOutputManager(vllm_config),
                "block_size": BLOCK_SIZE,
                "log_stats": True,
            },
        )
    )


class Spec(NamedTuple):
    request_id: str
    prompt: list[int]
    max_tokens: int
    arrives: int  # the step before which it is added
    priority: int = 0  # vLLM's: the lower, the sooner served (under the priority policy)
    lora: Optional[str] = None  # a LoRA adapter's name (the scheduler has no LoRA config: it only carries it)


def seeded_load(seed: int, count: int, *, prompt: tuple[int, int], output: tuple[int, int], spread: int) -> list[Spec]:
    """``count`` requests with prompt and output lengths drawn from the given ranges, arriving over
    the first ``spread`` steps, in arrival order."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        length = rng.randint(*prompt)
        specs.append(
            Spec(
                request_id=f"req-{i:02d}",
                prompt=[rng.randint(3, 250) for _ in range(length)],
                max_tokens=rng.randint(*output),
                arrives=rng.randint(0, spread),
            )
        )
    return sorted(specs, key=lambda s: (s.arrives, s.request_id))


def make_request(spec: Spec) -> Any:
    """A real ``vllm.v1.request.Request`` for ``spec``."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
    return Request(
        **_accepted(
            Request.__init__,
            {
                "request_id": spec.request_id,
                "prompt_token_ids": list(spec.prompt),
                "sampling_params": params,
                "pooling_params": None,
                "arrival_time": float(spec.arrives),
                "priority": spec.priority,
                "lora_request": _adapter(spec.lora) if spec.lora else None,
            },
        )
    )


def _adapter(name: str) -> Any:
    """A ``LoRARequest`` the scheduler only carries (no LoRA config: nothing is loaded)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, 1 + sum(map(ord, name)), lora_path=f"/adapters/{name}")


def model_output(scheduler: Any, scheduler_output: Any) -> Any:
    """The stand-in for the model runner: the release's ``ModelRunnerOutput`` with one token for
    each scheduled request past its prefill, none for a partial prefill."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        sampled.append([TOKEN] if request.num_computed_tokens >= request.num_tokens else [])
    fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    kwargs: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled}
    if "req_id_to_index" in fields:
        kwargs["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(**kwargs)


def drive(
    scheduler: Any,
    specs: list[Spec],
    *,
    max_steps: int,
    after_step: Callable[[int], None],
    reset_at: Optional[int] = None,
) -> tuple[int, list[Any]]:
    """Run ``scheduler`` until every request of ``specs`` finished: the number of steps and the
    requests.
    ``after_step(step)`` runs after each step's output is processed; at step ``reset_at`` the
    prefix cache is reset with the running requests preempted (a step of its own)."""
    pending = list(specs)
    requests: list[Any] = []
    finished: set[str] = set()
    for step in range(max_steps):
        while pending and pending[0].arrives <= step:
            requests.append(make_request(pending.pop(0)))
            scheduler.add_request(requests[-1])
        if step == reset_at:
            assert scheduler.running, "nothing runs when the cache is reset"
            assert scheduler.reset_prefix_cache(reset_running_requests=True)
        else:
            output = scheduler.schedule()
            engine_outputs = scheduler.update_from_output(output, model_output(scheduler, output))
            for outputs in engine_outputs.values():
                finished.update(o.request_id for o in outputs.outputs if o.finish_reason is not None)
        after_step(step)
        if not pending and len(finished) == len(specs):
            assert not scheduler.has_unfinished_requests()
            return step + 1, requests
    raise AssertionError(f"{len(specs) - len(finished)} requests unfinished after {max_steps} steps")


class Preemption(NamedTuple):
    victim: str
    ordinal: int  # the victim's num_preemptions after it
    where: Optional[str]  # "schedule", "reset", or None (another caller)
    cause: Optional[str]  # inside schedule(): the request whose allocation came last


class Record:
    """The scheduler's preemptions, from wrappers of vLLM's own methods: the KV cache manager's
    ``allocate_slots`` (the request being allocated), ``Scheduler.schedule`` and
    ``reset_prefix_cache`` (where it is), ``_preempt_request`` (the victim)."""

    def __init__(self) -> None:
        self.preemptions: list[Preemption] = []
        self._taken = 0
        self._allocating: Optional[str] = None
        self._in: Optional[str] = None

    def take(self) -> list[Preemption]:
        """What was recorded since the last call."""
        new = self.preemptions[self._taken :]
        self._taken = len(self.preemptions)
        return new

    def watch(self, scheduler: Any) -> None:
        """Wrap this scheduler's KV cache manager (on the instance)."""
        manager = scheduler.kv_cache_manager
        allocate = manager.allocate_slots

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            self._allocating = request.request_id
            return allocate(request, *args, **kwargs)

        manager.allocate_slots = allocate_slots

    def install(self, scheduler_cls: type) -> Callable[[], None]:
        """Wrap the class's methods; returns what restores them."""
        names = ("schedule", "reset_prefix_cache", "_preempt_request")
        schedule, reset, preempt = originals = [getattr(scheduler_cls, name) for name in names]

        @functools.wraps(schedule)
        def scheduling(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            self._in = "schedule"
            try:
                return schedule(scheduler, *args, **kwargs)
            finally:
                self._in, self._allocating = None, None

        @functools.wraps(reset)
        def resetting(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            self._in = "reset"
            try:
                return reset(scheduler, *args, **kwargs)
            finally:
                self._in = None

        @functools.wraps(preempt)
        def preempting(scheduler: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            result = preempt(scheduler, request, *args, **kwargs)
            cause = self._allocating if self._in == "schedule" else None
            self.preemptions.append(Preemption(request.request_id, request.num_preemptions, self._in, cause))
            return result

        scheduler_cls.schedule = scheduling  # type: ignore[attr-defined]
        scheduler_cls.reset_prefix_cache = resetting  # type: ignore[attr-defined]
        scheduler_cls._preempt_request = preempting  # type: ignore[attr-defined]

        def restore() -> None:
            for name, original in zip(names, originals):
                setattr(scheduler_cls, name, original)

        return restore


def wrap_schedule_through(scheduler_cls: type) -> Callable[[], None]:
    """A third party's wrapper of ``Scheduler.schedule`` that only calls through; returns what
    restores it."""
    schedule = scheduler_cls.schedule  # type: ignore[attr-defined]

    @functools.wraps(schedule)
    def schedule_through(*args: Any, **kwargs: Any) -> Any:
        return schedule(*args, **kwargs)

    scheduler_cls.schedule = schedule_through  # type: ignore[attr-defined]

    def restore() -> None:
        scheduler_cls.schedule = schedule  # type: ignore[attr-defined]

    return restore
