"""Section 5: what a collector outage costs the engine.

engine_stub (section 2's engine and workload) with full telemetry (metrics + spans over OTLP gRPC),
side by side in lockstep as in section 2, one engine per variant:

* ``off`` -- no subscriber;
* ``healthy`` -- setup_telemetry() exporting to a local receiver (rotel-agent);
* ``outage`` -- the same, exporting to a port nothing listens on (a collector that is down):
  every export fails, ``resilience.Backoff`` turns the exports of the next 1-10 s into failures
  at once (counted, nothing encoded), with a probe in between;
* ``outage_no_backoff`` -- the outage with the backoff off: every batch is encoded and tried,
  and the SDK retries it until the export timeout.

For each: tokens/s over the summed step time, and what the telemetry takes from the engine,
on CPU clocks (another process's load does not move them): its time inside the engine's hook
calls, and the CPU of its own threads (span processor, metric reader; they hold the GIL the
engine needs), per CPU second of the engine's thread. tests/reliability/test_reliability_outage.py asserts
the same share with a margin that a noisy machine cannot cross; this is the precise figure.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from engine_stub import Engine, EngineConfig
from engine_stub.workload import WorkloadSpec, generate
from otel_llm.config.settings import TelemetryConfig
from otel_llm.export.setup import setup_telemetry
from otel_llm.testing.cost import TimedHooks, started_threads, threads_cpu_s

from .common import env, free_port, median, otlp_receiver
from .throughput import ENGINE, _Runner

KINDS = ("off", "healthy", "outage", "outage_no_backoff")
EXPORT = dict(
    OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
    OTEL_METRIC_EXPORT_INTERVAL="500",
    OTEL_EXPORTER_OTLP_TIMEOUT="2",
    OTEL_BSP_SCHEDULE_DELAY="200",
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE="64",
)


def _no_backoff(handle: Any) -> None:
    """Every export of this handle's span exporter is tried (resilience.Backoff never closes)."""
    processor = handle.tracer_provider._active_span_processor._span_processors[0]  # SDK internals
    # The counting exporter: in the processor's BatchProcessor (SDK 1.34+), the processor's own before.
    exporter = (
        processor._batch_processor._exporter if hasattr(processor, "_batch_processor") else processor.span_exporter
    )
    exporter._backoff.closed = lambda: False


def _lockstep(requests: list, endpoints: dict[str, str]) -> dict[str, dict[str, float]]:
    """One repetition: every variant's engine stepped in turn, order rotated every step."""
    runners, handles, hooks, threads, cpu_ns = {}, {}, {}, {}, {}
    for kind in KINDS:
        engine = Engine(EngineConfig(**ENGINE))
        if kind != "off":
            config = TelemetryConfig(
                model_name="bench", engine=kind, metrics_exporters=("otlp",), traces_exporters=("otlp",)
            )
            with env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoints[kind], **EXPORT):
                handles[kind], threads[kind] = started_threads(functools.partial(setup_telemetry, config))
            if kind == "outage_no_backoff":
                _no_backoff(handles[kind])
            hooks[kind] = TimedHooks(handles[kind].telemetry)
            engine.hooks.subscribe(hooks[kind])
        runners[kind] = _Runner(engine, requests)
        cpu_ns[kind] = 0
    threads_start = {kind: threads_cpu_s(t) for kind, t in threads.items()}
    i = 0
    while not all(r.done for r in runners.values()):
        k = i % len(KINDS)
        for kind in KINDS[k:] + KINDS[:k]:
            if not runners[kind].done:
                c0 = time.thread_time_ns()
                runners[kind].iteration()
                cpu_ns[kind] += time.thread_time_ns() - c0
        i += 1
    threads_s = {kind: threads_cpu_s(t) - threads_start[kind] for kind, t in threads.items()}
    out = {}
    for kind, r in runners.items():
        engine_s = cpu_ns[kind] / 1e9
        row = {
            "tokens_per_s": sum(len(o.token_ids) for o in r.outputs) / (r.ns / 1e9),
            "steps": r.steps,
            "engine_cpu_ms_per_step": engine_s * 1e3 / r.steps,
        }
        if kind in handles:
            hooks_s = hooks[kind].cpu_ns / 1e9
            row.update(
                hooks_cpu_us_per_step=hooks_s * 1e6 / r.steps,
                threads_cpu_us_per_step=threads_s[kind] * 1e6 / r.steps,
                telemetry_share=(hooks_s + threads_s[kind]) / engine_s,
            )
        out[kind] = row
    for kind, handle in handles.items():
        t0 = time.perf_counter()
        handle.shutdown()
        out[kind]["shutdown_s"] = time.perf_counter() - t0
        accounting = handle.accounting
        assert accounting is not None  # setup_telemetry with exporters counts
        out[kind]["spans_delivered"] = accounting.exported.get("spans", 0)
        out[kind]["spans_dropped"] = sum(n for reason, n in accounting.dropped.items() if reason.startswith("spans_"))
    return out


def run(tiny: bool, reps: int) -> dict[str, Any]:
    num_requests = 15 if tiny else 160
    config = EngineConfig(**ENGINE)
    requests = generate(
        WorkloadSpec(num_requests=num_requests, rate=50.0, seed=0), config.num_kv_blocks * config.block_size
    )
    with otlp_receiver() as receiver:
        down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        endpoints = {"healthy": receiver["grpc"], "outage": down, "outage_no_backoff": down}
        if not tiny:
            _lockstep(requests[: num_requests // 10], endpoints)  # warm-up
        runs = [_lockstep(requests, endpoints) for _ in range(reps)]
    telemetry = KINDS[1:]
    share = {k: median([r[k]["telemetry_share"] for r in runs]) for k in telemetry}
    out = {
        "method": "lockstep as in section 2 (same engine, workload and seed per variant); the telemetry's share: "
        "(its CPU inside the hooks + its own threads' CPU) / the engine thread's CPU, CPU clocks",
        "receiver": receiver["kind"],
        "requests": num_requests,
        "repetitions": reps,
        "tokens_per_s": {k: median([r[k]["tokens_per_s"] for r in runs]) for k in KINDS},
        "ratios_paired_median": {
            f"{k}/off": median([r[k]["tokens_per_s"] / r["off"]["tokens_per_s"] for r in runs]) for k in telemetry
        }
        | {
            f"{k}/healthy": median([r[k]["tokens_per_s"] / r["healthy"]["tokens_per_s"] for r in runs])
            for k in telemetry[1:]
        },
        "telemetry_share": share,
        "telemetry_share_all": {k: [r[k]["telemetry_share"] for r in runs] for k in telemetry},
        "extra_share_vs_healthy": {k: share[k] - share["healthy"] for k in telemetry[1:]},
        "hooks_cpu_us_per_step": {k: median([r[k]["hooks_cpu_us_per_step"] for r in runs]) for k in telemetry},
        "threads_cpu_us_per_step": {k: median([r[k]["threads_cpu_us_per_step"] for r in runs]) for k in telemetry},
        "engine_cpu_ms_per_step": {k: median([r[k]["engine_cpu_ms_per_step"] for r in runs]) for k in KINDS},
        "shutdown_s": {k: median([r[k]["shutdown_s"] for r in runs]) for k in telemetry},
        # after shutdown (which flushes): every span delivered, or every span dropped and counted
        "spans_delivered": {k: runs[-1][k]["spans_delivered"] for k in telemetry},
        "spans_dropped": {k: runs[-1][k]["spans_dropped"] for k in telemetry},
    }
    # The test's criterion (tests/reliability/test_reliability_outage.py), here without its margin.
    out["targets"] = {"outage extra share <= 0.02": out["extra_share_vs_healthy"]["outage"] <= 0.02}
    return out
