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
import time
import tracemalloc
from typing import Any

from otel_llm.config import TelemetryConfig
from otel_llm.events import EventType, RequestEvent

from .common import rss_bytes, slope
from .subscribers import PrometheusClientSubscriber, otel_subscriber
from .workload import lifecycle_batch


def inflight_bytes(n: int) -> dict[str, float]:
    out = {}
    factories = {
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
            for rid in ids[start:start + 1000]:
                batch.append(RequestEvent(EventType.ARRIVED, rid, 10.0, prompt_tokens=100, max_tokens=200))
                batch.append(RequestEvent(EventType.QUEUED, rid, 10.0))
                batch.append(RequestEvent(EventType.SCHEDULED, rid, 10.5))
            batches.append(batch)
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for batch in batches:
            sub.on_events(batch)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        out[name] = (after - before) / n
        del batches
        sub.shutdown()
    return out


def rss_flat(total: int, batch: int = 1000, samples: int = 10) -> dict[str, Any]:
    config = TelemetryConfig(model_name="bench", spans=False, max_inflight_requests=min(100_000, total // 4))
    sub = otel_subscriber(config)
    t = 100.0
    warm = config.max_inflight_requests
    for start in range(0, warm, batch):
        events, t = lifecycle_batch(start, min(batch, warm - start), t, prefix="w")
        sub.on_events(events)
    gc.collect()
    every = total // samples
    xs, ys = [0], [rss_bytes()]
    t0 = time.perf_counter()
    done = 0
    while done < total:
        events, t = lifecycle_batch(done, batch, t)
        sub.on_events(events)
        done += batch
        if done % every == 0:
            sub.reader.get_metrics_data()  # a collection, as a reader would do periodically
            xs.append(done)
            ys.append(rss_bytes())
    elapsed = time.perf_counter() - t0
    totals = sub.totals()
    sub.shutdown()
    return {
        "requests": total,
        "events_per_request": 9,
        "warmup_requests": warm,
        "rss_samples": list(zip(xs, ys)),
        "rss_first_bytes": ys[0],
        "rss_last_bytes": ys[-1],
        "rss_growth_bytes": ys[-1] - ys[0],
        "slope_bytes_per_request": slope([float(x) for x in xs], [float(y) for y in ys]),
        "slope_bytes_per_1e5_requests": slope([float(x) for x in xs], [float(y) for y in ys]) * 1e5,
        "finished_counted": totals["finished"],
        "ns_per_event": elapsed * 1e9 / (total * 9),
    }


def run(tiny: bool, reps: int) -> dict[str, Any]:
    n = 2_000 if tiny else 50_000
    total = 10_000 if tiny else 1_000_000
    flat = rss_flat(total)
    inflight = inflight_bytes(n)
    out = {
        "inflight_requests": n,
        "bytes_per_inflight_request": inflight,
        "rss_after_finished": flat,
    }
    # Flat: growth over the sampled run under 1 byte per request (noise: arenas, allocator).
    out["targets"] = {"rss flat (slope < 1 B/request)": abs(flat["slope_bytes_per_request"]) < 1.0}
    return out
