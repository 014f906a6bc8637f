"""``python -m bench.transformers [--reps N] [--requests N] [--rounds N] [--out PATH]`` (in .venv-transformers)

What TransformersInstrumentor costs transformers' continuous batching: the same seeded workload
(``generate_batch`` on a tiny Llama with seeded random weights and too little KV cache, so that
requests are evicted) with the instrumentor off and on (metrics and spans, the providers that
``setup_telemetry`` builds, OTLP export of both to a real receiver, rotel), interleaved in this one
process; tokens/s of each and their ratio. Then a long run with the instrumentor on: the RSS after
each round of the workload, and its slope per round (memory flat: no per-request state kept).
The result goes into bench/results.json under ``transformers``; other keys are kept.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from .common import env, interleave, median, otlp_receiver, ratio, rss_bytes, slope, write_section

HERE = Path(__file__).resolve().parent
KEY = "transformers"
MAX_NEW_TOKENS = 48


def _model(path: Path) -> Any:
    import torch
    from transformers import LlamaForCausalLM

    from otel_llm.testing.models import make_tiny_llama

    torch.set_num_threads(1)  # two shared cores: torch's threads would contend with the engine's
    return LlamaForCausalLM.from_pretrained(make_tiny_llama(path), attn_implementation="sdpa", dtype=torch.float32)


def _workload(model: Any, requests: int) -> tuple[float, int]:
    """One seeded generate_batch: (seconds, output tokens)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    rng = random.Random(0)
    inputs = [[rng.randrange(1, 512) for _ in range(rng.randint(8, 40))] for _ in range(requests)]
    t0 = time.perf_counter()
    outputs = model.generate_batch(
        inputs=inputs,
        generation_config=GenerationConfig(
            max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
        ),
        continuous_batching_config=ContinuousBatchingConfig(
            page_size=16, num_blocks=6, max_batch_tokens=128, max_requests_per_batch=16, allow_block_sharing=False
        ),
        warmup=False,
    )
    seconds = time.perf_counter() - t0
    return seconds, sum(len(o.generated_tokens) for o in outputs.values())


def run(reps: int, requests: int, rounds: int) -> dict[str, Any]:
    from otel_llm.integrations.transformers import TransformersInstrumentor

    instrumentor = TransformersInstrumentor()
    with tempfile.TemporaryDirectory() as tmp, otlp_receiver() as receiver:
        model = _model(Path(tmp))
        with env(
            OTEL_METRICS_EXPORTER="otlp",
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver["grpc"],
            OTEL_EXPORTER_OTLP_INSECURE="true",
            OTEL_METRIC_EXPORT_INTERVAL="1000",
        ):
            _workload(model, requests)  # warm: first-call costs of torch and transformers

            def off() -> float:
                seconds, tokens = _workload(model, requests)
                return tokens / seconds

            def on() -> float:
                instrumentor.instrument()
                try:
                    seconds, tokens = _workload(model, requests)
                finally:
                    instrumentor.uninstrument()  # the final export, outside the timed workload
                return tokens / seconds

            rates = interleave({"off": off, "on": on}, reps)
            instrumentor.instrument()
            try:
                rss = []
                for _ in range(rounds):
                    _workload(model, requests)
                    rss.append(rss_bytes())
            finally:
                instrumentor.uninstrument()
    tokens_off, tokens_on = median(rates["off"]), median(rates["on"])
    settled = [float(v) for v in rss[1:]]  # the first round allocates the providers and the instruments
    return {
        "requests": requests,
        "max_new_tokens": MAX_NEW_TOKENS,
        "reps": reps,
        "receiver": receiver["kind"],
        "tokens_per_s_off": round(tokens_off, 1),
        "tokens_per_s_on": round(tokens_on, 1),
        "ratio_on_off": round(ratio(tokens_on, tokens_off), 3),
        "all_off": [round(v, 1) for v in rates["off"]],
        "all_on": [round(v, 1) for v in rates["on"]],
        "rounds": rounds,
        "rss_mb": [round(v / 2**20, 1) for v in rss],
        "rss_slope_kb_per_round": round(slope([float(i) for i in range(len(settled))], settled) / 1024, 1),
    }


def table_lines(result: dict[str, Any]) -> list[str]:
    return [
        f"transformers continuous batching, {result['requests']} requests x {result['max_new_tokens']} tokens, "
        f"{result['reps']} reps interleaved",
        f"  tokens/s off {result['tokens_per_s_off']}, on {result['tokens_per_s_on']}: ratio {result['ratio_on_off']}",
        f"  RSS over {result['rounds']} rounds on: {result['rss_mb'][0]} -> {result['rss_mb'][-1]} MB, "
        f"slope {result['rss_slope_kb_per_round']} KB/round",
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transformers", description=__doc__.splitlines()[2])
    p.add_argument("--reps", type=int, default=7, help="repetitions of each variant (default 7, at least 3)")
    p.add_argument("--requests", type=int, default=40, help="requests per workload (default 40)")
    p.add_argument("--rounds", type=int, default=20, help="workload rounds of the memory run (default 20, at least 3)")
    p.add_argument("--out", type=Path, default=HERE / "results.json", help="JSON to update (key transformers)")
    args = p.parse_args(argv)
    if args.reps < 3 or args.rounds < 3 or args.requests < 1:
        p.error("--reps and --rounds: at least 3; --requests: at least 1")
    return write_section(KEY, args.out, lambda: run(args.reps, args.requests, args.rounds), table_lines)


if __name__ == "__main__":
    sys.exit(main())
