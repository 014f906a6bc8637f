"""``python -m engine_stub``: run a synthetic workload and print a summary."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .engine import Engine, EngineConfig
from .stopping import EXIT_STATUS, Stopped, say_stopped, stop_on_sigterm
from .workload import WorkloadSpec, generate, run_workload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine_stub",
        description="Run engine_stub on a seeded workload (Poisson arrivals, long-tailed lengths). "
        "Plugins from the entry-point group engine_stub.plugins load unless --no-plugins "
        "(filter with ENGINE_STUB_PLUGINS). The otel plugin follows the OTEL_* variables; unset, "
        "that is OTLP to localhost:4317, and shutdown waits for it to time out when nothing "
        "listens: set OTEL_METRICS_EXPORTER/OTEL_TRACES_EXPORTER, or pass --no-plugins.",
    )
    p.add_argument("--requests", type=int, default=200, help="number of requests (default 200)")
    p.add_argument("--rate", type=float, default=50.0, help="arrivals per simulated second")
    p.add_argument("--step-time", type=float, default=0.01, help="simulated seconds per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-blocks", type=int, default=64, help="KV cache blocks (default 64)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--prompt-median", type=int, default=48)
    p.add_argument("--output-median", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--no-plugins", action="store_true", help="load no engine_stub plugin")
    return p


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    config = EngineConfig(
        num_kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        load_plugins=not args.no_plugins,
    )
    engine = Engine(config)
    spec = WorkloadSpec(
        num_requests=args.requests,
        rate=args.rate,
        seed=args.seed,
        prompt_median=args.prompt_median,
        output_median=args.output_median,
    )
    requests = generate(spec, config.num_kv_blocks * config.block_size)
    try:
        with stop_on_sigterm() as stop:
            try:
                with stop.between_steps():
                    result = run_workload(
                        engine,
                        requests,
                        step_time=args.step_time,
                        temperature=args.temperature,
                        between_steps=stop.check,
                    )
            except Stopped:
                say_stopped("engine_stub", engine.num_running + engine.num_waiting)
                raise
            finally:
                engine.shutdown()  # the plugins flush: in-flight spans end marked incomplete
    except Stopped:
        sys.exit(EXIT_STATUS)
    thrashing = sum(1 for o in result.outputs if o.num_preemptions >= 5)
    print(f"requests         {len(result.outputs)}")
    print(f"steps            {result.steps}")
    print(f"output tokens    {result.num_output_tokens}")
    print(f"wall time        {result.elapsed:.2f} s")
    print(f"tokens/s         {result.tokens_per_second:.0f}")
    print(f"preemptions      {result.total_preemptions}")
    print(f"max preemptions  {result.max_preemptions}")
    print(f"requests with 5+ preemptions  {thrashing}")
    print(f"plugins          {', '.join(engine.plugins) or '-'}")


if __name__ == "__main__":
    main()
