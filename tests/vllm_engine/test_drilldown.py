"""The drill-down on vLLM's real engine, under each of vLLM's frontends (its Python API server, its
Rust frontend ``vllm-rs``): a real Prometheus (exemplar storage on) scrapes the plugin's endpoint
in the vLLM server, the plugin's spans go to a real Phoenix over OTLP/HTTP, and each client request
carries a W3C traceparent of its own.

The worst non-empty bucket (Prometheus's view of our histogram) is the worst of the frontend's own
``vllm:request_num_preemptions`` on its /metrics; its exemplar leads in Phoenix to one request span
with as many ``preempted`` events (ordinals 1..n) as its ``llm.request.num_preemptions`` and the
exemplar's value. Under the Python frontend the exemplar's trace is the trace one client request
started and our span is a child of the client's span; vllm-rs 0.32 forwards no trace context, so
there our span is a root of a trace of its own. All the request spans in Phoenix, read page by
page, add up to the frontend's own preemption counter.

One Phoenix for the module; the two servers run one after the other, each exporting into a Phoenix
project of its own (the ``openinference.project.name`` resource attribute).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from otel_llm.stack.phoenix import Phoenix
from otel_llm.testing.vllm.server import Load, VllmServer, run_load, rust_frontend_missing, scrape, traceparent
from tests.support.backends import backend, require_backend, start_prometheus, wait_until
from tests.support.phoenix import phoenix_backend

pytestmark = pytest.mark.backend

LOAD = Load(requests=48, concurrency=48, max_tokens=96, seed=3)
HISTOGRAM = "vllm:request_num_preemptions"
FRONTENDS = ("python", "rust")
Samples = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module")
def phoenix() -> Iterator[Phoenix]:
    with phoenix_backend() as started:
        yield started


def _counted(samples: Samples) -> Samples:
    """``samples`` where they count every request of the load, else nothing."""
    return samples if sum(v for (n, _), v in samples.items() if n == f"{HISTOGRAM}_count") == LOAD.requests else {}


@pytest.fixture(scope="module", params=FRONTENDS)
def drilled(request: pytest.FixtureRequest, tiny_model: Path, phoenix: Phoenix) -> Iterator[dict[str, Any]]:
    frontend = request.param
    if frontend == "rust" and (missing := rust_frontend_missing()) is not None:
        require_backend("vllm-rs", missing)
    project = f"drilldown-{frontend}"
    env = {
        "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={project}",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": phoenix.otlp_endpoint + "/v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_LLM_VLLM_DEEP_HOOK": "1",
    }
    server = VllmServer(tiny_model, env=env, rust_frontend=frontend == "rust")
    with backend("prometheus"), start_prometheus([server.metrics_url], scrape_interval="1s") as prometheus:
        start = time.time()
        with server:
            completions = run_load(server.url, LOAD)
            assert [c.status for c in completions] == [200] * LOAD.requests, server.log_tail()
            prometheus.wait_for(
                f"{HISTOGRAM}_count", lambda r: len(r) == 1 and float(r[0]["value"][1]) == LOAD.requests, 60
            )
            # The frontend's own /metrics (vllm-rs's under the Rust frontend), once it counts every request.
            vllm = wait_until(
                lambda: _counted(scrape(server.url + "/metrics")),
                60,
                interval=0.2,
                what="every request on vLLM's /metrics",
            )
            # Read while the target is up: Prometheus marks the series stale once it is gone.
            buckets = {r["metric"]["le"]: float(r["value"][1]) for r in prometheus.query(f"{HISTOGRAM}_bucket")}
            exemplars = prometheus.exemplars(f"{HISTOGRAM}_bucket", start - 60, time.time() + 60)
    # Every request span of this run, read back in pages of 10 (Phoenix stores what it receives in batches).
    spans = wait_until(
        lambda: (
            len(found := phoenix.spans(name="llm_request", project=project, page_size=10)) >= LOAD.requests and found
        ),
        60,
        interval=0.5,
        what=f"{LOAD.requests} llm_request spans in Phoenix project {project}",
    )
    yield {
        "frontend": frontend,
        "project": project,
        "phoenix": phoenix,
        "buckets": buckets,
        "exemplars": exemplars,
        "vllm": vllm,
        "spans": spans,
    }


def _per_bucket(cumulative: dict[str, float]) -> list[tuple[float, float]]:
    ordered = sorted((float(le), count) for le, count in cumulative.items())
    return [(le, count - below) for (le, count), below in zip(ordered, [0.0] + [c for _, c in ordered])]


def test_the_worst_buckets_exemplar_leads_to_its_request_span_in_phoenix(drilled: dict[str, Any]) -> None:
    ours = _per_bucket(drilled["buckets"])
    vllms = _per_bucket(
        {dict(labels)["le"]: v for (name, labels), v in drilled["vllm"].items() if name == f"{HISTOGRAM}_bucket"}
    )
    worst = [le for le, n in ours if n > 0][-1]
    assert worst == [le for le, n in vllms if n > 0][-1] and worst >= 1  # the load really thrashes somewhere
    [series] = [s for s in drilled["exemplars"] if float(s["seriesLabels"]["le"]) == worst]
    exemplar = series["exemplars"][-1]
    trace_id, span_id, value = exemplar["labels"]["trace_id"], exemplar["labels"]["span_id"], float(exemplar["value"])

    sent = {traceparent(i, LOAD.seed)[1]: traceparent(i, LOAD.seed)[2] for i in range(LOAD.requests)}
    if drilled["frontend"] == "python":
        assert trace_id in sent  # the trace a client request started
        parent = sent[trace_id]  # the client's span
    else:
        assert trace_id not in sent  # vllm-rs forwards no trace context: our span is a root
        parent = None
    phoenix, project = drilled["phoenix"], drilled["project"]
    [span] = wait_until(
        lambda: phoenix.spans(trace_id, name="llm_request", project=project),
        30,
        interval=0.2,
        what=f"the llm_request span of trace {trace_id} in Phoenix project {project}",
    )
    assert span["context"]["span_id"] == span_id and span["parent_id"] == parent
    count = span["attributes"]["llm.request.num_preemptions"]
    below = max((le for le, _ in ours if le < worst), default=0.0)
    assert count == value and below < count <= worst
    events = [e for e in span["events"] if e["name"] == "preempted"]
    assert [e["attributes"]["ordinal"] for e in events] == list(range(1, count + 1))
    assert {e["attributes"]["reason"] for e in events} <= {"kv_cache_full"}


def test_every_request_span_in_phoenix_adds_up_to_vllms_preemption_counter(drilled: dict[str, Any]) -> None:
    spans = drilled["spans"]
    assert len(spans) == LOAD.requests
    assert len({s["context"]["trace_id"] for s in spans}) == LOAD.requests
    total = sum((v for (name, _), v in drilled["vllm"].items() if name == "vllm:num_preemptions_total"), 0.0)
    assert sum(s["attributes"]["llm.request.num_preemptions"] for s in spans) == total > 0
