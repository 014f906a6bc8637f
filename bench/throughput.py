"""Section 2: engine_stub tokens/s at a load with preemptions, telemetry off vs on.

Variants, interleaved, each on a fresh engine with the same seed (identical schedules, so
identical token counts and preemptions):

* ``off`` -- no subscriber (the engine does not even build events);
* ``metrics`` -- setup_telemetry(spans=False), metrics exported over OTLP gRPC to a local
  receiver by a PeriodicExportingMetricReader;
* ``full`` -- setup_telemetry(): metrics as above, plus one span per request through a
  BatchSpanProcessor and the OTLP gRPC span exporter to the same receiver.

The export interval is short (``OTEL_METRIC_EXPORT_INTERVAL``, 1 s here) so that collection and
export happen during the run: the default (60 s) would never fire within it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from engine_stub import Engine, EngineConfig
from engine_stub.workload import WorkloadSpec, generate, run_workload
from otel_llm.config import TelemetryConfig
from otel_llm.providers import setup_telemetry

from .common import env, interleave, median, otlp_receiver, ratio

ENGINE = dict(num_kv_blocks=64, block_size=16, max_num_seqs=32, max_num_batched_tokens=256, seed=0,
              load_plugins=False)


def _variant(kind: str, requests: list, endpoint: str, interval_ms: int, results: dict) -> Callable[[], float]:
    def run() -> float:
        engine = Engine(EngineConfig(**ENGINE))
        handle = None
        if kind != "off":
            config = TelemetryConfig(model_name="bench", spans=(kind == "full"),
                                     metrics_exporters=("otlp",),
                                     traces_exporters=("otlp",) if kind == "full" else ("none",),
                                     metric_export_interval_ms=interval_ms)
            with env(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="grpc"):
                handle = setup_telemetry(config)
            engine.hooks.subscribe(handle.telemetry)
        result = run_workload(engine, requests, step_time=0.01, temperature=1.0)
        if handle is not None:
            t0 = time.perf_counter()
            handle.shutdown()  # flush: not part of the timed run, reported apart
            results.setdefault(f"{kind}_shutdown_s", []).append(time.perf_counter() - t0)
        results.setdefault(f"{kind}_tokens", set()).add(result.num_output_tokens)
        results.setdefault(f"{kind}_preemptions", set()).add(result.total_preemptions)
        results.setdefault(f"{kind}_steps", set()).add(result.steps)
        return result.tokens_per_second
    return run


def run(tiny: bool, reps: int) -> dict[str, Any]:
    num_requests = 30 if tiny else 160
    config = EngineConfig(**ENGINE)
    requests = generate(WorkloadSpec(num_requests=num_requests, rate=50.0, seed=0),
                        config.num_kv_blocks * config.block_size)
    extra: dict[str, Any] = {}
    interval_ms = 1000
    with otlp_receiver() as receiver:
        variants = {kind: _variant(kind, requests, receiver["grpc"], interval_ms, extra)
                    for kind in ("off", "metrics", "full")}
        variants["off"]()  # warm-up (torch, imports)
        measured = interleave(variants, reps)
    tps = {k: median(v) for k, v in measured.items()}
    paired = {k: median([a / b for a, b in zip(measured[k], measured["off"])]) for k in ("metrics", "full")}
    out = {
        "receiver": receiver["kind"],
        "engine": ENGINE,
        "requests": num_requests,
        "output_tokens": sorted(extra["off_tokens"]),
        "preemptions": sorted(extra["off_preemptions"]),
        "steps": sorted(extra["off_steps"]),
        "metric_export_interval_ms": interval_ms,
        "repetitions": reps,
        "tokens_per_s": tps,
        "tokens_per_s_all": measured,
        "ratios": {"metrics/off": ratio(tps["metrics"], tps["off"]), "full/off": ratio(tps["full"], tps["off"])},
        "ratios_paired_median": {"metrics/off": paired["metrics"], "full/off": paired["full"]},
        "shutdown_flush_s": {k: median(extra.get(f"{k}_shutdown_s", [])) for k in ("metrics", "full")},
        "same_schedule": all(len(extra[f"{k}_tokens"]) == 1 and extra[f"{k}_tokens"] == extra["off_tokens"]
                             and extra[f"{k}_preemptions"] == extra["off_preemptions"]
                             for k in ("metrics", "full")),
    }
    out["targets"] = {"full/off >= 0.98": out["ratios"]["full/off"] >= 0.98}
    return out
