"""The causes of preemptions that otel-llm's engine-core part reports, proven on vLLM's real
``Scheduler``: driven in-process on a seeded load that runs out of KV blocks, every record that
reaches a cause-channel receiver equals a record taken by wrapping vLLM's own methods, step by
step, whether that record's wrappers sit inside or outside otel-llm's, and under a third party's
wrapper of ``schedule``. The model is the only stand-in (``scheduler_load.model_output``)."""

from __future__ import annotations

import collections
import inspect
import shutil
import tempfile
from contextlib import ExitStack
from typing import Any, Iterator

import pytest
from scheduler_load import Preemption, Record, build_scheduler, drive, seeded_load, wrap_schedule_through

from otel_llm.events import CAUSE_CACHE_RESET, CAUSE_REQUEST, CAUSE_SELF
from otel_llm.integrations.vllm.channels import cause_channel
from otel_llm.integrations.vllm.channels.cause_channel import CauseRecord
from otel_llm.integrations.vllm.engine_core import engine_core
from otel_llm.integrations.vllm.frontend import deep_hook

# 24 requests of 8..48 prompt tokens and 32..128 output tokens, arriving over 10 steps, on 20 blocks
# of 16 tokens (320 tokens: any one request fits alone), at most 8 running.
SCHEDULER = {"num_blocks": 20, "max_num_seqs": 8, "max_num_batched_tokens": 128, "max_model_len": 512}
SEED = 2
MAX_STEPS = 2000
RESET_AT = 20  # a step where several requests run

# Where the record's wrappers go relative to otel-llm's.
RECORD_INSIDE = "record_inside"  # installed before otel-llm's: otel-llm's wrapper calls it
RECORD_OUTSIDE = "record_outside"  # installed after: it calls otel-llm's wrapper
THIRD_PARTY_SCHEDULE = "third_party_schedule"  # record inside, then a wrapper of schedule, then otel-llm
LAYOUTS = (RECORD_INSIDE, RECORD_OUTSIDE, THIRD_PARTY_SCHEDULE)


def _specs() -> list[Any]:
    return seeded_load(SEED, 24, prompt=(8, 48), output=(32, 128), spread=10)


@pytest.fixture(scope="module")
def unwrapped_preemptions(model_dir: str) -> dict[str, int]:
    """Each request's preemptions on this load with nothing wrapped, by vLLM's own counter."""
    _, requests = drive(
        build_scheduler(model_dir, **SCHEDULER), _specs(), max_steps=MAX_STEPS, after_step=lambda _: None
    )
    return {r.request_id: r.num_preemptions for r in requests}


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[cause_channel.Receiver]:
    """A cause channel of its own (a short path: a Unix socket's is bounded), listening before
    the first preemption; the engine-core sender made afresh on it."""
    path = tempfile.mkdtemp(prefix="otel-llm-causes-")
    monkeypatch.setenv(cause_channel.ENV, path)
    monkeypatch.setattr(engine_core, "_sender", [])
    listening = cause_channel.Receiver(path)
    yield listening
    listening.close()
    shutil.rmtree(path, ignore_errors=True)


def _install_otel_llm(stack: ExitStack, scheduler_cls: type) -> None:
    """The engine core's cause reports, as the plugin installs them there."""
    stack.callback(deep_hook.uninstall)
    assert engine_core.shape_problem(scheduler_cls) is None
    deep_hook._install_cause_reports()
    assert getattr(scheduler_cls._preempt_request, deep_hook._MARK, False)  # type: ignore[attr-defined]


def _install(layout: str, stack: ExitStack, scheduler_cls: type, record: Record) -> None:
    """Wrap in ``layout``'s order; ``stack`` undoes it in reverse."""
    if layout == RECORD_OUTSIDE:
        _install_otel_llm(stack, scheduler_cls)
        stack.callback(record.install(scheduler_cls))
        return
    stack.callback(record.install(scheduler_cls))
    if layout == THIRD_PARTY_SCHEDULE:
        stack.callback(wrap_schedule_through(scheduler_cls))
    _install_otel_llm(stack, scheduler_cls)


def _expected(preemption: Preemption) -> CauseRecord:
    """The record otel-llm must send for one of the scheduler's preemptions."""
    if preemption.where == "reset":
        return CauseRecord(preemption.victim, preemption.ordinal, CAUSE_CACHE_RESET, ())
    assert preemption.where == "schedule" and preemption.cause is not None, preemption
    kind = CAUSE_SELF if preemption.cause == preemption.victim else CAUSE_REQUEST
    return CauseRecord(preemption.victim, preemption.ordinal, kind, (preemption.cause,))


def _run(
    layout: str, model_dir: str, receiver: cause_channel.Receiver, reset_at: int | None = None
) -> tuple[list[list[CauseRecord]], list[list[CauseRecord]], Record, list[Any], list[int]]:
    """The records received and those expected, per step (and one drain after the last), the
    scheduler's record, its requests, and the number running after each step."""
    from vllm.v1.core.sched.scheduler import Scheduler

    scheduler = build_scheduler(model_dir, **SCHEDULER)
    record = Record()
    record.watch(scheduler)
    received: list[list[CauseRecord]] = []
    expected: list[list[CauseRecord]] = []
    running: list[int] = []

    def after_step(step: int) -> None:
        received.append(receiver.drain())
        expected.append([_expected(p) for p in record.take()])
        running.append(len(scheduler.running))

    with ExitStack() as stack:
        _install(layout, stack, Scheduler, record)
        _, requests = drive(scheduler, _specs(), max_steps=MAX_STEPS, after_step=after_step, reset_at=reset_at)
    received.append(receiver.drain())
    expected.append([])
    assert (receiver.lost, receiver.garbage) == (0, 0)
    return received, expected, record, requests, running


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_reported_causes_are_the_schedulers_own(
    layout: str, model_dir: str, receiver: cause_channel.Receiver, unwrapped_preemptions: dict[str, int]
) -> None:
    received, expected, record, requests, _ = _run(layout, model_dir, receiver)

    # Every step's records are on the channel by the end of that step, equal to the scheduler's.
    assert received == expected
    # The wrappers change nothing: the preemptions are those of the unwrapped scheduler, each one
    # recorded, with the victim's own counter as its ordinal.
    preemptions = record.preemptions
    by_victim = collections.Counter(p.victim for p in preemptions)
    assert {r.request_id: r.num_preemptions for r in requests} == unwrapped_preemptions
    assert {rid: n for rid, n in unwrapped_preemptions.items() if n} == dict(by_victim)
    assert len(preemptions) == sum(unwrapped_preemptions.values()) > 0
    for rid in by_victim:
        assert [p.ordinal for p in preemptions if p.victim == rid] == list(range(1, by_victim[rid] + 1))
    kinds = collections.Counter(r.kind for step in received for r in step)
    assert set(kinds) == {CAUSE_SELF, CAUSE_REQUEST}
    assert kinds[CAUSE_SELF] == sum(1 for p in preemptions if p.cause == p.victim)
    assert kinds[CAUSE_REQUEST] == sum(1 for p in preemptions if p.cause not in (None, p.victim))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_cache_reset_preempts_every_running_request_with_no_cause(
    layout: str, model_dir: str, receiver: cause_channel.Receiver
) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if "reset_running_requests" not in inspect.signature(Scheduler.reset_prefix_cache).parameters:
        pytest.skip("this vLLM's Scheduler.reset_prefix_cache cannot preempt the running requests")
    received, expected, record, requests, running = _run(layout, model_dir, receiver, reset_at=RESET_AT)

    assert received == expected
    resets = [r for r in received[RESET_AT] if r.kind == CAUSE_CACHE_RESET]
    assert resets == received[RESET_AT]
    assert len(resets) == running[RESET_AT - 1] > 0
    assert all(r.causes == () for r in resets)
    assert [r for step in received for r in step if r.kind == CAUSE_CACHE_RESET] == resets
    assert sum(len(step) for step in received) == len(record.preemptions) == sum(r.num_preemptions for r in requests)
