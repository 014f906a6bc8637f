"""vLLM's Rust frontend (``vllm-rs``) in front of the real CPU engine, with the plugin installed
by its entry points, under real KV pressure.

One server for the module (``vllm serve`` with ``VLLM_USE_RUST_FRONTEND=1``): the engine core and
its worker are vLLM's Python, HTTP and /metrics are the Rust binary's. The run: the Rust /metrics
scraped at start, 64 concurrent completions with W3C ``traceparent`` headers (real preemptions),
the Rust /metrics again once every request is counted. The server stays up for the module's
tests; :class:`RustRun` holds what they compare (the scrapes, the completions, the server with
its environment, ports and log, the OTLP sink the plugin exports to).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import psutil
import pytest
from engine_record import Samples, read_record, recording_env

from otel_llm.testing.span_receiver import span_attributes
from otel_llm.testing.vllm.server import (
    MODEL_NAME,
    Completion,
    Load,
    VllmServer,
    run_load,
    rust_frontend_missing,
    scrape,
)
from tests.support.backends import require_backend, wait_until

LOAD = Load(requests=64, concurrency=64, max_tokens=96, seed=0)
LABELS = frozenset({"model_name": MODEL_NAME, "engine": "0"}.items())
SERVICE = "vllm-rust-frontend"  # this module's spans, in the session's shared OTLP sink
WORKER = "otel_llm.integrations.vllm.frontend.engine_worker"  # an engine's own recording process


@dataclass
class RustRun:
    server: VllmServer  # .env, .port, .metrics_port (the plugin's), .log_path, .log_text()
    otlp_sink: Any  # where the plugin exports spans (OTLP/gRPC)
    models: dict[str, Any]  # GET /v1/models, answered by vllm-rs
    rust_start: Samples  # the Rust /metrics before the load
    completions: list[Completion]
    rust: Samples  # the Rust /metrics once every request of the load is counted
    rust_text: str  # the same page as served
    healthy_s: float  # from start() to /health answering
    load_s: float  # the load's wall time
    log: str  # the server's stdout and stderr (vllm serve, engine core, worker, vllm-rs) after the load
    ours: Samples  # otel-llm's own /metrics (vllm serve's process) once it counts every request
    spans: dict[str, Any]  # otel-llm's llm_request spans by gen_ai.request.id (the engine core's request id)
    truth: list[dict[str, Any]]  # the engine core's preemptions as vLLM made them, in order


def _our_spans(sink: Any) -> dict[str, Any]:
    return {span_attributes(s)["gen_ai.request.id"]: s for s in sink.spans(SERVICE) if s.name == "llm_request"}


def _total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        return str(response.read().decode())


@pytest.fixture(scope="module")
def rust_run(tiny_model: Path, otlp_sink: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RustRun]:
    missing = rust_frontend_missing()
    if missing is not None:
        require_backend("vllm-rs", missing)
    truth_file = tmp_path_factory.mktemp("rust-truth") / "preemptions.jsonl"
    server = VllmServer(
        tiny_model,
        env={
            "OTEL_SERVICE_NAME": SERVICE,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_sink.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_LLM_VLLM_DEEP_HOOK": "1",
            **recording_env(truth_file),
        },
        rust_frontend=True,
    )
    started = time.monotonic()
    with server:  # start() bounded by its own deadline (600 s)
        healthy_s = time.monotonic() - started
        models = json.loads(_get_text(server.url + "/v1/models"))
        rust_start = scrape(server.url + "/metrics")
        started = time.monotonic()
        completions = run_load(server.url, LOAD)
        load_s = time.monotonic() - started
        failed = [c for c in completions if c.status != 200]
        assert not failed, f"{len(failed)} failed, e.g. {failed[0]}\n{server.log_tail()}"

        def counted() -> Samples:
            samples = scrape(server.url + "/metrics")
            return samples if _total(samples, "vllm:request_success_total") >= LOAD.requests else {}

        rust = wait_until(counted, 60, interval=0.2, what="every request on the Rust /metrics")

        def ours_counted() -> Samples:
            samples = scrape(server.metrics_url)
            return samples if _total(samples, "vllm:request_success_total") >= LOAD.requests else {}

        ours = wait_until(ours_counted, 60, interval=0.2, what="every request on otel-llm's /metrics")

        def all_spans() -> dict[str, Any]:
            found = _our_spans(otlp_sink)
            return found if len(found) >= LOAD.requests else {}

        spans = wait_until(all_spans, 60, interval=0.2, what="every request span over OTLP")
        yield RustRun(
            server,
            otlp_sink,
            models,
            rust_start,
            completions,
            rust,
            _get_text(server.url + "/metrics"),
            healthy_s,
            load_s,
            server.log_text(),
            ours,
            spans,
            read_record(truth_file),
        )


def test_the_rust_frontend_serves_http(rust_run: RustRun) -> None:
    assert [m["id"] for m in rust_run.models["data"]] == [MODEL_NAME]
    assert rust_run.models["data"][0]["owned_by"] == "vllm-frontend-rs"
    assert "Launching Rust frontend: " + str(rust_run.server.env["VLLM_RUST_FRONTEND_PATH"]) in rust_run.log
    assert rust_run.server.env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "600"


def test_the_rust_metrics_start_at_zero(rust_run: RustRun) -> None:
    start = rust_run.rust_start
    for name in (
        "vllm:request_success_total",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:num_preemptions_total",
        "vllm:request_num_preemptions_count",
    ):
        assert _total(start, name) == 0, name


def test_the_rust_metrics_count_the_load_as_the_clients_received_it(rust_run: RustRun) -> None:
    completions, rust = rust_run.completions, rust_run.rust
    assert [c.status for c in completions] == [200] * LOAD.requests
    assert [c.finish_reason for c in completions] == ["length"] * LOAD.requests
    assert [c.completion_tokens for c in completions] == [LOAD.max_tokens] * LOAD.requests
    success = {
        dict(labels)["finished_reason"]: v for (n, labels), v in rust.items() if n == "vllm:request_success_total"
    }
    assert sum(success.values()) == success["length"] == LOAD.requests
    generated = sum(c.completion_tokens for c in completions)
    assert rust[("vllm:generation_tokens_total", LABELS)] == generated
    assert rust[("vllm:request_generation_tokens_sum", LABELS)] == generated
    assert rust[("vllm:prompt_tokens_total", LABELS)] == sum(c.prompt_tokens for c in completions)
    assert rust[("vllm:request_prompt_tokens_count", LABELS)] == LOAD.requests


def test_the_rust_metrics_count_real_preemptions(rust_run: RustRun) -> None:
    rust = rust_run.rust
    preemptions = rust[("vllm:num_preemptions_total", LABELS)]
    assert preemptions > 0  # 12 blocks of 32 tokens for 64 concurrent requests
    assert rust[("vllm:request_num_preemptions_count", LABELS)] == LOAD.requests
    assert rust[("vllm:request_num_preemptions_sum", LABELS)] == preemptions
    buckets = sorted(
        (float(dict(labels)["le"]), v) for (n, labels), v in rust.items() if n == "vllm:request_num_preemptions_bucket"
    )
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[-1] == LOAD.requests


# The series both serve, and where they must agree exactly (latencies differ by construction:
# docs/vllm.md).
SHARED_TOTALS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:request_num_preemptions_count",
    "vllm:request_num_preemptions_sum",
    "vllm:request_prompt_tokens_count",
    "vllm:request_prompt_tokens_sum",
    "vllm:request_generation_tokens_count",
    "vllm:request_generation_tokens_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:time_to_first_token_seconds_count",
)


def test_otel_llm_counts_what_the_rust_frontend_counts(rust_run: RustRun) -> None:
    rust, ours = rust_run.rust, rust_run.ours
    for name in SHARED_TOTALS:
        assert ours.get((name, LABELS)) == rust[(name, LABELS)], name
    success = {dict(k)["finished_reason"]: v for (n, k), v in ours.items() if n == "vllm:request_success_total" and v}
    assert success == {"length": LOAD.requests}
    rust_buckets = {dict(k)["le"]: v for (n, k), v in rust.items() if n == "vllm:request_num_preemptions_bucket"}
    our_buckets = {dict(k)["le"]: v for (n, k), v in ours.items() if n == "vllm:request_num_preemptions_bucket"}
    assert {le: our_buckets[le] for le in rust_buckets} == rust_buckets
    never = sum(1 for span in rust_run.spans.values() if span_attributes(span)["llm.request.num_preemptions"] == 0)
    assert our_buckets["0.5"] == never  # the bucket vLLM's boundaries cannot give


def test_one_span_per_request_with_a_preempted_event_at_each_preemption(rust_run: RustRun) -> None:
    spans = rust_run.spans
    assert len(spans) == LOAD.requests
    by_victim = Counter(t["victim"] for t in rust_run.truth)
    for rid, span in spans.items():
        attributes = span_attributes(span)
        events = [span_attributes(e) for e in span.events if e.name == "preempted"]
        assert [e["ordinal"] for e in events] == list(range(1, by_victim[rid] + 1)), rid
        assert attributes["llm.request.num_preemptions"] == by_victim[rid], rid
        assert attributes["gen_ai.usage.output_tokens"] == LOAD.max_tokens, rid
        assert not span.parent_span_id  # vllm-rs forwards no trace context: roots
    assert sum(by_victim.values()) == rust_run.rust[("vllm:num_preemptions_total", LABELS)]


def test_every_preemption_names_its_cause_as_the_engine_core_recorded(rust_run: RustRun) -> None:
    spans, truth = rust_run.spans, rust_run.truth
    caused: Counter[str] = Counter()
    for t in truth:
        assert t["where"] == "schedule", t
        span = spans[t["victim"]]
        event = [span_attributes(e) for e in span.events if e.name == "preempted"][t["ordinal"] - 1]
        assert event["cause"] == ("self" if t["cause"] == t["victim"] else "request"), t
        assert event["cause_request_ids"] == [t["cause"]], t
        caused[t["cause"]] += 1
    for rid, span in spans.items():
        assert span_attributes(span)["llm.request.num_preemptions_caused"] == caused.get(rid, 0), rid
        links = [(span_attributes(link)["llm.preemption.ordinal"], link.span_id.hex()) for link in span.links]
        expected = [
            (t["ordinal"], spans[t["cause"]].span_id.hex())
            for t in sorted((t for t in truth if t["victim"] == rid), key=lambda t: t["ordinal"])
            if t["cause"] != rid
        ]
        assert links == expected, rid
    assert not {k: v for k, v in rust_run.ours.items() if "dropped_events" in k[0] and v}


def _last_exports(sink: Any, service: str) -> dict[str, dict[tuple[str, frozenset], float]]:
    """``service``'s last OTLP metric export per ``service.instance.id``: {instance: {(Prometheus
    sample name of a counter or a histogram's count, labels): value}}."""
    last: dict[str, dict[tuple[str, frozenset], float]] = {}
    with sink.lock:
        requests = list(sink.metrics)
    for request in requests:
        for rm in request.resource_metrics:
            resource = {a.key: a.value.string_value for a in rm.resource.attributes}
            if resource.get("service.name") != service:
                continue
            points = last.setdefault(resource["service.instance.id"], {})
            for m in (m for sm in rm.scope_metrics for m in sm.metrics):
                kind = m.WhichOneof("data")
                for p in getattr(m, kind).data_points if kind in ("sum", "histogram") else ():
                    labels = frozenset((a.key, a.value.string_value) for a in p.attributes)
                    name, value = (m.name + "_total", p.as_int) if kind == "sum" else (m.name + "_count", p.count)
                    points[(name, labels)] = value
    return last


def _span_instances(sink: Any, service: str) -> Counter[str]:
    """How many of ``service``'s request spans each ``service.instance.id`` exported."""
    with sink.lock:
        requests = list(sink.traces)
    found: Counter[str] = Counter()
    for rs in (rs for req in requests for rs in req.resource_spans):
        resource = {a.key: a.value.string_value for a in rs.resource.attributes}
        if resource.get("service.name") == service:
            found[resource["service.instance.id"]] += sum(
                1 for ss in rs.scope_spans for span in ss.spans if span.name == "llm_request"
            )
    return found


def test_data_parallel_engines_each_count_what_the_rust_frontend_counts(tiny_model: Path, otlp_sink: Any) -> None:
    """``--data-parallel-size 2``: both engine cores hand their stream to the one consumer in
    ``vllm serve``'s process. Each engine exports over OTLP as an instance of its own (the serve's
    ``service.instance.id``, ``-engine-N``), its series and spans only; on our one Prometheus
    endpoint and summed over the OTLP instances, each engine's series (label ``engine``) equal the
    Rust frontend's."""
    missing = rust_frontend_missing()
    if missing is not None:
        require_backend("vllm-rs", missing)
    service, names = "vllm-rust-dp", ("vllm:request_success_total", "vllm:num_preemptions_total")
    load = Load(requests=32, concurrency=32, max_tokens=64, seed=3)
    env = {
        "OTEL_SERVICE_NAME": service,
        "OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=serve-dp",
        "OTEL_METRICS_EXPORTER": "prometheus,otlp",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_sink.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    with VllmServer(tiny_model, args=["--data-parallel-size", "2"], env=env, rust_frontend=True) as server:
        # Engine 1 is recorded in a process of its own, a child of the serve's, started before its engine core.
        workers = [p for p in psutil.Process(server.proc.pid).children() if WORKER in p.cmdline()]
        assert [p.cmdline()[-2] for p in workers] == ["1"]
        completions = run_load(server.url, load)
        assert [c.status for c in completions] == [200] * load.requests, server.log_tail()

        def everywhere() -> Optional[tuple[Samples, Samples, dict[str, Any]]]:
            rust, ours, pushed = (
                scrape(server.url + "/metrics"),
                scrape(server.metrics_url),
                _last_exports(otlp_sink, service),
            )
            counted = (sum(_total(p, names[0]) for p in pushed.values()), *(_total(s, names[0]) for s in (rust, ours)))
            done = (
                counted == (load.requests,) * 3 and sum(_span_instances(otlp_sink, service).values()) == load.requests
            )
            return (rust, ours, pushed) if done else None

        rust, ours, pushed = wait_until(
            everywhere, 60, interval=0.2, what="every request on both /metrics and over OTLP"
        )
    assert not workers[0].is_running()  # ended with the serve
    assert sorted(pushed) == ["serve-dp-engine-0", "serve-dp-engine-1"]
    for name in (*names, "vllm:request_num_preemptions_count"):
        theirs = {k: v for (n, k), v in rust.items() if n == name and v}
        assert {k: v for (n, k), v in ours.items() if n == name and v} == theirs, name
        for instance, points in pushed.items():  # each instance holds its own engine's series only
            engine = instance.rsplit("-", 1)[1]
            assert {k: v for (n, k), v in points.items() if n == name and v} == {
                k: v for k, v in theirs.items() if dict(k)["engine"] == engine
            }, (name, instance)
    served: Counter[str] = Counter()
    for (n, k), v in rust.items():
        if n == names[0]:
            served[dict(k)["engine"]] += int(v)
    assert sorted(+served) == ["0", "1"]  # both engines served
    spans = {instance.rsplit("-", 1)[1]: n for instance, n in _span_instances(otlp_sink, service).items()}
    assert spans == dict(+served)  # each request's span from its engine's instance
