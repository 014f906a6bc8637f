"""The ``otel-llm`` command. ``otel-llm demo``: engine_stub under KV pressure, instrumented.

The demo runs a seeded workload on engine_stub with the plugin on, serves /metrics, exports
OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or a per-signal endpoint) is set, and prints what the
telemetry recorded: the per-request preemption histogram and the worst requests' trace ids.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from .config import TelemetryConfig
from .metrics import BY_KEY

BAR_WIDTH = 40
THRASHING = 5  # preemptions from which a request counts as thrashing


class RequestTraces(SpanProcessor):
    """Keeps each finished request span's trace id and preemption count, by request id."""

    def __init__(self) -> None:
        self.by_request: dict[str, tuple[int, str]] = {}

    def on_end(self, span: ReadableSpan) -> None:
        attributes = span.attributes or {}
        request_id = attributes.get("gen_ai.request.id")
        if span.name == "llm_request" and request_id is not None and span.context is not None:
            count = int(attributes.get("llm.request.num_preemptions", 0))  # type: ignore[arg-type]
            self.by_request[str(request_id)] = (count, format(span.context.trace_id, "032x"))


class Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second. With ``line_every``
    and a stream that is not a terminal, a full line every ``line_every`` seconds instead."""

    def __init__(self, total: int, stream: Any = sys.stderr, line_every: Optional[float] = None) -> None:
        self.total = total
        self.stream = stream
        self.redraw = line_every is None or stream.isatty()
        self.interval = 0.1 if self.redraw else float(line_every)  # type: ignore[arg-type]
        self._last = 0.0

    def __call__(self, engine: Any, finished: int) -> None:
        self.show(finished, engine.num_running, engine.num_waiting, engine.kv_cache.usage,
                  engine.scheduler.num_preemptions)

    def show(self, finished: int, running: int, waiting: int, kv_usage: float, preemptions: int) -> None:
        now = time.monotonic()
        if now - self._last < self.interval and finished < self.total:
            return
        self._last = now
        filled = BAR_WIDTH * finished // max(self.total, 1)
        line = (
            f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {finished}/{self.total} finished"
            f" | running {running:3d} waiting {waiting:3d}"
            f" | KV {kv_usage:4.0%} | preemptions {preemptions}"
        )
        self.stream.write(f"\r{line}" if self.redraw else f"{line}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.redraw:
            self.stream.write("\n")
            self.stream.flush()


def bucket_labels(bounds: Sequence[float]) -> list[str]:
    """Labels for integer observations: bucket i holds the integers in (bounds[i-1], bounds[i]]."""
    labels = []
    low = 0
    for bound in bounds:
        high = math.floor(bound)
        labels.append(str(low) if high <= low else f"{low}-{high}")
        low = high + 1
    labels.append(f"{low}+")
    return labels


def bar_chart(labels: Sequence[str], counts: Sequence[int]) -> list[str]:
    total = sum(counts) or 1
    peak = max(counts, default=0) or 1
    width = max(len(label) for label in labels)
    lines = []
    for label, count in zip(labels, counts):
        bar = "#" * math.ceil(BAR_WIDTH * count / peak)
        lines.append(f"  {label:>{width}} | {bar:<{BAR_WIDTH}} {count:5d} ({count / total:6.1%})")
    return lines


def write_plot(path: str, labels: Sequence[str], counts: Sequence[int], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars = ax.bar(labels, counts, color="#4c72b0")
    ax.bar_label(bars)
    ax.set_xlabel("preemptions per request")
    ax.set_ylabel("requests")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _histogram_point(reader: InMemoryMetricReader, name: str) -> Any:
    data = reader.get_metrics_data()
    points = [
        point
        for rm in (data.resource_metrics if data else ())
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == name
        for point in metric.data.data_points
    ]
    if len(points) != 1:
        raise RuntimeError(f"expected one {name} series, found {len(points)}")
    return points[0]


def _otlp_configured() -> bool:
    return any(
        os.environ.get(var)
        for var in (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        )
    )


def demo(args: argparse.Namespace) -> int:
    # engine_stub needs torch; imported here so that the rest of the CLI does not.
    from engine_stub import Engine, EngineConfig
    from engine_stub.workload import WorkloadSpec, generate, run_workload

    from .integrations.engine_stub import MODEL_NAME, register

    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("otel-llm demo: --plot needs matplotlib: pip install 'otel-llm[plot]'", file=sys.stderr)
            return 2

    otlp = ("otlp",) if _otlp_configured() else ()
    config = TelemetryConfig.from_env(
        model_name=os.environ.get("OTEL_LLM_MODEL_NAME") or MODEL_NAME,
        metrics_exporters=("prometheus", *otlp),
        traces_exporters=otlp or ("none",),
        prometheus_host=args.prometheus_host,
        prometheus_port=args.prometheus_port,
    )
    engine_config = EngineConfig(
        num_kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        load_plugins=False,  # registered below with our readers; the entry point would add a second
    )
    engine = Engine(engine_config)
    reader = InMemoryMetricReader()
    traces = RequestTraces()
    try:
        handle = register(engine, config, extra_metric_readers=[reader], extra_span_processors=[traces])
    except OSError as exc:
        print(
            f"otel-llm demo: cannot serve /metrics on {args.prometheus_host}:{args.prometheus_port} ({exc});"
            " choose another --prometheus-port",
            file=sys.stderr,
        )
        return 2

    try:
        spec = WorkloadSpec(num_requests=args.requests, rate=args.rate, seed=args.seed)
        requests = generate(spec, engine_config.num_kv_blocks * engine_config.block_size)
        progress = None if args.no_progress else Progress(len(requests))
        result = run_workload(engine, requests, on_step=progress)
        if progress is not None:
            progress.close()
        handle.force_flush()
        print_summary(args, config, engine, result, reader, traces)
        if args.serve_seconds > 0:
            url = f"http://{args.prometheus_host}:{handle.prometheus_port}/metrics"
            print(f"serving {url} for {args.serve_seconds:g} s (Ctrl-C to stop)", flush=True)
            try:
                threading.Event().wait(args.serve_seconds)
            except KeyboardInterrupt:
                pass  # the ordinary way to stop serving
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        handle.shutdown()
    return 0


@dataclass
class PreemptionHistogram:
    """``request_num_preemptions`` as the summary shows it: per-bucket (not cumulative) counts."""

    bounds: list[float]
    counts: list[int]
    count: int
    sum: float

    @classmethod
    def from_point(cls, point: Any) -> "PreemptionHistogram":
        return cls(list(point.explicit_bounds), list(point.bucket_counts), point.count, point.sum)

    @classmethod
    def from_scrape(cls, samples: Mapping[tuple[str, frozenset], float], name: str) -> "PreemptionHistogram":
        """From a scrape of one series (``{(sample name, labels): value}``); its buckets are cumulative."""
        cumulative = sorted(
            (float(dict(labels)["le"]), value) for (sample, labels), value in samples.items() if sample == f"{name}_bucket"
        )
        [count] = [v for (sample, _), v in samples.items() if sample == f"{name}_count"]
        [total] = [v for (sample, _), v in samples.items() if sample == f"{name}_sum"]
        counts = [int(c - below) for (_, c), below in zip(cumulative, [0.0] + [c for _, c in cumulative])]
        return cls([le for le, _ in cumulative if math.isfinite(le)], counts, int(count), total)


def print_fields(rows: Sequence[tuple[str, object]]) -> None:
    for key, value in rows:
        print(f"{key:<15}{value}")


def print_chart(histogram_name: str, histogram: PreemptionHistogram) -> list[str]:
    """Prints the bar chart of requests per preemption count; returns its labels."""
    labels = bucket_labels(histogram.bounds)
    print(f"requests per preemption count ({histogram_name})")
    for line in bar_chart(labels, histogram.counts):
        print(line)
    return labels


def print_worst(by_request: Mapping[str, tuple[int, str]], top: int) -> None:
    """The ``top`` requests with the most preemptions: ``by_request`` maps id to (count, trace id)."""
    worst = sorted(by_request.items(), key=lambda kv: (-kv[1][0], kv[0]))[:top]
    print("worst requests")
    for request_id, (count, trace_id) in worst:
        print(f"  {request_id}  {count:3d} preemptions  trace_id {trace_id}")


def print_summary(
    args: argparse.Namespace,
    config: TelemetryConfig,
    engine: Any,
    result: Any,
    reader: InMemoryMetricReader,
    traces: RequestTraces,
) -> None:
    histogram_name = BY_KEY["request_num_preemptions"].name(config.naming)
    histogram = PreemptionHistogram.from_point(_histogram_point(reader, histogram_name))
    ground_truth = [o.num_preemptions for o in result.outputs]
    agrees = sorted(ground_truth) == sorted(c for c, _ in traces.by_request.values()) and histogram.sum == sum(
        ground_truth
    )
    c = engine.config
    print(
        f"otel-llm demo: engine_stub, {c.num_kv_blocks} KV blocks x {c.block_size} tokens, "
        f"max {c.max_num_seqs} seqs, {c.max_num_batched_tokens} tokens/step, seed {c.seed}"
    )
    print_fields([
        ("requests", histogram.count),
        ("output tokens", result.num_output_tokens),
        ("wall time", f"{result.elapsed:.1f} s"),
        ("tokens/s", f"{result.tokens_per_second:.0f}"),
        ("preemptions", int(histogram.sum)),
        ("thrashing", f"{sum(n >= THRASHING for n in ground_truth)} requests with {THRASHING}+ preemptions"),
        ("ground truth", "telemetry equals the engine" if agrees else "MISMATCH with the engine"),
    ])
    print()
    labels = print_chart(histogram_name, histogram)
    print()
    print_worst(traces.by_request, args.top)
    if args.plot:
        write_plot(args.plot, labels, histogram.counts, f"{histogram_name} ({histogram.count} requests)")
        print(f"\nchart written to {args.plot}")
    print(flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="otel-llm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="run engine_stub under KV pressure with the plugin on",
        description="Run engine_stub on a seeded workload sized so that KV-cache pressure causes "
        "preemptions and a few requests thrash; serve /metrics; print the per-request "
        "preemption histogram and the worst requests' trace ids. OTLP export follows "
        "OTEL_EXPORTER_OTLP_ENDPOINT when set.",
    )
    d.add_argument("--requests", type=int, default=500, help="number of requests (default 500)")
    d.add_argument("--rate", type=float, default=50.0, help="arrivals per simulated second (default 50)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--kv-blocks", type=int, default=64, help="KV cache blocks (default 64)")
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--max-num-seqs", type=int, default=32)
    d.add_argument("--max-num-batched-tokens", type=int, default=256)
    d.add_argument("--prometheus-host", default="127.0.0.1")
    d.add_argument("--prometheus-port", type=int, default=9464, help="0 picks a free port")
    d.add_argument("--serve-seconds", type=float, default=0.0, help="keep /metrics up this long after the run")
    d.add_argument("--plot", metavar="FILE.png", help="also write the chart as a picture (needs matplotlib)")
    d.add_argument("--top", type=int, default=5, help="worst requests to list (default 5)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    d.set_defaults(func=demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
