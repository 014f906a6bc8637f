"""``otel-llm demo``: engine_stub on a seeded workload under KV pressure, with the plugin on."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from typing import Any, Optional

from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from otel_llm.catalogue.metrics import BY_KEY
from otel_llm.cli.render import (
    THRASHING,
    Progress,
    print_chart,
    print_fields,
    print_worst,
    print_worst_evictors,
    write_plot,
)
from otel_llm.cli.tenants_report import print_tenant_view, summed_histogram
from otel_llm.config.settings import TelemetryConfig
from otel_llm.export.setup import without_prometheus
from otel_llm.stack.drilldown import Stack, drill_down, print_drilldown, telemetry_settings

HISTOGRAMS = ("request_num_preemptions", "request_num_preemptions_caused")  # drilled down into on --stack
TORCH_MISSING = "pip install 'otel-llm[engine]' (torch==2.13.0 first for the CPU build), or run `make demo`"


class RequestTraces(SpanProcessor):
    """From each finished request span, by request id: its preemption count and trace id
    (``by_request``), the preemptions it caused and its trace id (``caused``), and whom it evicted
    (``victims``: victim id to times, from the victims' ``preempted`` events, which name their
    causes); and the requests that ran to their end (finish reason ``stop`` or ``length``)."""

    def __init__(self) -> None:
        self.by_request: dict[str, tuple[int, str]] = {}
        self.caused: dict[str, tuple[int, str]] = {}
        self.victims: dict[str, Counter[str]] = defaultdict(Counter)
        self.completed = 0

    def on_end(self, span: ReadableSpan) -> None:
        attributes = span.attributes or {}
        request_id = attributes.get("gen_ai.request.id")
        if span.name == "llm_request" and request_id is not None and span.context is not None:
            trace_id = format(span.context.trace_id, "032x")
            # Attribute values: the ints and tuples the telemetry set.
            count = int(attributes.get("llm.request.num_preemptions", 0))  # type: ignore[arg-type]
            caused = int(attributes.get("llm.request.num_preemptions_caused", 0))  # type: ignore[arg-type]
            self.by_request[str(request_id)] = (count, trace_id)
            self.caused[str(request_id)] = (caused, trace_id)
            for event in span.events:
                if event.name == "preempted":
                    for cause in (event.attributes or {}).get("cause_request_ids", ()):  # type: ignore[union-attr]
                        self.victims[str(cause)][str(request_id)] += 1
            if set(attributes.get("gen_ai.response.finish_reasons", ())) <= {"stop", "length"}:  # type: ignore[arg-type]
                self.completed += "llm.request.incomplete" not in attributes


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


def where_traces_are() -> str:
    """Where the trace ids the summary lists can be looked up (``--stack`` shows them itself)."""
    if _otlp_configured():
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return f"the trace ids above: the request spans went over OTLP to {endpoint or 'the default endpoint'}"
    return (
        "the trace ids above: this run exported no spans; `make demo-stack` shows them in a local Phoenix "
        "(and each bucket in Prometheus), or OTEL_EXPORTER_OTLP_ENDPOINT=<your collector> sends them there"
    )


def demo(args: argparse.Namespace, stack: Optional[Stack] = None) -> int:
    """The demo; with ``stack`` (``--stack``), its telemetry goes to that Prometheus and Phoenix,
    and the drill-down from them follows the summary."""
    # engine_stub needs torch; imported here so that the rest of the CLI does not.
    try:
        from engine_stub import Engine, EngineConfig
        from engine_stub.stopping import EXIT_STATUS, Stopped, say_stopped, stop_on_sigterm
        from engine_stub.workload import WorkloadSpec, generate, run_workload
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        print(
            f"otel-llm demo: engine_stub needs torch, not installed in this environment ({sys.executable}); "
            + TORCH_MISSING,
            file=sys.stderr,
        )
        return 2
    from otel_llm.integrations.engine_stub import MODEL_NAME, register

    if args.plot:
        try:
            import matplotlib  # noqa: F401 - only whether it is installed
        except ImportError:
            print("otel-llm demo: --plot needs matplotlib: pip install 'otel-llm[plot]'", file=sys.stderr)
            return 2

    otlp = ("otlp",) if _otlp_configured() else ()
    exporters = (
        telemetry_settings(stack)
        if stack is not None
        else {
            "metrics_exporters": ("prometheus", *otlp),
            "traces_exporters": otlp or ("none",),
            "prometheus_host": args.prometheus_host,
            "prometheus_port": args.prometheus_port,
        }
    )
    tenants = {"tenant": "priority"} if args.tenants else {}  # OTEL_LLM_TENANT may name another source
    config = TelemetryConfig.from_env(defaults={"model_name": MODEL_NAME, **tenants}, **exporters)
    engine_config = EngineConfig(
        num_kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        load_plugins=False,  # registered below with our readers; the entry point would add a second
        scheduling_policy="priority" if args.tenants else "fcfs",
    )
    engine = Engine(engine_config)
    reader = InMemoryMetricReader()
    traces = RequestTraces()
    readers = {"extra_metric_readers": [reader], "extra_span_processors": [traces]}
    try:
        handle = register(engine, config, port_taken="raise", **readers)
    except OSError as exc:
        where, why = f"{args.prometheus_host}:{args.prometheus_port}", os.strerror(exc.errno) if exc.errno else exc
        if stack is not None:  # the stack's Prometheus scrapes that port: nothing to show without it
            print(f"otel-llm demo: cannot serve /metrics on {where} ({why})", file=sys.stderr)
            return 2
        print(
            f"otel-llm demo: port {where} is taken ({why}): this run serves no /metrics; "
            "--prometheus-port 0 picks a free port",
            file=sys.stderr,
        )
        config = without_prometheus(config)
        handle = register(engine, config, **readers)

    progress: Optional[Progress] = None
    with stop_on_sigterm() as stop:
        try:
            spec = WorkloadSpec(num_requests=args.requests, rate=args.rate, seed=args.seed, num_tenants=args.tenants)
            requests = generate(spec, engine_config.num_kv_blocks * engine_config.block_size)
            progress = None if args.no_progress else Progress(len(requests))
            started = time.time()
            with stop.between_steps():
                result = run_workload(engine, requests, on_step=progress, between_steps=stop.check)
            if progress is not None:
                progress.close()
            handle.force_flush()
            print_summary(args, config, engine, result, reader, traces)
            if args.tenants:
                print_tenant_view(handle.config, requests, result.outputs, reader)
            if stack is None:
                print(where_traces_are(), end="\n\n", flush=True)
            else:
                suffered, caused = (BY_KEY[key].name(config.naming) for key in HISTOGRAMS)
                sections = [
                    (title, unit, drill_down(stack, histogram, requests, args.top, started))
                    for title, unit, histogram, requests in (
                        ("worst requests", "preemptions", suffered, traces.by_request),
                        ("worst evictors", "caused", caused, traces.caused),
                    )
                ]
                print_drilldown(sections, len(requests))
                print(flush=True)
            if args.serve_seconds > 0 and handle.prometheus is not None:
                url = f"http://{args.prometheus_host}:{handle.prometheus_port}/metrics"
                if stack is not None:
                    print(
                        f"Prometheus {stack.prometheus.url} and Phoenix {stack.phoenix.url} stay up as long as "
                        "/metrics is served, and stop with it."
                    )
                print(f"serving {url} for {args.serve_seconds:g} s (Ctrl-C to stop)", flush=True)
                try:
                    threading.Event().wait(args.serve_seconds)
                except KeyboardInterrupt:
                    pass  # the ordinary way to stop serving
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
        except Stopped:
            if progress is not None:
                progress.close()
            say_stopped("otel-llm demo", engine.num_running + engine.num_waiting)
            return EXIT_STATUS
        finally:
            handle.shutdown()  # in-flight spans end marked incomplete; everything is flushed
    return 0


def print_summary(
    args: argparse.Namespace,
    config: TelemetryConfig,
    engine: Any,
    result: Any,
    reader: InMemoryMetricReader,
    traces: RequestTraces,
) -> None:
    histogram_name = BY_KEY["request_num_preemptions"].name(config.naming)
    histogram = summed_histogram(reader.get_metrics_data(), histogram_name)
    ground_truth = [o.num_preemptions for o in result.outputs]
    # The engine records who evicted whom at its preemption point: the telemetry must say the same.
    evicted: dict[str, Counter[str]] = defaultdict(Counter)
    for o in result.outputs:
        for cause in o.preempted_by:
            evicted[cause][o.request_id] += 1
    agrees = (
        {o.request_id: o.num_preemptions for o in result.outputs} == {r: c for r, (c, _) in traces.by_request.items()}
        and histogram.sum == sum(ground_truth)
        and {o.request_id: o.num_preemptions_caused for o in result.outputs}
        == {r: c for r, (c, _) in traces.caused.items()}
        and dict(evicted) == {r: v for r, v in traces.victims.items() if v}
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
    print()
    print_worst_evictors(traces.caused, traces.victims, args.top)
    if args.plot:
        write_plot(args.plot, labels, histogram.counts, f"{histogram_name} ({histogram.count} requests)")
        print(f"\nchart written to {args.plot}")
    print(flush=True)
