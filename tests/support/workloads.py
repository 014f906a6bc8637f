"""A small engine_stub run that really preempts, shared by the tests that need one."""

from __future__ import annotations

from typing import Any

NUM_REQUESTS = 30


def preempting_engine_config() -> Any:
    from engine_stub import EngineConfig

    # 12 blocks of 16 tokens for 30 requests of up to ~190 tokens: preemptions from 0 to ~18
    # per request, every bucket populated (about 1.5 s on one core).
    return EngineConfig(
        num_kv_blocks=12, block_size=16, max_num_seqs=16, max_num_batched_tokens=64, seed=0, load_plugins=False
    )


def add_requests(engine: Any, n: int = NUM_REQUESTS) -> None:
    # Priorities 0..2 are tenants (OTEL_LLM_TENANT=priority); the FCFS policy does not look at them.
    for i in range(n):
        engine.add_request(
            f"req-{i:03d}", "hello world " * (1 + i % 3), max_tokens=min(150, 20 + (i * 37) % 150), priority=i % 3
        )


def engine_run(telemetry: Any, n: int = 24) -> dict[str, int]:
    """Run ``n`` requests through an engine with ``telemetry`` subscribed: preemptions by request id."""
    from engine_stub import Engine

    engine = Engine(preempting_engine_config())
    engine.hooks.subscribe(telemetry)
    add_requests(engine, n)
    return {o.request_id: o.num_preemptions for o in engine.run()}
