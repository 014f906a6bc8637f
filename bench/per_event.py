"""Section 1: per-event cost of each subscriber on the same pre-generated event batches.

Each repetition builds a fresh subscriber of each kind, replays the warm-up steps untimed (to
reach 256 running requests), then times the replay of the measured steps (``on_events`` +
``on_step`` per step), interleaved a few steps at a time across subscribers (see ``measure``).
The result is the median over repetitions, in ns per request event, and the ratios of those
medians (and the median of per-repetition ratios).
"""

from __future__ import annotations

import cProfile
import dataclasses
import gc
import io
import math
import pstats
import time
from typing import Any, Callable

from . import proposals  # measured changes to the core's hot path, interleaved with the rest
from .common import flush, median, ratio
from .replay import CONFIG, replay
from .subscribers import CountingSubscriber, PrometheusClientSubscriber, otel_subscriber
from .workload import EventMix, event_mix

CONFIG_SPANS = dataclasses.replace(CONFIG, spans=True)
CONFIG_LOG = dataclasses.replace(CONFIG_SPANS, preemption_events="log")
CONFIG_BOTH = dataclasses.replace(CONFIG_SPANS, preemption_events="both")
CONFIG_EXPONENTIAL = dataclasses.replace(CONFIG, histogram_aggregation="base2_exponential_bucket_histogram")
CONFIG_TENANTS = dataclasses.replace(CONFIG, tenant="priority")
CONFIG_SPANS_TENANTS = dataclasses.replace(CONFIG_SPANS, tenant="priority")

SUBSCRIBERS: dict[str, tuple[str, Callable[[], Any]]] = {
    "ours": ("EngineTelemetry, fast path, spans off", lambda: otel_subscriber(CONFIG)),
    "ours_spans": (
        "EngineTelemetry, fast path, spans on (BatchSpanProcessor, null exporter)",
        lambda: otel_subscriber(CONFIG_SPANS),
    ),
    "ours_spans_log": (
        "ours_spans with preemption_events=log (BatchLogRecordProcessor, null exporter)",
        lambda: otel_subscriber(CONFIG_LOG),
    ),
    "ours_spans_both": ("ours_spans with preemption_events=both", lambda: otel_subscriber(CONFIG_BOTH)),
    "ours_exponential": (
        "ours with exponential histograms (cells keep base-2 buckets too)",
        lambda: otel_subscriber(CONFIG_EXPONENTIAL),
    ),
    "ours_tenants8": (
        "ours with OTEL_LLM_TENANT=priority, 8 tenants (every request-scoped series per tenant, the matrix)",
        lambda: otel_subscriber(CONFIG_TENANTS),
    ),
    "ours_spans_tenants8": ("ours_spans with 8 tenants", lambda: otel_subscriber(CONFIG_SPANS_TENANTS)),
    "floor": ("(a) floor: stats[k] += 1 per event", CountingSubscriber),
    "prometheus_client": (
        "(b) vLLM-style prometheus_client, bound children, same Tracker",
        lambda: PrometheusClientSubscriber(CONFIG),
    ),
    "naive_otel": (
        "(c) EngineTelemetry(metric_path='sdk'): one SDK record/add per observation",
        lambda: otel_subscriber(CONFIG, metric_path="sdk", span_path="tracer"),
    ),
}


def measure(
    factories: dict[str, Callable[[], Any]], mix: EventMix, reps: int, chunk: int = 4
) -> dict[str, list[float]]:
    """ns per event, one value per repetition and subscriber.

    Interleaved at a fine grain: every repetition builds all subscribers, warms them up, then
    replays the timed steps ``chunk`` steps at a time through each subscriber in turn (the order
    rotated every chunk), timing each slice. A load change on these shared machines then hits
    every subscriber alike, and the ratios stay stable even when the absolute numbers do not.
    """
    names = list(factories)
    out: dict[str, list[float]] = {n: [] for n in names}
    steps = mix.steps
    for _ in range(reps):
        subs = {n: factories[n]() for n in names}
        for sub in subs.values():
            replay(sub, mix.warmup)
            flush(sub)
        gc.collect()
        totals = dict.fromkeys(names, 0)
        clock = time.perf_counter_ns
        for i, start in enumerate(range(0, len(steps), chunk)):
            part = steps[start : start + chunk]
            k = i % len(names)
            for n in names[k:] + names[:k]:
                sub = subs[n]
                t0 = clock()
                replay(sub, part)
                totals[n] += clock() - t0
        for n in names:
            t0 = clock()
            flush(subs[n])  # the work still pending at the end is part of the cost
            totals[n] += clock() - t0
            out[n].append(totals[n] / mix.num_events)
            subs[n].shutdown()
    return out


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
    for name in (
        "ours",
        "ours_spans",
        "ours_spans_log",
        "ours_spans_both",
        "ours_exponential",
        "ours_tenants8",
        "ours_spans_tenants8",
        "prometheus_client",
        "naive_otel",
    ):
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


def profile_ours(mix: EventMix, top: int = 25, name: str = "ours") -> dict[str, Any]:
    """cProfile of our subscriber over the measured steps: top functions by cumulative time."""
    sub = SUBSCRIBERS[name][1]()
    replay(sub, mix.warmup)
    prof = cProfile.Profile()
    prof.enable()
    replay(sub, mix.steps)
    prof.disable()
    sub.shutdown()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]  # pstats.Stats.stats is not in the stubs
        rows.append(
            {
                "function": f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line}({func})",
                "calls": nc,
                "tottime_s": round(tt, 4),
                "cumtime_s": round(ct, 4),
                "per_call_us": round(ct / nc * 1e6, 3) if nc else None,
            }
        )
    rows.sort(key=lambda r: r["cumtime_s"], reverse=True)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    return {"events": mix.num_events, "top_cumulative": rows[:top], "top_tottime_text": text.getvalue()[-4000:]}


def run(tiny: bool, reps: int) -> dict[str, Any]:
    mix = event_mix(num_steps=20 if tiny else 400, running=256)

    check = sanity(mix)
    variants = {name: factory for name, (_, factory) in SUBSCRIBERS.items()}
    variants.update({f"proposal:{name}": factory for name, factory in proposals.VARIANTS.items() if name != "ours"})
    variants.update({f"diagnostic:{name}": factory for name, factory in proposals.DIAGNOSTICS.items()})
    measured = measure(variants, mix, reps)
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
            "ours_spans_log/prometheus_client": ratio(ns["ours_spans_log"], ns["prometheus_client"]),
            "ours_spans_both/prometheus_client": ratio(ns["ours_spans_both"], ns["prometheus_client"]),
            "ours_spans_log/ours_spans": ratio(ns["ours_spans_log"], ns["ours_spans"]),
            "ours_spans_both/ours_spans": ratio(ns["ours_spans_both"], ns["ours_spans"]),
            "ours_exponential/ours": ratio(ns["ours_exponential"], ns["ours"]),
            "ours_exponential/prometheus_client": ratio(ns["ours_exponential"], ns["prometheus_client"]),
            "ours_tenants8/ours": ratio(ns["ours_tenants8"], ns["ours"]),
            "ours_tenants8/prometheus_client": ratio(ns["ours_tenants8"], ns["prometheus_client"]),
            "ours_spans_tenants8/ours_spans": ratio(ns["ours_spans_tenants8"], ns["ours_spans"]),
        },
        "sanity": check,
    }
    # Paired ratios (same repetition) are less sensitive to drifts than ratios of medians.
    out["ratios_paired_median"] = {
        "ours/prometheus_client": median([a / b for a, b in zip(measured["ours"], measured["prometheus_client"])]),
        "ours/floor": median([a / b for a, b in zip(measured["ours"], measured["floor"])]),
        "ours_spans_log/ours_spans": median(
            [a / b for a, b in zip(measured["ours_spans_log"], measured["ours_spans"])]
        ),
        "ours_spans_both/ours_spans": median(
            [a / b for a, b in zip(measured["ours_spans_both"], measured["ours_spans"])]
        ),
        "ours_exponential/ours": median([a / b for a, b in zip(measured["ours_exponential"], measured["ours"])]),
        "ours_tenants8/ours": median([a / b for a, b in zip(measured["ours_tenants8"], measured["ours"])]),
        "ours_spans_tenants8/ours_spans": median(
            [a / b for a, b in zip(measured["ours_spans_tenants8"], measured["ours_spans"])]
        ),
    }
    out["proposals"] = {
        "equal_totals": proposals.check_equal(mix),
        "ns_per_event": {name.split(":", 1)[1]: ns[name] for name in ns if name.startswith("proposal:")},
        "vs_ours_paired_median": {
            name.split(":", 1)[1]: median([a / b for a, b in zip(measured[name], measured["ours"])])
            for name in ns
            if name.startswith("proposal:")
        },
        "vs_floor": {
            name.split(":", 1)[1]: ratio(ns[name], ns["floor"]) for name in ns if name.startswith("proposal:")
        },
        "vs_prometheus_client": {
            name.split(":", 1)[1]: ratio(ns[name], ns["prometheus_client"])
            for name in ns
            if name.startswith("proposal:")
        },
        "what": proposals.__doc__,
    }
    out["diagnostics"] = {
        "ns_per_event": {name.split(":", 1)[1]: ns[name] for name in ns if name.startswith("diagnostic:")},
        "vs_floor": {
            name.split(":", 1)[1]: ratio(ns[name], ns["floor"]) for name in ns if name.startswith("diagnostic:")
        },
        "share_of_ours": {
            name.split(":", 1)[1]: ratio(ns[name], ns["ours"]) for name in ns if name.startswith("diagnostic:")
        },
    }
    out["targets"] = {
        "ours <= 1.0x prometheus_client": out["ratios"]["ours/prometheus_client"] <= 1.0,
        "ours <= 5x floor": out["ratios"]["ours/floor"] <= 5.0,
        "ours_spans_log <= 1.0x prometheus_client": out["ratios"]["ours_spans_log/prometheus_client"] <= 1.0,
        "ours_spans_both <= 1.0x prometheus_client": out["ratios"]["ours_spans_both/prometheus_client"] <= 1.0,
        "ours_tenants8 <= 1.0x prometheus_client": out["ratios"]["ours_tenants8/prometheus_client"] <= 1.0,
    }
    return out
