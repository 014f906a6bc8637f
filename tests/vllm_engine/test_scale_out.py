"""Many processes, one truth, on vLLM's real engine: ``vllm serve --api-server-count 2`` and
``vllm serve --data-parallel-size 2`` (two engine cores, and as many API servers).

Every API-server process loads the plugin and pushes OTLP with its own ``service.instance.id``
to one receiver. Summed over the processes, per ``engine``, the plugin's totals equal vLLM's own
aggregated /metrics (its Prometheus multiprocess registry); every request has exactly one span,
in the caller's trace, whichever process served it.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from tests.support.backends import start_otlp_sink, wait_until

from otel_llm.integrations.vllm_server import MODEL_NAME, Load, VllmServer, run_load, scrape, traceparent

LOAD = Load(requests=32, concurrency=32, max_tokens=48, seed=3)
# Counters and histograms whose sums over processes must equal vLLM's aggregate (sample names).
SUMMED = ("vllm:request_success_total", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
          "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total", "vllm:request_num_preemptions_count",
          "vllm:request_num_preemptions_sum", "vllm:e2e_request_latency_seconds_count",
          "vllm:request_generation_tokens_sum")


def _summed_over_processes(sink: Any) -> tuple[dict[tuple[str, frozenset], float], set[str]]:
    """The last export of each process, summed over processes, as Prometheus sample names."""
    last: dict[tuple[str, str, frozenset], float] = {}
    with sink.lock:
        requests = list(sink.metrics)
    for request in requests:
        for rm in request.resource_metrics:
            instance = next(a.value.string_value for a in rm.resource.attributes if a.key == "service.instance.id")
            for m in (m for sm in rm.scope_metrics for m in sm.metrics):
                kind = m.WhichOneof("data")
                for p in getattr(m, kind).data_points:
                    labels = frozenset((a.key, a.value.string_value) for a in p.attributes)
                    if kind == "sum":
                        last[(m.name + "_total", instance, labels)] = p.as_int or p.as_double
                    elif kind == "histogram":
                        last[(m.name + "_count", instance, labels)] = p.count
                        last[(m.name + "_sum", instance, labels)] = p.sum
    totals: dict[tuple[str, frozenset], float] = defaultdict(float)
    for (name, _, labels), value in last.items():
        totals[(name, labels)] += value
    return dict(totals), {instance for _, instance, _ in last}


@pytest.fixture(scope="module", params=[["--api-server-count", "2"], ["--data-parallel-size", "2"]],
                ids=["api-server-count-2", "data-parallel-size-2"])
def scaled(request: Any, tiny_model: Path) -> dict[str, Any]:
    with start_otlp_sink("grpc") as sink:
        env = {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_TRACES_EXPORTER": "otlp",
               "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
               "OTEL_METRIC_EXPORT_INTERVAL": "500", "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_LLM_VLLM_DEEP_HOOK": "1"}
        with VllmServer(tiny_model, env=env, args=request.param, cli=True) as server:
            completions = run_load(server.url, LOAD)
            assert [c.status for c in completions] == [200] * LOAD.requests
            theirs = {k: v for k, v in scrape(server.url + "/metrics").items() if k[0] in SUMMED}
            assert theirs

            def differ() -> dict:
                ours, _ = _summed_over_processes(sink)
                return {k: (v, ours.get(k)) for k, v in theirs.items() if ours.get(k) != v}

            # Each process exports every 0.5 s: wait for the exports after the load (bounded).
            try:
                wait_until(lambda: not differ(), 60, interval=0.25, what="the processes' exports")
            except TimeoutError:
                raise AssertionError(f"sums over processes differ from vLLM's: {differ()}") from None
            wait_until(lambda: len(sink.spans()) >= LOAD.requests, 60, interval=0.25, what="every request span")
            ours, instances = _summed_over_processes(sink)
            engines = {"0", "1"} if "--data-parallel-size" in request.param else {"0"}
            return {"theirs": theirs, "ours": ours, "instances": instances, "spans": list(sink.spans()),
                    "log": server.log_text(), "engines": engines}


def test_every_api_server_process_loads_the_plugin_with_its_own_identity(scaled: dict[str, Any]) -> None:
    assert len(scaled["instances"]) == 2
    loads = [line for line in scaled["log"].splitlines() if "otel_llm -> otel_llm.integrations.vllm" in line]
    assert len(loads) == 2


def test_totals_over_processes_equal_vllms_aggregated_metrics_per_engine(scaled: dict[str, Any]) -> None:
    theirs, ours = scaled["theirs"], scaled["ours"]
    differ = {k: (v, ours.get(k)) for k, v in theirs.items() if ours.get(k) != v}
    assert not differ, differ
    success = sum(v for (name, _), v in theirs.items() if name == "vllm:request_success_total")
    assert success == LOAD.requests
    assert sum(v for (name, _), v in theirs.items() if name == "vllm:num_preemptions_total") > 0
    assert {dict(labels)["engine"] for (_, labels) in theirs} == scaled["engines"]
    assert all(dict(labels)["model_name"] == MODEL_NAME for _, labels in theirs)


def test_one_span_per_request_in_the_callers_trace_whichever_process_served_it(scaled: dict[str, Any]) -> None:
    spans = [s for s in scaled["spans"] if s.name == "llm_request"]
    assert len(spans) == LOAD.requests
    by_trace = {s.trace_id.hex(): s for s in spans}
    for i in range(LOAD.requests):
        _, trace_id, span_id = traceparent(i, LOAD.seed)
        assert by_trace[trace_id].parent_span_id.hex() == span_id
