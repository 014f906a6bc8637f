"""Section 4: cost of getting the numbers out, at 1, 8 and 64 engines on one set of providers.

For each engine count: ``setup_telemetry(prometheus_port=0)`` plus an InMemoryMetricReader,
``handle.new_telemetry(engine=str(i))`` for the other engines, each fed the same small
workload (arrivals, preemptions, tokens, finishes with two reasons). Then:

* scrape: HTTP GET of /metrics from the endpoint (classic text, and OpenMetrics), ms per scrape
  (median) and bytes; the scrape runs in this process and holds its GIL meanwhile; and the
  rendering alone (``PrometheusEndpoint.render``, no HTTP) next to (b): prometheus_client's
  ``generate_latest`` of the same metrics of the same engines written the vLLM way;
* collect: ``InMemoryMetricReader.get_metrics_data()`` (what any reader pays first), ms;
* OTLP: ``OTLPMetricExporter.export()`` of that MetricsData over gRPC to a local receiver
  (rotel-agent), ms, and the serialized protobuf size (``encode_metrics``), and encode time.

And at 1, 8 and 64 engine *processes* (each its own MeterProvider and resource, with its own
``service.instance.id``, as each process of a fleet has; simulated in this process, which 2 cores
cannot run 64 of): each process's collect + OTLP export, ms (median over processes), and what a
collector then holds: OTLP data points and Prometheus series (a histogram point is its buckets,
``_sum`` and ``_count``), in total and per process.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

from otel_llm.config.settings import TelemetryConfig
from otel_llm.export.setup import setup_telemetry

from .common import median, otlp_receiver
from .workload import event_mix


def _get(url: str, accept: str) -> bytes:
    req = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read()


def _timed(fn: Any, reps: int) -> tuple[float, Any]:
    times, value = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        value = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return median(times), value


def one(engines: int, mix: Any, endpoint: str, reps: int) -> dict[str, Any]:
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    config = TelemetryConfig(
        model_name="bench",
        spans=False,
        prometheus_port=0,
        metrics_exporters=("prometheus",),
        traces_exporters=("none",),
    )
    handle = setup_telemetry(config, extra_metric_readers=[reader])
    try:
        telemetries = [handle.telemetry] + [handle.new_telemetry(engine=str(i)) for i in range(1, engines)]
        for telemetry in telemetries:
            for events, stats in mix.warmup + mix.steps:
                telemetry.on_events(events)
                telemetry.on_step(stats)
        url = handle.prometheus.url
        if not url.endswith("/metrics"):
            url = url.rstrip("/") + "/metrics"
        _get(url, "text/plain")  # warm-up
        text_ms, text_body = _timed(lambda: _get(url, "text/plain"), reps)
        om_ms, om_body = _timed(lambda: _get(url, "application/openmetrics-text; version=1.0.0"), reps)
        render_ms, _ = _timed(lambda: handle.prometheus.render("text/plain"), reps)
        base = _prometheus_client_baseline(engines, mix, reps)
        collect_ms, data = _timed(reader.get_metrics_data, reps)
        encode_ms, encoded = _timed(lambda: encode_metrics(data).SerializeToString(), reps)
        exporter = OTLPMetricExporter(endpoint=endpoint, insecure=True)
        exporter.export(data)  # warm-up: channel set-up
        export_ms, result = _timed(lambda: exporter.export(data), reps)
        exporter.shutdown()
        series = sum(1 for line in text_body.splitlines() if line and not line.startswith(b"#"))
        points = sum(
            len(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        )
        return {
            "engines": engines,
            "prometheus_samples": series,
            "otlp_data_points": points,
            "scrape_text_ms": text_ms,
            "scrape_text_bytes": len(text_body),
            "scrape_openmetrics_ms": om_ms,
            "scrape_openmetrics_bytes": len(om_body),
            "render_text_ms": render_ms,
            "prometheus_client_render_text_ms": base["render_text_ms"],
            "prometheus_client_text_bytes": base["text_bytes"],
            "prometheus_client_samples": base["samples"],
            "render_ratio_ours/prometheus_client": render_ms / base["render_text_ms"]
            if base["render_text_ms"]
            else None,
            "collect_ms": collect_ms,
            "otlp_encode_ms": encode_ms,
            "otlp_bytes": len(encoded),
            "otlp_export_ms": export_ms,
            "otlp_export_result": getattr(result, "name", str(result)),
        }
    finally:
        handle.shutdown()


def processes(count: int, mix: Any, endpoint: str) -> dict[str, Any]:
    """``count`` engine processes, one MeterProvider and resource each, exporting to one collector."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource

    from otel_llm import EngineTelemetry, views

    config = TelemetryConfig(model_name="bench", spans=False)
    exporter = OTLPMetricExporter(endpoint=endpoint, insecure=True)
    export_ms, points, series = [], 0, 0
    try:
        for i in range(count):
            reader = InMemoryMetricReader()
            provider = MeterProvider(
                metric_readers=[reader],
                views=views(config),
                resource=Resource({"service.name": "bench", "service.instance.id": f"p{i}"}),
            )
            telemetry = EngineTelemetry(config, meter_provider=provider)
            for events, stats in mix.warmup + mix.steps:
                telemetry.on_events(events)
                telemetry.on_step(stats)
            t0 = time.perf_counter()
            data = reader.get_metrics_data()
            assert data is not None
            exporter.export(data)
            export_ms.append((time.perf_counter() - t0) * 1e3)
            for p in (
                p
                for rm in data.resource_metrics
                for sm in rm.scope_metrics
                for m in sm.metrics
                for p in m.data.data_points
            ):
                points += 1
                series += len(p.bucket_counts) + 2 if isinstance(p, HistogramDataPoint) else 1
            provider.shutdown()
    finally:
        exporter.shutdown()
    return {
        "processes": count,
        "collect_and_export_ms_per_process": median(export_ms),
        "collector_data_points": points,
        "collector_prometheus_series": series,
        "prometheus_series_per_process": series / count,
    }


def _prometheus_client_baseline(engines: int, mix: Any, reps: int) -> dict[str, Any]:
    """(b) for scrapes: the vLLM-style prometheus_client metrics of ``engines`` engines in one
    registry (one family per metric, an ``engine`` label), fed the same workload, rendered in text."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from .subscribers import PrometheusClientSubscriber

    registry = CollectorRegistry(auto_describe=False)
    first = PrometheusClientSubscriber(TelemetryConfig(model_name="bench", engine="0"), registry=registry)
    subs = [first] + [
        PrometheusClientSubscriber(
            TelemetryConfig(model_name="bench", engine=str(i)), registry=registry, families=first._families
        )
        for i in range(1, engines)
    ]
    for sub in subs:
        for events, stats in mix.warmup + mix.steps:
            sub.on_events(events)
            sub.on_step(stats)
    generate_latest(registry)
    ms, body = _timed(lambda: generate_latest(registry), reps)
    samples = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return {"render_text_ms": ms, "text_bytes": len(body), "samples": samples}


def run(tiny: bool, reps: int) -> dict[str, Any]:
    mix = event_mix(num_steps=10 if tiny else 60, running=32, seed=1, output_median=40, preempt_every=5)
    counts = (1, 8, 64)  # every size in --tiny too, with a smaller workload
    with otlp_receiver() as receiver:
        rows = [one(n, mix, receiver["grpc"], reps) for n in counts]
        fleet = [processes(n, mix, receiver["grpc"]) for n in counts]
    return {
        "receiver": receiver["kind"],
        "events_per_engine": mix.num_events + sum(len(e) for e, _ in mix.warmup),
        "repetitions": reps,
        "by_engines": {str(r["engines"]): r for r in rows},
        "by_processes": {str(r["processes"]): r for r in fleet},
    }
