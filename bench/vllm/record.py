"""``python -m bench.vllm.record [--reps N] [--requests N] [--tokens N] [--out PATH]``
(in .venv-vllm-<release>; ``make setup-vllm`` makes the newest release's)

What the plugin's stat logger costs vLLM's frontend per engine step, beside vLLM's own
Prometheus logger, without a server: a scripted engine-core stream
(``otel_llm.testing.vllm.stream``) goes through vLLM's real ``OutputProcessor`` and
``IterationStats``, and each step's stats are handed to the loggers under test, as ``AsyncLLM``'s
output handler does. The variants run interleaved in this one process, so the machine's noise
hits them alike:

- ``none``: no logger (the output processing every variant does);
- ``vllm``: vLLM's ``PrometheusStatLogger`` alone (what vLLM always runs);
- ``otel``: our ``OtelStatLogger`` alone (the plugin's providers: metrics read at collect time,
  one span per request ended into a batch span processor with an exporter that drops them);
- ``vllm+otel``: both, as deployed.

Each logger's cost is its variant's time less ``none``'s. The deep hook is not installed (the
general plugins are not loaded here). The result goes into bench/results.json under
``vllm_record``; other keys are kept.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from otel_llm.testing.vllm.server import ADD_MODE

from ..common import interleave, median, ratio, write_section

RESULTS = Path(__file__).resolve().parents[1] / "results.json"
KEY = "vllm_record"
VARIANTS = ("none", "vllm", "otel", "vllm+otel")


def _vllm_environment() -> None:
    """vLLM's classes on a CPU machine, offline (as vllm.mk sets for the tests)."""
    for var, value in (
        ("VLLM_TARGET_DEVICE", "cpu"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("VLLM_NO_USAGE_STATS", "1"),
    ):
        os.environ.setdefault(var, value)
    # Add mode's class: vLLM's own logger is a variant of its own here, never built by ours.
    os.environ.update(ADD_MODE)


class _Loggers:
    """The loggers under test, called as vLLM's StatLoggerManager calls its own."""

    def __init__(self, loggers: list[Any]) -> None:
        self.loggers = loggers

    def record(self, **stats: Any) -> None:
        for logger in self.loggers:
            logger.record(**stats)


def _handle(vllm_config: Any, spans: list[int]) -> Any:
    """The plugin's providers: no metric exporter (the in-process metrics are read at collect
    time, not on record), spans into a batch processor whose exporter counts them into
    ``spans[0]`` and drops them."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    import otel_llm
    from otel_llm.integrations.vllm.series.series import VllmSeries

    class Dropped(SpanExporter):
        def export(self, batch: Any) -> SpanExportResult:
            spans[0] += len(batch)
            return SpanExportResult.SUCCESS

    config = otel_llm.TelemetryConfig(
        model_name=vllm_config.model_config.served_model_name,
        max_model_len=vllm_config.model_config.max_model_len,
        metrics_exporters=("none",),
        traces_exporters=("none",),
    )
    return otel_llm.setup_telemetry(
        config,
        extra_span_processors=[BatchSpanProcessor(Dropped())],
        extra_views=VllmSeries(vllm_config, [0], config.naming).views(),
    )


def run(reps: int = 15, requests: int = 64, tokens: int = 96, log: Any = sys.stderr) -> dict[str, Any]:
    _vllm_environment()
    from vllm.config import ModelConfig
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from otel_llm.integrations import vllm as plugin
    from otel_llm.integrations.vllm import OtelStatLogger
    from otel_llm.testing.models import make_tiny_llama
    from otel_llm.testing.vllm.config import class_level_config
    from otel_llm.testing.vllm.stream import Spec, build
    from otel_llm.testing.vllm.stream import run as run_stream

    # A quarter of the requests are preempted once, a third of the way through.
    specs = [
        Spec(
            f"r{i}",
            arrive=i // 4,
            queue=i % 5,
            prompt=40 + i,
            tokens=tokens,
            max_tokens=tokens,
            preempt_after=(tokens // 3,) if i % 4 == 0 else (),
        )
        for i in range(requests)
    ]
    steps = build(specs, t0=0.0, w0=0.0).last_step + 1
    clock = [1000.0]

    with tempfile.TemporaryDirectory(prefix="bench-vllm-record-") as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny-llama")
        vllm_config = class_level_config(ModelConfig(model=str(model), skip_tokenizer_init=True))
        spans = [0]
        handle = _handle(vllm_config, spans)
        plugin.use_handle(handle)

        def variant(name: str) -> Callable[[], float]:
            def once() -> float:
                unregister_vllm_metrics()  # vLLM's logger registers its metrics globally
                loggers = []
                if "vllm" in name.split("+"):
                    loggers.append(PrometheusStatLogger(vllm_config, [0]))
                if "otel" in name.split("+"):
                    loggers.append(OtelStatLogger(vllm_config, [0]))
                clock[0] += 1000.0  # every run on its own stretch of the clocks
                script = build(specs, t0=clock[0], w0=1.7e9 + clock[0])
                start = time.perf_counter()
                run_stream(_Loggers(loggers), {0: script})
                return time.perf_counter() - start

            return once

        try:
            variants = {name: variant(name) for name in VARIANTS}
            interleave(variants, 1)  # warm-up, not counted
            print(f"[vllm_record] {reps} repetitions of {len(VARIANTS)} variants ...", file=log, flush=True)
            seconds = interleave(variants, reps)
        finally:
            plugin.reset()
            unregister_vllm_metrics()
            handle.shutdown()
        losses = dict(handle.accounting.dropped) if handle.accounting is not None else {}

    ms = {name: 1000 * median(values) for name, values in seconds.items()}
    output_tokens = requests * tokens

    def us_per_step(name: str) -> float:
        return 1000 * (ms[name] - ms["none"]) / steps

    otel_cost, vllm_cost = us_per_step("otel"), us_per_step("vllm")
    return {
        "method": "a scripted engine-core stream through vLLM's real OutputProcessor and IterationStats; each "
        "step's stats handed to the loggers under test; variants interleaved in one process (order rotated), "
        "medians over repetitions; a logger's cost is its variant's time less the no-logger variant's",
        "load": {"requests": requests, "output_tokens": output_tokens, "steps": steps, "reps": reps},
        "ms_per_stream": ms,
        "us_per_step": {"vllm_logger": vllm_cost, "otel_logger": otel_cost},
        "us_per_output_token": {
            "vllm_logger": vllm_cost * steps / output_tokens,
            "otel_logger": otel_cost * steps / output_tokens,
        },
        "otel_over_vllm_logger": ratio(otel_cost, vllm_cost),
        "frontend_with_plugin_over_without": ratio(ms["vllm+otel"], ms["vllm"]),
        "seconds_by_rep": seconds,
        "spans_exported": spans[0],
        "losses_counted": losses,
    }


def table_lines(r: dict[str, Any]) -> list[str]:
    if "us_per_step" not in r:
        return []
    step, token = r["us_per_step"], r["us_per_output_token"]
    return [
        f"7. vLLM's frontend stats path, scripted ({r['load']['steps']} steps, {r['load']['output_tokens']} tokens, "
        f"{r['load']['reps']} reps)",
        f"   per step        vLLM's Prometheus logger {step['vllm_logger']:.0f} us, ours {step['otel_logger']:.0f} us "
        f"({r['otel_over_vllm_logger']:.2f}x)",
        f"   per token       vLLM's {token['vllm_logger']:.2f} us, ours {token['otel_logger']:.2f} us; "
        f"frontend with / without the plugin {r['frontend_with_plugin_over_without']:.3f}",
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm.record", description=__doc__.splitlines()[2])
    p.add_argument("--reps", type=int, default=15, help="repetitions of every variant (default 15, at least 3)")
    p.add_argument("--requests", type=int, default=64, help="requests in the scripted stream (default 64)")
    p.add_argument("--tokens", type=int, default=96, help="output tokens per request (default 96)")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON to update (key vllm_record)")
    args = p.parse_args(argv)
    if args.reps < 3:
        p.error("--reps: at least 3")
    if args.requests < 1 or args.tokens < 3:
        p.error("--requests: at least 1; --tokens: at least 3")
    return write_section(KEY, args.out, lambda: run(args.reps, args.requests, args.tokens), table_lines)


if __name__ == "__main__":
    sys.exit(main())
