"""From a bad bucket to the request's trace, on a local stack: Prometheus scraping the plugin's
endpoint (exemplar storage on) and Phoenix receiving its spans over OTLP/HTTP.

:func:`start_stack` starts both; :func:`telemetry_settings` is what a TelemetryConfig needs to send
to them; :func:`drill_down` reads back, once a run is over, a histogram's worst bucket and its
exemplars from Prometheus and the worst requests' traces from Phoenix (of the preemptions
suffered, and of the preemptions caused: the worst evictors); :func:`print_drilldown` shows it.
The lookups under it are the steps by hand: :func:`bucket_counts`, :func:`worst_bucket`,
:func:`exemplars_by_bucket`; and from a victim's span on to its evictors' (:func:`evictor_spans`),
through the request ids its ``preempted`` events name, as Phoenix keeps no span links.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

from otel_llm.stack.phoenix import Phoenix, PhoenixUnavailable, TraceNotFound, start_phoenix
from otel_llm.stack.prometheus import LOOPBACK, Prometheus, PrometheusUnavailable, start_prometheus

StackUnavailable = (PrometheusUnavailable, PhoenixUnavailable)


@dataclass
class Stack:
    prometheus: Prometheus
    phoenix: Phoenix
    metrics_port: int  # where the plugin's /metrics must listen: Prometheus scrapes it


@contextlib.contextmanager
def start_stack(
    metrics_port: int, prometheus_port: Optional[int] = None, phoenix: Optional[str] = None
) -> Iterator[Stack]:
    """Prometheus (on ``prometheus_port``, else a free port) scraping 127.0.0.1:``metrics_port``,
    and Phoenix (the executable ``phoenix``, else found as :func:`otel_llm.stack.phoenix.executable`
    does). Raises one of ``StackUnavailable`` naming what is missing."""
    with contextlib.ExitStack() as stack:
        prom = stack.enter_context(start_prometheus(f"{LOOPBACK}:{metrics_port}", port=prometheus_port))
        store = stack.enter_context(start_phoenix(phoenix))
        yield Stack(prom, store, metrics_port)


def telemetry_settings(stack: Stack) -> dict[str, Any]:
    """TelemetryConfig settings for the stack: /metrics where Prometheus scrapes, spans to Phoenix."""
    return {
        "metrics_exporters": ("prometheus",),
        "traces_exporters": ("otlp",),
        "otlp_protocol": "http/protobuf",
        "otlp_endpoint": stack.phoenix.otlp_endpoint,
        "prometheus_host": LOOPBACK,
        "prometheus_port": stack.metrics_port,
    }


@dataclass
class Worst:
    """One of the worst requests: its bucket's PromQL selector and its trace in Phoenix."""

    request_id: str
    preemptions: int
    trace_id: str
    bucket: str  # PromQL: the bucket series holding the request, which its exemplar hangs on
    trace_url: str
    exemplar: bool  # Prometheus holds the request's trace as an exemplar of that bucket
    in_phoenix: bool


@dataclass
class Drilldown:
    prometheus_url: str
    phoenix_url: str
    requests_scraped: int
    worst_bucket: Optional[str]  # PromQL of the highest non-empty bucket
    worst_bucket_requests: int
    worst_bucket_graph: str  # that query on Prometheus's graph page
    worst_bucket_exemplars: list[str]  # trace URLs in Phoenix
    worst: list[Worst]


def bucket_counts(prom: Prometheus, histogram: str, matchers: str = "") -> list[tuple[float, str, int]]:
    """The requests in each bucket of ``histogram`` (summed over its series, those ``matchers``
    select where given), as (upper bound, ``le`` label, requests), lowest bound first. Prometheus
    holds buckets cumulative: each bucket's own count is its count less the one below."""
    cumulative = sorted(
        (float(r["metric"]["le"]), r["metric"]["le"], float(r["value"][1]))
        for r in prom.query(f"sum by (le) ({histogram}_bucket{{{matchers}}})")
    )
    below = [0.0] + [count for _, _, count in cumulative]
    return [(bound, le, int(count - lower)) for (bound, le, count), lower in zip(cumulative, below)]


def worst_bucket(buckets: list[tuple[float, str, int]]) -> Optional[str]:
    """The ``le`` of the highest bucket holding a request (None where none does)."""
    return next((le for _, le, n in reversed(buckets) if n > 0), None)


def bucket_of(buckets: list[tuple[float, str, int]], value: float) -> str:
    """The ``le`` of the bucket that holds ``value``: the lowest bound at or above it."""
    return next(le for bound, le, _ in buckets if value <= bound)


def exemplars_by_bucket(
    prom: Prometheus, histogram: str, since: float, matchers: str = ""
) -> dict[str, list[dict[str, Any]]]:
    """The exemplars Prometheus holds for ``histogram``'s buckets from ``since`` (wall clock) on,
    by ``le``, oldest first; each has ``labels`` (``trace_id``, ``span_id``) and ``value``."""
    by_le: dict[str, list[dict[str, Any]]] = {}
    for series in prom.exemplars(f"{histogram}_bucket{{{matchers}}}", since - 60, time.time() + 60):
        by_le.setdefault(series["seriesLabels"]["le"], []).extend(series["exemplars"])
    for exemplars in by_le.values():
        exemplars.sort(key=lambda e: float(e["timestamp"]))
    return by_le


def preemption_causes(span: Mapping[str, Any]) -> list[tuple[int, str, list[str]]]:
    """A request span's preemptions as Phoenix returns it: (ordinal, cause kind, cause request
    ids) of each ``preempted`` event, in order."""
    events = [e["attributes"] for e in span["events"] if e["name"] == "preempted"]
    return sorted(
        (int(e["ordinal"]), str(e.get("cause", "unknown")), list(e.get("cause_request_ids", ()))) for e in events
    )


def evictor_spans(phoenix: Phoenix, victim: Mapping[str, Any], timeout_s: float = 30.0) -> list[tuple[int, dict]]:
    """From a victim's request span to the request spans of its evictors: (ordinal, evictor's
    span) for each preemption that another request caused, one per cause, in order. Phoenix keeps
    no span links, so each cause is found by the request id its ``preempted`` event names."""
    own = victim["attributes"]["gen_ai.request.id"]
    return [
        (ordinal, phoenix.request_span(cause, timeout_s))
        for ordinal, _, causes in preemption_causes(victim)
        for cause in causes
        if cause != own  # its own cause: the evictor is itself
    ]


def drill_down(
    stack: Stack,
    histogram: str,
    requests: Mapping[str, tuple[int, str]],
    top: int,
    since: float,
    timeout_s: float = 30.0,
) -> Drilldown:
    """After a run: ``requests`` maps request id to (its observation in ``histogram``, trace id)
    as the run saw them; ``since`` is the run's start (wall clock). Waits, up to ``timeout_s``,
    for Prometheus to scrape every request and for Phoenix to hold each of the ``top`` worst
    requests' traces (a request observed as 0 is none of the worst)."""
    prom, phoenix = stack.prometheus, stack.phoenix
    deadline = time.monotonic() + timeout_s
    scraped = 0
    while True:
        result = prom.query(f"sum({histogram}_count)")
        scraped = int(float(result[0]["value"][1])) if result else 0
        if scraped >= len(requests) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)

    buckets = bucket_counts(prom, histogram)
    exemplars = {
        le: {e["labels"]["trace_id"] for e in held} for le, held in exemplars_by_bucket(prom, histogram, since).items()
    }

    def selector(le: str) -> str:
        return f'{histogram}_bucket{{le="{le}"}}'

    worst = []
    ranked = sorted(((r, v) for r, v in requests.items() if v[0] > 0), key=lambda kv: (-kv[1][0], kv[0]))
    for request_id, (count, trace_id) in ranked[:top]:
        le = bucket_of(buckets, count) if buckets else "+Inf"
        try:
            phoenix.wait_for_spans(trace_id, bool, timeout_s=max(deadline - time.monotonic(), 0.0))
            stored = True
        except TraceNotFound:
            stored = False
        worst.append(
            Worst(
                request_id,
                count,
                trace_id,
                selector(le),
                phoenix.trace_url(trace_id),
                trace_id in exemplars.get(le, ()),
                stored,
            )
        )
    worst_le = worst_bucket(buckets)
    return Drilldown(
        prometheus_url=prom.url,
        phoenix_url=phoenix.url,
        requests_scraped=scraped,
        worst_bucket=selector(worst_le) if worst_le else None,
        worst_bucket_requests=next((n for _, le, n in buckets if le == worst_le), 0),
        worst_bucket_graph=prom.graph_url(selector(worst_le)) if worst_le else "",
        worst_bucket_exemplars=[phoenix.trace_url(t) for t in sorted(exemplars.get(worst_le or "", ()))],
        worst=worst,
    )


def print_drilldown(sections: Sequence[tuple[str, str, Drilldown]], total: int) -> None:
    """Each of ``sections`` as (what its rows are, the unit of their count, its drill-down), under
    one header; they come from the same Prometheus and Phoenix."""
    first = sections[0][2]
    print(f"drill-down: Prometheus {first.prometheus_url} (exemplar storage on), Phoenix {first.phoenix_url}")
    if first.requests_scraped < total:
        print(f"  Prometheus holds {first.requests_scraped} of {total} requests (its last scrape is missing)")
    for title, unit, report in sections:
        if report.worst_bucket is None:
            print(f"  {title}: no request in the histogram")
            continue
        n = report.worst_bucket_requests
        print(f"  worst bucket   {report.worst_bucket}: {n} request{'' if n == 1 else 's'}")
        print(f"  in Prometheus  {report.worst_bucket_graph}")
        for url in report.worst_bucket_exemplars:
            print(f"  exemplar       {url}")
        if not report.worst:
            print(f"  {title}: none (no request has a count above 0)")
            continue
        print(f"  {title} (the PromQL of its bucket; its trace in Phoenix):")
        width = max(len(w.request_id) for w in report.worst)
        for w in report.worst:
            marks = ", ".join(m for m, on in (("an exemplar", w.exemplar), ("NOT in Phoenix", not w.in_phoenix)) if on)
            print(
                f"    {w.request_id:<{width}} {w.preemptions:3d} {unit}  {w.bucket}  {w.trace_url}"
                + (f"  ({marks})" if marks else "")
            )
