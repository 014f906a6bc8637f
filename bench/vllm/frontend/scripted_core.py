"""The engine core's stand-in: every step's outputs of a round known in advance, given out in
lockstep with the streams."""

from __future__ import annotations

import asyncio
import time
from typing import Any


class ScriptedCore:
    """What ``AsyncLLM`` uses of vLLM's engine-core client, answering from a script.

    Every step's ``EngineCoreOutputs`` (tokens, engine-core events, scheduler stats) of each of
    the round's loads is built when the core is, before the round is measured, from the specs
    (``otel_llm.testing.vllm.stream``); once all of a load's requests are in, they are given
    their request ids by arrival order, and ``get_output_async`` yields one step at a time, each
    only once every request's output collector is empty again.
    """

    engine_ranks_managed = [0]

    class resources:  # vLLM reads engine_core.resources.engine_dead
        engine_dead = False

    def __init__(self, specs: list[Any], loads: int = 1) -> None:
        self.processor: Any = None  # AsyncLLM's OutputProcessor, set once it exists
        self._expected = len(specs)
        self._requests: list[Any] = []
        self._arrived = asyncio.Event()
        self.finished = asyncio.Event()
        self._rids = [s.rid for s in specs]
        # Each load's own outputs, as an engine core sends new ones (none reused across loads).
        self._loads = [self._script(specs) for _ in range(loads)]
        self._stream = self._script_steps()

    @staticmethod
    def _script(specs: list[Any]) -> tuple[dict[str, list[Any]], list[Any]]:
        """One load's outputs by request (to name at arrival) and its steps."""
        from vllm.v1.engine import EngineCoreOutputs

        from otel_llm.testing.vllm.stream import build, engine_core_output, scheduler_stats

        script = build(specs, t0=time.monotonic(), w0=time.time())
        by_rid = {s.rid: s for s in specs}
        outputs: dict[str, list[Any]] = {s.rid: [] for s in specs}
        steps = []
        for step in range(script.last_step + 1):
            outs = script.outputs.get(step, [])
            engine_outputs = [engine_core_output(by_rid[o.rid], o) for o in outs]
            for out, engine_output in zip(outs, engine_outputs):
                outputs[out.rid].append(engine_output)
            steps.append(
                EngineCoreOutputs(
                    engine_index=0,
                    outputs=engine_outputs,
                    scheduler_stats=scheduler_stats(script, step, outs),
                    timestamp=script.output_ts(step),
                )
            )
        return outputs, steps

    async def add_request_async(self, request: Any) -> None:
        self._requests.append(request)
        if len(self._requests) == self._expected:
            self._arrived.set()

    async def abort_requests_async(self, request_ids: Any) -> None:
        return None

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    async def reset_mm_cache_async(self) -> None:
        return None

    async def is_sleeping_async(self) -> bool:
        return False

    def shutdown(self, timeout: Any = None) -> None:
        return None

    def dp_engines_running(self) -> bool:
        return False

    async def _drained(self) -> None:
        states = self.processor.request_states
        for _ in range(1_000_000):
            if all(s.queue is None or s.queue.output is None for s in states.values()):
                return
            await asyncio.sleep(0)
        raise RuntimeError("the streams did not take their outputs")

    async def get_output_async(self) -> Any:
        return await self._stream.__anext__()

    async def _script_steps(self) -> Any:
        for outputs, steps in self._loads:  # the client sends a load once the last one has ended
            await self._arrived.wait()
            requests, self._requests = self._requests[: self._expected], self._requests[self._expected :]
            if len(self._requests) < self._expected:
                self._arrived.clear()
            for rid, request in zip(self._rids, requests):
                for output in outputs[rid]:
                    output.request_id = request.request_id
            for step in steps:
                await self._drained()
                yield step
        self.finished.set()
        await asyncio.Event().wait()  # no more steps this round: as an idle engine core


def round_specs(requests: int, tokens: int, running: int = 4) -> list[Any]:
    """All requests arrive at once; ``running`` at a time are scheduled, the rest wait their
    turn (the real engine under bench.vllm.engine's KV pressure runs 3 or 4 at once, so the
    per-step work is shared by that many tokens); a quarter preempted once, a third of the way
    through (as bench.vllm.record)."""
    from otel_llm.testing.vllm.stream import Spec

    wave = tokens + 3  # a preempted request's 2 steps back in the queue, and one to spare
    return [
        Spec(
            f"r{i}",
            arrive=0,
            queue=(i // running) * wave,
            prompt=40 + i,
            tokens=tokens,
            max_tokens=tokens,
            preempt_after=(tokens // 3,) if i % 4 == 0 else (),
        )
        for i in range(requests)
    ]
