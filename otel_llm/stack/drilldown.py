"""From a bad bucket to the request's trace, on a local stack: Prometheus scraping the plugin's
endpoint (exemplar storage on) and Phoenix receiving its spans over OTLP/HTTP.

:func:`start_stack` starts both; :func:`telemetry_settings` is what a TelemetryConfig needs to send
to them; :func:`drill_down` reads back, once a run is over, the worst bucket and its exemplars from
Prometheus and the worst requests' traces from Phoenix; :func:`print_drilldown` shows it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

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


def drill_down(
    stack: Stack,
    histogram: str,
    requests: Mapping[str, tuple[int, str]],
    top: int,
    since: float,
    timeout_s: float = 30.0,
) -> Drilldown:
    """After a run: ``requests`` maps request id to (preemptions, trace id) as the run saw them;
    ``since`` is the run's start (wall clock). Waits, up to ``timeout_s``, for Prometheus to scrape
    every request and for Phoenix to hold each of the ``top`` worst requests' traces."""
    prom, phoenix = stack.prometheus, stack.phoenix
    deadline = time.monotonic() + timeout_s
    scraped = 0
    while True:
        result = prom.query(f"sum({histogram}_count)")
        scraped = int(float(result[0]["value"][1])) if result else 0
        if scraped >= len(requests) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)

    cumulative = sorted(
        (float(r["metric"]["le"]), r["metric"]["le"], float(r["value"][1]))
        for r in prom.query(f"sum by (le) ({histogram}_bucket)")
    )
    per_bucket = [
        (le, count - below) for (_, le, count), below in zip(cumulative, [0.0] + [c for _, _, c in cumulative])
    ]
    non_empty = [(le, n) for le, n in per_bucket if n > 0]

    def selector(le: str) -> str:
        return f'{histogram}_bucket{{le="{le}"}}'

    def bucket_of(count: int) -> str:
        return next(le for value, le, _ in cumulative if count <= value)

    exemplars: dict[str, set[str]] = {}  # le -> trace ids
    for series in prom.exemplars(f"{histogram}_bucket", since - 60, time.time() + 60):
        le = series["seriesLabels"]["le"]
        exemplars.setdefault(le, set()).update(e["labels"]["trace_id"] for e in series["exemplars"])

    worst = []
    for request_id, (count, trace_id) in sorted(requests.items(), key=lambda kv: (-kv[1][0], kv[0]))[:top]:
        le = bucket_of(count) if cumulative else "+Inf"
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
    worst_le, worst_n = non_empty[-1] if non_empty else (None, 0)
    return Drilldown(
        prometheus_url=prom.url,
        phoenix_url=phoenix.url,
        requests_scraped=scraped,
        worst_bucket=selector(worst_le) if worst_le else None,
        worst_bucket_requests=int(worst_n),
        worst_bucket_graph=prom.graph_url(selector(worst_le)) if worst_le else "",
        worst_bucket_exemplars=[phoenix.trace_url(t) for t in sorted(exemplars.get(worst_le or "", ()))],
        worst=worst,
    )


def print_drilldown(report: Drilldown, total: int) -> None:
    print(f"drill-down: Prometheus {report.prometheus_url} (exemplar storage on), Phoenix {report.phoenix_url}")
    if report.requests_scraped < total:
        print(f"  Prometheus holds {report.requests_scraped} of {total} requests (its last scrape is missing)")
    if report.worst_bucket is None:
        print("  no request in the histogram")
        return
    n = report.worst_bucket_requests
    print(f"  worst bucket   {report.worst_bucket}: {n} request{'' if n == 1 else 's'}")
    print(f"  in Prometheus  {report.worst_bucket_graph}")
    for url in report.worst_bucket_exemplars:
        print(f"  exemplar       {url}")
    print("  worst requests (the PromQL of its bucket; its trace in Phoenix):")
    width = max(len(w.request_id) for w in report.worst)
    for w in report.worst:
        marks = ", ".join(m for m, on in (("an exemplar", w.exemplar), ("NOT in Phoenix", not w.in_phoenix)) if on)
        print(
            f"    {w.request_id:<{width}} {w.preemptions:3d} preemptions  {w.bucket}  {w.trace_url}"
            + (f"  ({marks})" if marks else "")
        )
