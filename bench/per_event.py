"""Section 1: per-event cost of each subscriber on the same pre-generated event batches.

Each repetition builds a fresh subscriber, replays the warm-up steps untimed (to reach 256
running requests), then times the replay of the measured steps (``on_events`` + ``on_step``
per step). Subscribers run interleaved; the result is the median over repetitions, in ns per
request event, and the ratios of those medians.
"""

from __future__ import annotations

import cProfile
import io
import math
import pstats
import time
from typing import Any, Callable

from otel_llm.config import TelemetryConfig

from .common import interleave, median, ratio
from .subscribers import CountingSubscriber, PrometheusClientSubscriber, otel_subscriber
from .workload import EventMix, event_mix

CONFIG = TelemetryConfig(model_name="bench", spans=False)
CONFIG_SPANS = TelemetryConfig(model_name="bench", spans=True)

SUBSCRIBERS: dict[str, tuple[str, Callable[[], Any]]] = {
    "ours": ("EngineTelemetry, fast path, spans off", lambda: otel_subscriber(CONFIG)),
    "ours_spans": ("EngineTelemetry, fast path, spans on (BatchSpanProcessor, null exporter)",
                   lambda: otel_subscriber(CONFIG_SPANS)),
    "floor": ("(a) floor: stats[k] += 1 per event", CountingSubscriber),
    "prometheus_client": ("(b) vLLM-style prometheus_client, bound children, same Tracker",
                          lambda: PrometheusClientSubscriber(CONFIG)),
    "naive_otel": ("(c) EngineTelemetry(fast_path=False): one SDK record/add per observation",
                   lambda: otel_subscriber(CONFIG, fast_path=False)),
}


def replay(sub: Any, steps: list) -> None:
    on_events, on_step = sub.on_events, sub.on_step
    for events, stats in steps:
        on_events(events)
        on_step(stats)


def _timed(factory: Callable[[], Any], mix: EventMix) -> Callable[[], float]:
    def run() -> float:
        sub = factory()
        replay(sub, mix.warmup)
        start = time.perf_counter_ns()
        replay(sub, mix.steps)
        elapsed = time.perf_counter_ns() - start
        sub.shutdown()
        return elapsed / mix.num_events
    return run


def sanity(mix: EventMix) -> dict[str, Any]:
    """Replay everything once through each subscriber; the derived totals must agree."""
    everything = mix.warmup + mix.steps
    floor = CountingSubscriber()
    replay(floor, everything)
    from otel_llm.events import EventType
    expected = {
        "finished": float(floor.stats[EventType.FINISHED]),
        "preemptions": float(floor.stats[EventType.PREEMPTED]),
        "generation_tokens": float(floor.stats[EventType.TOKENS]),  # num_tokens=1 per TOKENS event
        "ttft_count": float(floor.stats[EventType.FIRST_TOKEN]),
        "num_preemptions_hist_count": float(floor.stats[EventType.FINISHED]),
    }
    totals: dict[str, dict[str, float]] = {"floor (event counts)": expected}
    for name in ("ours", "ours_spans", "prometheus_client", "naive_otel"):
        sub = SUBSCRIBERS[name][1]()
        replay(sub, everything)
        totals[name] = sub.totals()
        sub.shutdown()
    mismatches = []
    reference = totals["prometheus_client"]
    for name, values in totals.items():
        for key, value in values.items():
            want = expected.get(key, reference.get(key))
            if want is None or not math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-6):
                mismatches.append(f"{name}.{key}={value} != {want}")
    return {"ok": not mismatches, "mismatches": mismatches, "totals": totals}


def profile_ours(mix: EventMix, top: int = 25) -> dict[str, Any]:
    """cProfile of our subscriber over the measured steps: top functions by cumulative time."""
    sub = SUBSCRIBERS["ours"][1]()
    replay(sub, mix.warmup)
    prof = cProfile.Profile()
    prof.enable()
    replay(sub, mix.steps)
    prof.disable()
    sub.shutdown()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({func})",
                     "calls": nc, "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4),
                     "per_call_us": round(ct / nc * 1e6, 3) if nc else None})
    rows.sort(key=lambda r: r["cumtime_s"], reverse=True)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    return {"events": mix.num_events, "top_cumulative": rows[:top],
            "top_tottime_text": text.getvalue()[-4000:]}


def run(tiny: bool, reps: int) -> dict[str, Any]:
    mix = event_mix(num_steps=20 if tiny else 400, running=256)
    check = sanity(mix)
    measured = interleave({name: _timed(factory, mix) for name, (_, factory) in SUBSCRIBERS.items()}, reps)
    ns = {name: median(values) for name, values in measured.items()}
    out: dict[str, Any] = {
        "events_timed": mix.num_events,
        "steps_timed": len(mix.steps),
        "event_counts": mix.counts,
        "repetitions": reps,
        "subscribers": {name: desc for name, (desc, _) in SUBSCRIBERS.items()},
        "ns_per_event": ns,
        "ns_per_event_all": measured,
        "ratios": {
            "ours/prometheus_client": ratio(ns["ours"], ns["prometheus_client"]),
            "ours/floor": ratio(ns["ours"], ns["floor"]),
            "naive_otel/prometheus_client": ratio(ns["naive_otel"], ns["prometheus_client"]),
            "ours_spans/prometheus_client": ratio(ns["ours_spans"], ns["prometheus_client"]),
            "ours_spans/floor": ratio(ns["ours_spans"], ns["floor"]),
        },
        "sanity": check,
    }
    # Paired ratios (same repetition) are less sensitive to drifts than ratios of medians.
    out["ratios_paired_median"] = {
        "ours/prometheus_client": median([a / b for a, b in zip(measured["ours"], measured["prometheus_client"])]),
        "ours/floor": median([a / b for a, b in zip(measured["ours"], measured["floor"])]),
    }
    out["targets"] = {
        "ours <= 1.0x prometheus_client": out["ratios"]["ours/prometheus_client"] <= 1.0,
        "ours <= 5x floor": out["ratios"]["ours/floor"] <= 5.0,
    }
    return out
