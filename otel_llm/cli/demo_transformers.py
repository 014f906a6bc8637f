"""``otel-llm demo --engine transformers``: transformers' continuous batching on a tiny Llama with
seeded random weights and too little KV cache, instrumented by TransformersInstrumentor.

The summary is ``make demo``'s: the per-request preemption chart from the telemetry, the worst
requests' trace ids, the worst evictors (the requests whose KV demand caused the most evictions,
and whom they evicted, as the telemetry has them), and whether the telemetry equals the engine:
its evictions as transformers' own log line counts them, and its outputs.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_llm.catalogue.metrics import BY_KEY
from otel_llm.cli.demo import RequestTraces, _histogram_point, _otlp_configured
from otel_llm.cli.render import (
    THRASHING,
    PreemptionHistogram,
    print_chart,
    print_fields,
    print_worst,
    print_worst_evictors,
)
from otel_llm.config.settings import TelemetryConfig

MODEL_NAME = "transformers-tiny"
MAX_NEW_TOKENS = 48


class _Evictions(logging.Handler):
    """transformers' own count: its log line per eviction round ("Offloaded N requests ...")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Offloaded "):
            self.count += int(message.split()[1])


def demo_transformers(args: argparse.Namespace) -> int:
    import torch
    from transformers import LlamaForCausalLM

    from engine_stub.stopping import EXIT_STATUS, Stopped, say_stopped, stop_on_sigterm
    from otel_llm.export.setup import setup_telemetry
    from otel_llm.integrations.transformers import TransformersInstrumentor
    from otel_llm.testing.models import VOCAB_SIZE, make_tiny_llama

    otlp = ("otlp",) if _otlp_configured() else ()
    config = TelemetryConfig.from_env(
        defaults={"model_name": MODEL_NAME, "naming": "semconv", "provider_name": "transformers"},
        metrics_exporters=("prometheus", *otlp),
        traces_exporters=otlp or ("none",),
        prometheus_host=args.prometheus_host,
        prometheus_port=args.prometheus_port,
    )
    reader, traces = InMemoryMetricReader(), RequestTraces()
    try:
        handle = setup_telemetry(config, extra_metric_readers=[reader], extra_span_processors=[traces])
    except OSError as exc:
        print(f"otel-llm demo: cannot serve /metrics ({exc}); choose another --prometheus-port", file=sys.stderr)
        return 2
    instrumentor = TransformersInstrumentor()
    evictions = _Evictions()
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    quiet = [(h, h.level) for h in cb_logger.handlers]  # its own console handler: not one line per eviction
    for h, _ in quiet:
        h.setLevel(logging.WARNING)
    cb_logger.addHandler(evictions)
    cb_logger.setLevel(logging.INFO)
    cut_short: list[int] = []  # the requests in flight when SIGTERM came, ended by the telemetry
    with stop_on_sigterm():
        try:
            torch.set_num_threads(1)
            with tempfile.TemporaryDirectory() as tmp:
                make_tiny_llama(Path(tmp), args.seed)
                model = LlamaForCausalLM.from_pretrained(tmp, attn_implementation="sdpa", dtype=torch.float32)
            instrumentor.instrument(
                config=config, meter_provider=handle.meter_provider, tracer_provider=handle.tracer_provider
            )
            rng = random.Random(args.seed)
            inputs = [[rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(8, 40))] for _ in range(args.requests)]
            t0 = time.perf_counter()
            outputs = _generate(model, inputs, args.kv_blocks, instrumentor, cut_short)
            elapsed = time.perf_counter() - t0
            instrumentor.uninstrument()  # the telemetry applies what is pending; the providers stay ours
            handle.force_flush()
            histogram_name = BY_KEY["request_num_preemptions"].name(config.naming)
            histogram = PreemptionHistogram.from_point(_histogram_point(reader, histogram_name))
            tokens = sum(len(o.generated_tokens) for o in outputs.values())
            agrees = histogram.count == len(outputs) == len(
                traces.by_request
            ) and histogram.sum == evictions.count == sum(c for c, _ in traces.by_request.values())
            thrashing = sum(c >= THRASHING for c, _ in traces.by_request.values())
            print(
                f"otel-llm demo: transformers continuous batching, {args.kv_blocks} KV blocks x 16 tokens, "
                f"{MAX_NEW_TOKENS} new tokens per request, seed {args.seed}"
            )
            print_fields(
                [
                    ("requests", histogram.count),
                    ("output tokens", tokens),
                    ("wall time", f"{elapsed:.1f} s"),
                    ("tokens/s", f"{tokens / elapsed:.0f}"),
                    ("preemptions", int(histogram.sum)),
                    ("thrashing", f"{thrashing} requests with {THRASHING}+ preemptions"),
                    ("ground truth", "telemetry equals the engine" if agrees else "MISMATCH with the engine"),
                ]
            )
            print()
            print_chart(histogram_name, histogram)
            print()
            print_worst(traces.by_request, args.top)
            print()
            print_worst_evictors(traces.caused, traces.victims, args.top)
            print(flush=True)
            if args.serve_seconds > 0:
                url = f"http://{args.prometheus_host}:{handle.prometheus_port}/metrics"
                print(f"serving {url} for {args.serve_seconds:g} s")
                try:
                    threading.Event().wait(args.serve_seconds)
                except KeyboardInterrupt:
                    pass  # the ordinary way to stop serving
        except Stopped:
            say_stopped("otel-llm demo", sum(cut_short), " mid-batch")
            return EXIT_STATUS
        finally:
            cb_logger.removeHandler(evictions)
            for h, level in quiet:
                h.setLevel(level)
            if instrumentor.is_instrumented_by_opentelemetry:
                instrumentor.uninstrument()
            handle.shutdown()
    return 0 if agrees else 1


def _generate(model: Any, inputs: list[list[int]], kv_blocks: int, instrumentor: Any, cut_short: list[int]) -> dict:
    """``generate_batch``'s loop, stopped otherwise on SIGTERM: the telemetry ends the requests in
    flight and counts them (``cut_short``) first, then transformers' manager stops at once (its
    own stop would run the batch on for up to 5 s, and what finished then would not be counted):
    each request either finished before the signal or is counted and keeps one span, cut short."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from engine_stub.stopping import Stopped

    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(
            max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
        ),
        continuous_batching_config=ContinuousBatchingConfig(
            page_size=16,
            num_blocks=kv_blocks,
            max_batch_tokens=128,
            max_requests_per_batch=16,
            allow_block_sharing=False,
        ),
    )
    outputs: dict = {}
    manager.start()
    try:
        request_ids = manager.add_requests(inputs=inputs, max_new_tokens=MAX_NEW_TOKENS)
        while len(outputs) < len(request_ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                outputs[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' generation thread ended before its requests")
    except Stopped:
        cut_short.append(instrumentor.uninstrument() or 0)
        manager.stop(block=True, timeout=5, hard_stop=True)
        raise
    finally:
        manager.destroy()  # stops the generation thread if it still runs
    return outputs
