"""Section 2: engine_stub tokens/s at a load with preemptions, telemetry off vs on.

Variants, each on a fresh engine with the same seed (identical schedules, so identical token
counts and preemptions), run in lockstep (one step of each in turn, the order rotated every
step, each step timed): a whole-run interleaving (ABAB of 2-3 s runs) swings by +-30 % on
these shared machines, a step-level one does not.

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
from engine_stub.workload import WorkloadSpec, generate
from otel_llm.config.settings import DEFAULT_DEFER_STEPS, TelemetryConfig
from otel_llm.export.setup import setup_telemetry
from otel_llm.testing.cost import TimedHooks

from .common import env, median, otlp_receiver, ratio

ENGINE: dict[str, Any] = dict(
    num_kv_blocks=64, block_size=16, max_num_seqs=32, max_num_batched_tokens=256, seed=0, load_plugins=False
)


class _Runner:
    """``engine_stub.workload.run_workload``'s loop, one iteration at a time."""

    def __init__(self, engine: Engine, requests: list, step_time: float = 0.01) -> None:
        self.engine, self.pending, self.step_time = engine, sorted(requests, key=lambda r: r.arrival_time), step_time
        self.next = 0
        self.clock = 0.0
        self.steps = 0
        self.outputs: list = []
        self.ns = 0

    @property
    def done(self) -> bool:
        return self.next >= len(self.pending) and not self.engine.has_unfinished_requests()

    def iteration(self) -> None:
        t0 = time.perf_counter_ns()
        engine, pending = self.engine, self.pending
        if not engine.has_unfinished_requests():
            self.clock = max(self.clock, pending[self.next].arrival_time)
        while self.next < len(pending) and pending[self.next].arrival_time <= self.clock:
            r = pending[self.next]
            engine.add_request(r.request_id, r.prompt, max_tokens=r.max_tokens, temperature=1.0)
            self.next += 1
        self.outputs.extend(engine.step())
        self.steps += 1
        self.clock += self.step_time
        self.ns += time.perf_counter_ns() - t0


def _lockstep(requests: list, endpoint: str, interval_ms: int) -> dict[str, dict[str, float]]:
    """One repetition: the three variants' engines stepped in turn, each step timed on its own."""
    runners, handles, hooks = {}, [], {}
    for kind in KINDS:
        engine = Engine(EngineConfig(**ENGINE))
        if kind == "floor":
            from .subscribers import CountingSubscriber

            hooks[kind] = TimedHooks(CountingSubscriber())
            engine.hooks.subscribe(hooks[kind])
        elif kind != "off":
            full = kind.startswith("full")
            config = TelemetryConfig(
                model_name="bench",
                engine=kind,
                spans=full,
                metrics_exporters=("otlp",),
                traces_exporters=("otlp",) if full else ("none",),
                metric_export_interval_ms=interval_ms,
                defer_steps=1 if kind.endswith("+each_step") else None,
            )
            sampled = kind.endswith("+sampled10")
            with env(
                OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
                OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
                OTEL_TRACES_SAMPLER="parentbased_traceidratio" if sampled else None,
                OTEL_TRACES_SAMPLER_ARG="0.1" if sampled else None,
            ):
                handle = setup_telemetry(config)
            handles.append(handle)
            hooks[kind] = TimedHooks(handle.telemetry)
            engine.hooks.subscribe(hooks[kind])
        runners[kind] = _Runner(engine, requests)
    order = list(KINDS)
    i = 0
    while not all(r.done for r in runners.values()):
        k = i % len(order)
        for kind in order[k:] + order[:k]:
            if not runners[kind].done:
                runners[kind].iteration()
        i += 1
    flush = {}
    for handle, kind in zip(handles, [k for k in KINDS if k not in ("off", "floor")]):
        t0 = time.perf_counter()
        handle.shutdown()
        flush[kind] = time.perf_counter() - t0
    out = {}
    for kind, r in runners.items():
        tokens = sum(len(o.token_ids) for o in r.outputs)
        out[kind] = {
            "tokens_per_s": tokens / (r.ns / 1e9),
            "tokens": tokens,
            "steps": r.steps,
            "preemptions": sum(o.num_preemptions for o in r.outputs),
            "hooks_share": hooks[kind].ns / r.ns if kind in hooks else 0.0,
            "hooks_us_per_step": hooks[kind].ns / 1e3 / r.steps if kind in hooks else 0.0,
            "flush_s": flush.get(kind, 0.0),
        }
    return out


# "floor": the engine publishing its events to a subscriber that only counts them (what emitting
# events costs the engine at all). "+each_step": the same as without, with defer_steps=1 (every
# step's events applied at once: what deferring them saves). "+sampled10": the standard sampler knob,
# OTEL_TRACES_SAMPLER=parentbased_traceidratio with OTEL_TRACES_SAMPLER_ARG=0.1 (10 % of requests
# traced; metrics unchanged, exemplars only from traced requests).
def breakdown(requests: list) -> dict[str, Any]:
    """Where the time inside the hooks goes, in the engine (cold caches between steps, unlike a
    replay loop): the telemetry's per-request methods wrapped with timers, median and total per
    method, for metrics only and with spans (InMemoryMetricReader; BatchSpanProcessor to a null
    exporter). Nested: ``RequestSink.request_finished`` includes ``InProcessRecorder.finished``, which includes the
    SDK ``record`` of request_num_preemptions."""
    import statistics

    from otel_llm.core import tracker as tracker_module

    from .subscribers import otel_subscriber

    out: dict[str, Any] = {}
    for spans in (False, True):
        sub = otel_subscriber(TelemetryConfig(model_name="bench", spans=spans, defer_steps=DEFAULT_DEFER_STEPS))
        tel = sub.telemetry
        times: dict[str, list[int]] = {}

        def timed(fn: Callable[..., Any], label: str, times: dict[str, list[int]] = times) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter_ns()
                try:
                    return fn(*args, **kwargs)
                finally:
                    times.setdefault(label, []).append(time.perf_counter_ns() - t0)

            return wrapper

        m = tel.metrics
        m.finished = timed(m.finished, "InProcessRecorder.finished (11 cells)")
        sink = tel._sink  # what the tracker calls per request
        sink.request_finished = timed(sink.request_finished, "RequestSink.request_finished (metrics + span end)")
        sink.request_arrived = timed(sink.request_arrived, "RequestSink.request_arrived (span start)")
        sink.request_preempted = timed(sink.request_preempted, "RequestSink.request_preempted")
        sink.first_token = timed(sink.first_token, "RequestSink.first_token")
        sink.tokens = timed(sink.tokens, "InProcessRecorder.tokens (counter + ITL cell)")
        original = tracker_module.summarize
        tracker_module.summarize = timed(original, "tracker.summarize (RequestSummary)")
        hooks = TimedHooks(tel)
        engine = Engine(EngineConfig(**ENGINE))
        engine.hooks.subscribe(hooks)
        runner = _Runner(engine, requests)
        try:
            while not runner.done:
                runner.iteration()
        finally:
            tracker_module.summarize = original
        sub.shutdown()
        out["spans_on" if spans else "metrics_only"] = {
            "time_in_hooks_ms": hooks.ns / 1e6,
            "engine_ms": runner.ns / 1e6,
            "methods": {
                label: {
                    "calls": len(v),
                    "median_us": statistics.median(v) / 1e3,
                    "total_ms": sum(v) / 1e6,
                    "share_of_hooks": sum(v) / hooks.ns,
                }
                for label, v in times.items()
            },
        }
    return out


KINDS = ("off", "floor", "metrics", "full", "metrics+each_step", "full+each_step", "full+sampled10")


def run(tiny: bool, reps: int) -> dict[str, Any]:
    num_requests = 30 if tiny else 160
    config = EngineConfig(**ENGINE)
    requests = generate(
        WorkloadSpec(num_requests=num_requests, rate=50.0, seed=0), config.num_kv_blocks * config.block_size
    )
    interval_ms = 1000
    with otlp_receiver() as receiver:
        _lockstep(requests[: max(5, num_requests // 10)], receiver["grpc"], interval_ms)  # warm-up
        runs = [_lockstep(requests, receiver["grpc"], interval_ms) for _ in range(reps)]
    where = breakdown(requests)
    tps = {k: [r[k]["tokens_per_s"] for r in runs] for k in KINDS}
    med = {k: median(v) for k, v in tps.items()}
    paired = {k: median([r[k]["tokens_per_s"] / r["off"]["tokens_per_s"] for r in runs]) for k in KINDS[1:]}
    first = runs[0]
    out = {
        "method": "lockstep: the three engines (same seed and workload, so the same schedule) are stepped "
        "in turn, order rotated every step, each step timed on its own; tokens/s = output tokens / "
        "summed step time. Background threads (exporters) run whenever they get the GIL.",
        "receiver": receiver["kind"],
        "engine": ENGINE,
        "requests": num_requests,
        "output_tokens": first["off"]["tokens"],
        "preemptions": first["off"]["preemptions"],
        "steps": first["off"]["steps"],
        "metric_export_interval_ms": interval_ms,
        "repetitions": reps,
        "tokens_per_s": med,
        "tokens_per_s_all": tps,
        "ratios": {f"{k}/off": ratio(med[k], med["off"]) for k in KINDS[1:]},
        "ratios_paired_median": {f"{k}/off": paired[k] for k in KINDS[1:]},
        "time_in_hooks_share": {k: median([r[k]["hooks_share"] for r in runs]) for k in KINDS[1:]},
        "time_in_hooks_us_per_step": {k: median([r[k]["hooks_us_per_step"] for r in runs]) for k in KINDS[1:]},
        "shutdown_flush_s": {k: median([r[k]["flush_s"] for r in runs]) for k in KINDS[1:]},
        "same_schedule": all(
            r[k]["tokens"] == first["off"]["tokens"] and r[k]["steps"] == first["off"]["steps"]
            for r in runs
            for k in KINDS
        ),
    }
    out["in_engine_breakdown"] = where
    # Judged on the paired ratio: in lockstep, the variants of one repetition share the machine's
    # conditions; medians taken per variant across repetitions mix different conditions.
    out["targets"] = {"full/off >= 0.98 (paired median)": paired["full"] >= 0.98}
    return out
