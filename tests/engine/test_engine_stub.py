"""engine_stub on its own: paged attention, scheduler invariants, preemption, events, plugins."""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from importlib.metadata import EntryPoint
from types import SimpleNamespace
from typing import Sequence

import pytest
import torch

import engine_stub.engine as engine_module
from engine_stub import STOP_TOKEN_ID, Engine, EngineConfig, RequestOutput
from engine_stub.model import AttentionGroup, Block, TinyTransformer, paged_attention
from engine_stub.plugins import GROUP, load_plugins
from engine_stub.request import RequestStatus
from engine_stub.workload import WorkloadSpec, generate, run_workload
from otel_llm.events import EventType, RequestEvent, StepStats


class Recorder:
    """Subscriber that keeps everything, and how many batches each step delivered."""

    def __init__(self) -> None:
        self.batches: list[list[RequestEvent]] = []
        self.steps: list[StepStats] = []

    def on_events(self, events: Sequence[RequestEvent]) -> None:
        self.batches.append(list(events))

    def on_step(self, stats: StepStats) -> None:
        self.steps.append(stats)

    @property
    def events(self) -> list[RequestEvent]:
        return [e for batch in self.batches for e in batch]

    def by_request(self) -> dict[str, list[RequestEvent]]:
        out: dict[str, list[RequestEvent]] = defaultdict(list)
        for e in self.events:
            out[e.request_id].append(e)
        return out


def batched_tokens(stats: StepStats) -> int:
    """The step's batched tokens: the stub engine reports them on every step."""
    assert stats.num_batched_tokens is not None
    return stats.num_batched_tokens


def make_engine(**kwargs: object) -> Engine:
    return Engine(EngineConfig(load_plugins=False, **kwargs))  # type: ignore[arg-type]  # a test passes EngineConfig's own keywords


def tight_engine() -> Engine:
    return make_engine(num_kv_blocks=40, max_num_seqs=24, max_num_batched_tokens=128)


def run_spec(engine: Engine, num_requests: int, seed: int = 0) -> list[RequestOutput]:
    # Lengths are clipped to a fixed 640 tokens, so every engine gets the same workload.
    requests = generate(WorkloadSpec(num_requests=num_requests, seed=seed), 640)
    return run_workload(engine, requests).outputs


# ---------------------------------------------------------------- model


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: list[int]) -> torch.Tensor:
    """Softmax attention written out: q [Q, H, D] at positions q_pos over k/v [L, H, D]."""
    scores = torch.einsum("qhd,lhd->hql", q, k) / math.sqrt(q.shape[-1])
    future = torch.arange(k.shape[0])[None, :] > torch.tensor(q_pos)[:, None]
    scores = scores.masked_fill(future[None], float("-inf"))
    return torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), v)


def test_paged_attention_equals_plain_attention() -> None:
    gen = torch.Generator().manual_seed(1)
    block_size, num_blocks, heads, dim = 4, 32, 4, 16
    key_cache = torch.zeros(num_blocks * block_size, heads, dim)
    value_cache = torch.zeros_like(key_cache)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, out-of-order blocks
    lengths = [37, 5, 16, 1]
    seqs = []
    for length in lengths:
        table = [free.pop() for _ in range(-(-length // block_size))]
        k = torch.randn(length, heads, dim, generator=gen)
        v = torch.randn(length, heads, dim, generator=gen)
        q = torch.randn(length, heads, dim, generator=gen)
        for p in range(length):
            slot = table[p // block_size] * block_size + p % block_size
            key_cache[slot], value_cache[slot] = k[p], v[p]
        seqs.append((table, q, k, v))

    # A prefill chunk: the last 9 queries of the 37-token sequence, causal within the chunk.
    table, q, k, v = seqs[0]
    positions = list(range(28, 37))
    group = AttentionGroup.build(torch.arange(9)[None], torch.tensor([table]), torch.tensor([positions]), block_size)
    paged = paged_attention(q[28:][None], key_cache, value_cache, group)[0]
    torch.testing.assert_close(paged, plain_attention(q[28:], k, v, positions), atol=1e-5, rtol=1e-5)

    # A decode batch: one query per sequence, block tables padded to the longest.
    width = max(len(t) for t, *_ in seqs)
    group = AttentionGroup.build(
        torch.arange(len(seqs))[:, None],
        torch.tensor([t + [0] * (width - len(t)) for t, *_ in seqs]),
        torch.tensor([[n - 1] for n in lengths]),
        block_size,
    )
    paged = paged_attention(torch.stack([q[-1] for _, q, _, _ in seqs])[:, None], key_cache, value_cache, group)[:, 0]
    for i, (_, q, k, v) in enumerate(seqs):
        expected = plain_attention(q[-1:], k, v, [lengths[i] - 1])[0]
        torch.testing.assert_close(paged[i], expected, atol=1e-5, rtol=1e-5)


def dense_greedy(model: TinyTransformer, prompt: list[int], max_tokens: int) -> list[int]:
    """Reference decoding: recompute the whole sequence with plain attention, no cache."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        t = torch.tensor(tokens)
        x = model.embed(t) + model.positional_encoding(torch.arange(len(tokens)))
        for blk in model.blocks:
            assert isinstance(blk, Block)  # nn.ModuleList yields nn.Module
            n = len(tokens)
            q, k, v = blk.qkv(blk.norm1(x)).view(n, 3, blk.num_heads, blk.head_dim).unbind(1)
            x = x + blk.out(plain_attention(q, k, v, list(range(n))).reshape(n, -1))
            x = x + blk.mlp(blk.norm2(x))
        tokens.append(int(torch.argmax(model.lm_head(model.norm(x[-1])))))
    return tokens[len(prompt) :]


@torch.inference_mode()
def test_engine_greedy_equals_dense_reference_with_chunking_and_preemption() -> None:
    engine = make_engine(num_kv_blocks=6, block_size=8, max_num_seqs=4, max_num_batched_tokens=7)
    prompts = {"a": "The quick brown fox", "b": "jumps over the lazy dog", "c": "paged attention"}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, max_tokens=12, stop_token_ids=())
    outputs = {o.request_id: o for o in engine.run()}
    assert sum(o.num_preemptions for o in outputs.values()) > 0  # recompute really happened
    for rid, prompt in prompts.items():
        expected = dense_greedy(engine.model, list(prompt.encode()), 12)
        assert outputs[rid].token_ids == expected, rid


# ---------------------------------------------------------------- scheduler and KV cache


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_scheduler_invariants_hold_every_step(policy: str) -> None:
    engine = make_engine(num_kv_blocks=40, max_num_seqs=24, max_num_batched_tokens=128, scheduling_policy=policy)
    recorder = Recorder()
    engine.hooks.subscribe(recorder)
    capacity = engine.config.num_kv_blocks * engine.config.block_size
    pending = generate(WorkloadSpec(num_requests=60, seed=3, num_tenants=3), capacity)
    for w in pending:
        engine.add_request(w.request_id, w.prompt, max_tokens=w.max_tokens, temperature=1.0, priority=w.priority)
    kv, sched = engine.kv_cache, engine.scheduler
    finished = 0
    while engine.has_unfinished_requests():
        finished += len(engine.step())
        stats = recorder.steps[-1]
        assert batched_tokens(stats) <= engine.config.max_num_batched_tokens
        assert len(sched.running) <= engine.config.max_num_seqs
        held = [b for r in sched.running for b in r.block_table]
        assert len(held) == len(set(held)) == kv.num_blocks - kv.num_free_blocks
        assert all(not r.block_table and r.num_computed_tokens == 0 for r in sched.waiting)
        for r in sched.running:
            assert len(r.block_table) == kv.blocks_for(r.num_computed_tokens)
            assert r.status is RequestStatus.RUNNING
    assert finished == 60
    assert kv.num_free_blocks == kv.num_blocks
    assert max(s.kv_cache_usage for s in recorder.steps) == 1.0
    assert max(batched_tokens(s) for s in recorder.steps) == engine.config.max_num_batched_tokens


def test_request_that_can_never_fit_is_rejected_at_add_time() -> None:
    engine = make_engine(num_kv_blocks=2, block_size=16)
    prompt = [65] * 20
    with pytest.raises(ValueError, match=r"can never fit the KV cache: prompt \(20\) \+ max_tokens \(14\)"):
        engine.add_request("too-big", prompt, max_tokens=14)
    assert not engine.has_unfinished_requests()
    engine.add_request("exact-fit", prompt, max_tokens=13, stop_token_ids=())  # 32 slots exactly
    [out] = engine.run()
    assert (out.request_id, len(out.token_ids), out.finish_reason) == ("exact-fit", 13, "length")
    assert engine.kv_cache.num_free_blocks == 2


def test_self_preemption_exact_trace() -> None:
    # 4 blocks of 4 slots. Step 4: "a" takes the last free block for position 4, then "b" (the
    # last running) needs a block for position 8 and preempts itself, losing its 8 computed tokens.
    engine = make_engine(num_kv_blocks=4, block_size=4, max_num_batched_tokens=64)
    recorder = Recorder()
    engine.hooks.subscribe(recorder)
    engine.add_request("a", [1, 2], max_tokens=8, stop_token_ids=())
    engine.add_request("b", [3, 4, 5, 6, 7, 8], max_tokens=8, stop_token_ids=())
    outputs = {o.request_id: o for o in engine.run()}
    assert outputs["a"].num_preemptions == 0
    assert outputs["b"].num_preemptions == 1
    b = [(e.type.name, e.num_computed_tokens) for e in recorder.by_request()["b"]]
    assert b == [("ARRIVED", 0), ("QUEUED", 0), ("SCHEDULED", 0), ("FIRST_TOKEN", 0)] + [("TOKENS", 0)] * 3 + [
        ("PREEMPTED", 8),
        ("SCHEDULED", 0),
    ] + [("TOKENS", 0)] * 5 + [("FINISHED", 0)]
    [preempt_step] = [i for i, batch in enumerate(recorder.batches) for e in batch if e.type is EventType.PREEMPTED]
    assert preempt_step == 3

    alone = make_engine(num_kv_blocks=64)
    alone.add_request("b", [3, 4, 5, 6, 7, 8], max_tokens=8, stop_token_ids=())
    assert alone.run()[0].token_ids == outputs["b"].token_ids  # recompute changes nothing


def test_priority_policy_preempts_the_lowest_class_even_when_already_scheduled() -> None:
    # 4 blocks of 4 slots; "a" (lower class) runs first, "b" joins at step 2. Step 4: "a" takes the
    # last free block (position 4). Step 5: "a" is scheduled first (position 5), then "b" needs a
    # block for position 8: the victim is "a", the lowest class, though already scheduled in that
    # step (undone: its 5 computed tokens lost); "b" is never preempted.
    engine = make_engine(num_kv_blocks=4, block_size=4, max_num_batched_tokens=64, scheduling_policy="priority")
    recorder = Recorder()
    engine.hooks.subscribe(recorder)
    engine.add_request("a", [1, 2], max_tokens=8, stop_token_ids=(), priority=1)
    engine.step()
    engine.add_request("b", [3, 4, 5, 6, 7, 8], max_tokens=8, stop_token_ids=(), priority=0)
    outputs = {o.request_id: o for o in engine.run()}
    assert (outputs["a"].preempted_by, outputs["b"].preempted_by) == (("b",), ())
    assert outputs["b"].num_preemptions_caused == 1
    a = [(e.type.name, e.num_computed_tokens) for e in recorder.by_request()["a"]][:10]
    assert a == [("ARRIVED", 0), ("QUEUED", 0), ("SCHEDULED", 0), ("FIRST_TOKEN", 0)] + [("TOKENS", 0)] * 4 + [
        ("PREEMPTED", 5),
        ("SCHEDULED", 0),
    ]
    [preempt_step] = [i for i, batch in enumerate(recorder.batches) for e in batch if e.type is EventType.PREEMPTED]
    assert preempt_step == 4
    for rid, prompt in (("a", [1, 2]), ("b", [3, 4, 5, 6, 7, 8])):
        alone = make_engine(num_kv_blocks=64)
        alone.add_request(rid, prompt, max_tokens=8, stop_token_ids=())
        assert alone.run()[0].token_ids == outputs[rid].token_ids, rid  # the undone step changes nothing


def test_an_unknown_scheduling_policy_is_refused() -> None:
    with pytest.raises(ValueError, match=r"scheduling policy 'lifo' is not one of \('fcfs', 'priority'\)"):
        make_engine(scheduling_policy="lifo")


def test_outputs_independent_of_batching_and_preemption() -> None:
    ample = make_engine(num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=4096)
    tight = tight_engine()
    a = {o.request_id: o for o in run_spec(ample, 60, seed=5)}
    b = {o.request_id: o for o in run_spec(tight, 60, seed=5)}
    assert sum(o.num_preemptions for o in a.values()) == 0
    assert sum(o.num_preemptions for o in b.values()) > 0
    assert {k: o.token_ids for k, o in a.items()} == {k: o.token_ids for k, o in b.items()}


def test_ample_kv_means_zero_preemptions() -> None:
    engine = make_engine(num_kv_blocks=1024, max_num_seqs=32, max_num_batched_tokens=512)
    outputs = run_spec(engine, 100)
    assert len(outputs) == 100
    assert [o.num_preemptions for o in outputs] == [0] * 100


def test_tight_cache_preempts_some_requests_several_times() -> None:
    outputs = run_spec(tight_engine(), 100)
    counts = Counter(o.num_preemptions for o in outputs)
    assert len(outputs) == 100
    assert counts[0] > 0  # most are fine...
    assert sum(n for c, n in counts.items() if c >= 3) >= 2  # ...a few thrash
    assert sum(c * n for c, n in counts.items()) >= 20


def test_deterministic_for_a_seed() -> None:
    def trace(seed: int) -> tuple[list[tuple[str, list[int], str, int]], list[tuple[str, str, int]]]:
        engine = make_engine(num_kv_blocks=40, max_num_seqs=24, max_num_batched_tokens=128, seed=seed)
        recorder = Recorder()
        engine.hooks.subscribe(recorder)
        outputs = run_spec(engine, 50)
        return (
            [(o.request_id, o.token_ids, o.finish_reason, o.num_preemptions) for o in outputs],
            [(e.type.name, e.request_id, e.num_computed_tokens) for e in recorder.events],
        )

    first = trace(0)
    assert trace(0) == first
    assert trace(1)[0] != first[0]


# ---------------------------------------------------------------- finishing


def test_stop_token_and_length() -> None:
    engine = make_engine()
    engine.add_request("free", "hello", max_tokens=10, stop_token_ids=())
    [free] = engine.run()
    assert (len(free.token_ids), free.finish_reason) == (10, "length")
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    engine.add_request("stopped", "hello", max_tokens=10, stop_token_ids=[stop_at])
    [stopped] = engine.run()
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]  # the stop token is kept in token_ids
    assert STOP_TOKEN_ID not in list(stopped.text.encode())


def test_abort_waiting_and_running_requests() -> None:
    engine = make_engine(num_kv_blocks=8, max_num_seqs=1)
    recorder = Recorder()
    engine.hooks.subscribe(recorder)
    engine.add_request("running", "abc", max_tokens=50, stop_token_ids=())
    engine.add_request("waiting", "def", max_tokens=50, stop_token_ids=())
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    assert engine.abort_request("running") and engine.abort_request("waiting")
    assert not engine.abort_request("running") and not engine.abort_request("unknown")
    assert engine.kv_cache.num_free_blocks == 8
    assert engine.has_unfinished_requests()  # the aborts are not returned yet
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason, len(o.token_ids)) for o in outputs] == [
        ("running", "abort", 1),
        ("waiting", "abort", 0),
    ]
    assert not engine.has_unfinished_requests()
    by_request = recorder.by_request()
    assert [e.type.name for e in by_request["waiting"]] == ["ARRIVED", "QUEUED", "FINISHED"]
    assert by_request["running"][-1].finish_reason == "abort"


# ---------------------------------------------------------------- events


def check_lifecycle(events: list[RequestEvent], output: RequestOutput) -> None:
    types = [e.type for e in events]
    assert types[:2] == [EventType.ARRIVED, EventType.QUEUED]
    assert types[-1] is EventType.FINISHED and types.count(EventType.FINISHED) == 1
    assert events[-1].finish_reason == output.finish_reason
    assert events[0].prompt_tokens == len(output.prompt_token_ids)
    # SCHEDULED and PREEMPTED alternate, starting and ending with SCHEDULED.
    transitions = [t for t in types if t in (EventType.SCHEDULED, EventType.PREEMPTED)]
    assert transitions == [EventType.SCHEDULED, EventType.PREEMPTED] * output.num_preemptions + [EventType.SCHEDULED]
    assert types.count(EventType.FIRST_TOKEN) == 1
    assert types.index(EventType.FIRST_TOKEN) < types.index(EventType.TOKENS)
    assert types.index(EventType.SCHEDULED) < types.index(EventType.FIRST_TOKEN)
    assert sum(e.num_tokens for e in events if e.type is EventType.TOKENS) == len(output.token_ids)
    for e in events:
        if e.type is EventType.PREEMPTED:
            assert e.reason == "kv_cache_full" and e.num_computed_tokens > 0


def test_event_stream_is_consistent_with_ground_truth() -> None:
    engine = tight_engine()
    recorder = Recorder()
    engine.hooks.subscribe(recorder)
    outputs = run_spec(engine, 80)
    assert len(recorder.batches) <= len(recorder.steps)  # at most one batch per step
    timestamps = [e.timestamp for e in recorder.events]
    assert timestamps == sorted(timestamps)
    by_request = recorder.by_request()
    assert set(by_request) == {o.request_id for o in outputs}
    for output in outputs:
        check_lifecycle(by_request[output.request_id], output)
    preempted = sum(e.type is EventType.PREEMPTED for e in recorder.events)
    assert preempted == sum(o.num_preemptions for o in outputs) > 0


def test_no_subscriber_builds_no_events(monkeypatch: pytest.MonkeyPatch) -> None:
    built = 0

    def counting(*args: object, **kwargs: object) -> RequestEvent:
        nonlocal built
        built += 1
        return RequestEvent(*args, **kwargs)  # type: ignore[arg-type]  # RequestEvent's own arguments, passed through

    monkeypatch.setattr(engine_module, "RequestEvent", counting)
    monkeypatch.setattr(engine_module, "StepStats", counting)
    engine = tight_engine()
    assert not engine.hooks.active
    assert len(run_spec(engine, 30)) == 30
    assert built == 0


def test_200_request_run_with_preemptions_timing() -> None:
    engine = make_engine(num_kv_blocks=64, max_num_seqs=32, max_num_batched_tokens=256)
    start = time.perf_counter()
    outputs = run_spec(engine, 200)
    elapsed = time.perf_counter() - start
    preemptions = sum(o.num_preemptions for o in outputs)
    print(f"\n200 requests, {preemptions} preemptions: {elapsed:.2f} s")
    assert len(outputs) == 200 and preemptions > 0


# ---------------------------------------------------------------- plugins


class _Closable:
    closed = 0

    def shutdown(self) -> None:
        _Closable.closed += 1


def _plugin_ok(engine: Engine) -> _Closable:
    engine.plugin_ran = True  # type: ignore[attr-defined]  # the plugin marks the engine it ran on
    return _Closable()


def _plugin_broken(engine: Engine) -> None:
    raise RuntimeError("broken plugin")


def fake_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    eps = [
        EntryPoint("ok", f"{__name__}:_plugin_ok", GROUP),
        EntryPoint("broken", f"{__name__}:_plugin_broken", GROUP),
        EntryPoint("missing", "no_such_module_xyz:register", GROUP),
    ]
    monkeypatch.setattr("engine_stub.plugins.entry_points", lambda group: [e for e in eps if e.group == group])


def test_failing_plugins_are_logged_and_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_entry_points(monkeypatch)
    monkeypatch.delenv("ENGINE_STUB_PLUGINS", raising=False)
    engine = Engine(EngineConfig())
    assert engine.plugins == ["ok"]
    assert engine.plugin_ran  # type: ignore[attr-defined]  # set by _plugin_ok
    failed = sorted(r.getMessage().split("'")[1] for r in caplog.records if r.levelname == "ERROR")
    assert failed == ["broken", "missing"]
    engine.add_request("r", "still works", max_tokens=3)
    assert len(engine.run()) == 1
    closed = _Closable.closed
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert _Closable.closed == closed + 1


@pytest.mark.parametrize(("value", "expected"), [("", []), ("ok", ["ok"]), (" ok , nope", ["ok"])])
def test_plugin_filter_by_env(monkeypatch: pytest.MonkeyPatch, value: str, expected: list[str]) -> None:
    fake_entry_points(monkeypatch)
    monkeypatch.setenv("ENGINE_STUB_PLUGINS", value)
    assert [name for name, _ in load_plugins(SimpleNamespace())] == expected


def test_load_plugins_false_skips_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(monkeypatch)
    monkeypatch.delenv("ENGINE_STUB_PLUGINS", raising=False)
    assert Engine(EngineConfig(load_plugins=False)).plugins == []
