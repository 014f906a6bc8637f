"""Section 3: memory per in-flight request, and resident memory over many finished requests.

* bytes per in-flight request: tracemalloc around N requests that ARRIVED, were QUEUED and
  SCHEDULED (still in flight), divided by N; for the telemetry with spans off and on (a live
  span per request), and for the prometheus_client baseline (same Tracker).
* RSS (VmRSS) while 10^6 requests (10^4 with --tiny) go through a whole lifecycle each, fed in
  batches; sampled every 10 %: must be flat. The tracker remembers the ids of as many recently
  finished requests as ``max_inflight_requests`` (to classify late events), so the run starts
  with a warm-up of that many requests (untimed) and the samples start after it.
"""

from __future__ import annotations

import gc
import sys
import time
import tracemalloc
from typing import Any, Callable

from otel_llm.config.settings import TelemetryConfig
from otel_llm.events import EventType, RequestEvent

from .common import flush, ratio, rss_bytes, slope
from .subscribers import PrometheusClientSubscriber, otel_subscriber
from .workload import lifecycle_batch


def inflight_bytes(n: int) -> dict[str, float]:
    out = {}
    factories: dict[str, Callable[[], Any]] = {
        "ours_spans_off": lambda: otel_subscriber(TelemetryConfig(model_name="bench", spans=False)),
        "ours_spans_on": lambda: otel_subscriber(TelemetryConfig(model_name="bench", spans=True)),
        "prometheus_client": lambda: PrometheusClientSubscriber(TelemetryConfig(model_name="bench")),
    }
    for name, factory in factories.items():
        sub = factory()
        ids = [f"inflight-{i:08d}" for i in range(n)]  # ids are the engine's: not counted
        batches = []
        for start in range(0, n, 1000):
            batch = []
            for rid in ids[start : start + 1000]:
                batch.append(RequestEvent(EventType.ARRIVED, rid, 10.0, prompt_tokens=100, max_tokens=200))
                batch.append(RequestEvent(EventType.QUEUED, rid, 10.0))
                batch.append(RequestEvent(EventType.SCHEDULED, rid, 10.5))
            batches.append(batch)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for batch in batches:
            sub.on_events(batch)
        flush(sub)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        out[name] = (after - before) / n
        del batches
        sub.shutdown()
    return out


def rss_flat(total: int, batch: int = 1000, samples: int = 10) -> dict[str, Any]:
    # defer_steps=1: a batch here is 1000 requests, not an engine step.
    config = TelemetryConfig(
        model_name="bench", spans=False, max_inflight_requests=min(100_000, total // 4), defer_steps=1
    )
    sub = otel_subscriber(config)
    gc.collect()
    t = 100.0
    warm = config.max_inflight_requests
    for start in range(0, warm, batch):
        events, t = lifecycle_batch(start, min(batch, warm - start), t, prefix="w")
        sub.on_events(events)
    sub.reader.get_metrics_data()  # the first collection allocates the SDK's per-series state
    gc.collect()
    every = total // samples
    xs, ys, blocks = [0], [rss_bytes()], [sys.getallocatedblocks()]
    elapsed = 0.0
    done = 0
    while done < total:
        events, t = lifecycle_batch(done, batch, t)
        t0 = time.perf_counter()
        sub.on_events(events)
        elapsed += time.perf_counter() - t0
        done += batch
        if done % every == 0:
            sub.reader.get_metrics_data()  # a collection, as a reader would do periodically
            gc.collect()
            xs.append(done)
            ys.append(rss_bytes())
            blocks.append(sys.getallocatedblocks())
    totals = sub.totals()
    sub.shutdown()
    # The first interval settles (first-touch allocations, the last warm-up batch still alive):
    # flatness is judged from the first sample after it to the last.
    sx, sy, sb = [float(x) for x in xs[1:]], [float(y) for y in ys[1:]], [float(b) for b in blocks[1:]]
    return {
        "requests": total,
        "events_per_request": 9,
        "warmup_requests": warm,
        "max_inflight_requests": config.max_inflight_requests,
        "rss_samples": list(zip(xs, ys)),
        "allocated_blocks_samples": list(zip(xs, blocks)),
        "judged_from_request": xs[1],
        "rss_first_bytes": ys[1],
        "rss_last_bytes": ys[-1],
        "rss_growth_bytes": ys[-1] - ys[1],
        "slope_bytes_per_request": slope(sx, sy),
        "allocated_blocks_growth": blocks[-1] - blocks[1],
        "blocks_slope_per_request": slope(sx, sb),
        "finished_counted": totals["finished"],
        "ns_per_event": elapsed * 1e9 / (total * 9),
        "us_per_request": elapsed * 1e6 / total,
    }


def steady_state(warm: int, measured: int, batch: int = 1000, chunk: int = 10_000) -> dict[str, Any]:
    """us per whole request lifecycle once the tracker's finished-id memory is full (default size
    ``max_inflight_requests``), over more than one resize cycle of a dict of that size. With a
    plain dict, forgetting the oldest id cost a sawtooth up to ~180 us per request (each
    ``next(iter(d))`` skips the slots deleted since the last resize); the core's OrderedDict
    keeps it flat: ``us_per_request_by_chunk`` and the max/min chunk ratio show it."""
    config = TelemetryConfig(model_name="bench", spans=False, max_inflight_requests=warm, defer_steps=1)
    subs = {"ours": otel_subscriber(config)}
    targets = {name: sub.telemetry for name, sub in subs.items()}
    t = 100.0
    tt = t
    for target in targets.values():
        tt = t
        for start in range(0, warm, batch):  # fill the finished-id memory
            events, tt = lifecycle_batch(start, batch, tt, prefix="s")
            target.on_events(events)
    t = tt
    names = list(targets)
    times = dict.fromkeys(names, 0)
    by_chunk: dict[str, list[float]] = {n: [] for n in names}
    chunk_ns = dict.fromkeys(names, 0)
    for i, start in enumerate(range(warm, warm + measured, batch)):
        events, t = lifecycle_batch(start, batch, t, prefix="s")
        k = i % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter_ns()
            targets[name].on_events(events)
            dt = time.perf_counter_ns() - t0
            times[name] += dt
            chunk_ns[name] += dt
        if (start - warm + batch) % chunk == 0:
            for n in names:
                by_chunk[n].append(round(chunk_ns[n] / 1e3 / chunk, 1))
                chunk_ns[n] = 0
    for sub in subs.values():
        sub.shutdown()
    us = {name: ns / 1e3 / measured for name, ns in times.items()}
    return {
        "finished_id_memory": warm,
        "requests_timed": measured,
        "events_per_request": 9,
        "us_per_request": us,
        "us_per_request_by_chunk": by_chunk,
        "chunk_requests": chunk,
        "ratio max/min chunk": ratio(max(by_chunk["ours"]), min(by_chunk["ours"])),
    }


def run(tiny: bool, reps: int) -> dict[str, Any]:
    n = 2_000 if tiny else 50_000
    total = 10_000 if tiny else 3_000_000
    flat = rss_flat(total, samples=10 if tiny else 30)
    inflight = inflight_bytes(n)
    # 300 000 > one resize cycle of a 100 000-entry dict (~250 000 insertions between compactions).
    steady = steady_state(
        warm=10_000 if tiny else 100_000, measured=30_000 if tiny else 300_000, chunk=1_000 if tiny else 10_000
    )
    out = {
        "inflight_requests": n,
        "bytes_per_inflight_request": inflight,
        "rss_after_finished": flat,
        "steady_state_cost": steady,
    }
    # Flat: Python objects (allocated blocks) do not grow with requests -- a leak of one object per
    # request is a slope of >= 1 -- and RSS does not grow over the second half of the run. In the
    # first half RSS rises in a few steps of a few MiB to a high-water mark (glibc keeping the freed
    # tables of the bounded id memories, whose dicts are reallocated as ids churn: seen to settle
    # by 0.9e6 requests and stay level to 3e6); one leaked small object per request would instead
    # add >= 50 B/request, >= 70 MiB over the second half.
    samples = flat["rss_samples"]
    half = samples[len(samples) // 2][1]
    flat["rss_growth_second_half_bytes"] = samples[-1][1] - half
    out["targets"] = {
        "memory flat": abs(flat["blocks_slope_per_request"]) < 0.01 and flat["rss_growth_second_half_bytes"] < 2**20
    }
    return out
