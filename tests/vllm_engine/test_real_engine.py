"""vLLM's real engine (CPU build) with the plugin found by its entry point, under real KV pressure.

One server for the module: the plugin serves its own /metrics and exports request spans over
OTLP/gRPC to a loopback sink, the deep hook on. The run: vLLM's and our /metrics scraped at
start, 64 concurrent completions with W3C ``traceparent`` headers (real preemptions), then a
streaming client that disconnects mid-stream, a request with a malformed ``traceparent``, and a
request vLLM rejects (prompt longer than the model). Then both endpoints again, and the spans.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from otel_llm.testing.span_receiver import span_attributes
from otel_llm.testing.vllm.server import (
    ADD_MODE,
    MAX_MODEL_LEN,
    MODEL_NAME,
    Completion,
    Load,
    VllmServer,
    run_load,
    scrape,
    traceparent,
)
from tests.support.backends import wait_until

LOAD = Load(requests=64, concurrency=64, max_tokens=96, seed=0)
ABORTED_TRACE = ("%032x" % 0xA807, "%016x" % 0xD15C)  # the disconnecting client's trace and span ids
Samples = dict[tuple[str, frozenset], float]


@dataclass
class Run:
    server: VllmServer
    vllm_start: Samples
    ours_start: Samples
    completions: list[Completion]
    streamed_chunks: int
    rejected_status: int
    malformed_status: int
    vllm: Samples
    ours: Samples
    ours_text: str
    spans: list[Any]


async def _disconnect_mid_stream(url: str) -> int:
    """A streaming completion whose client goes away after a few chunks (vLLM aborts it)."""
    import aiohttp

    trace_id, span_id = ABORTED_TRACE
    body = {"model": MODEL_NAME, "prompt": [7] * 20, "max_tokens": 200, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        response = await session.post(
            f"{url}/v1/completions", json=body, headers={"traceparent": f"00-{trace_id}-{span_id}-01"}
        )
        chunks = 0
        async for _line in response.content:
            chunks += 1
            if chunks >= 6:
                break
        response.close()
    return chunks


async def _post(url: str, body: dict, headers: dict[str, str]) -> int:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            await response.read()
            return response.status


def _success_total(samples: Samples) -> float:
    return sum(v for (name, _), v in samples.items() if name == "vllm:request_success_total")


@pytest.fixture(scope="module")
def run(tiny_model: Path, otlp_sink: Any) -> Run:
    server = VllmServer(
        tiny_model,
        env={
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_sink.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_LLM_VLLM_DEEP_HOOK": "1",
            **ADD_MODE,
        },
    )
    with server:
        vllm_start, ours_start = scrape(server.url + "/metrics"), scrape(server.metrics_url)
        completions = run_load(server.url, LOAD)
        failed = [c for c in completions if c.status != 200]
        assert not failed, f"{len(failed)} failed, e.g. {failed[0]}\n{server.log_tail()}"
        chunks = asyncio.run(_disconnect_mid_stream(server.url))
        # After the abort, so that the stat logger's next record() gives the aborted request its span.
        malformed = asyncio.run(
            _post(
                server.url,
                {"model": MODEL_NAME, "prompt": [9] * 10, "max_tokens": 5},
                {"traceparent": "00-not-a-trace-context"},
            )
        )
        rejected = asyncio.run(
            _post(server.url, {"model": MODEL_NAME, "prompt": [5] * (MAX_MODEL_LEN + 44), "max_tokens": 5}, {})
        )
        # Every request's span, the disconnected one's included (whether vLLM aborted it or, on a
        # slow machine, finished it before it saw the client go): every request is then done.
        wait_until(lambda: len(otlp_sink.spans()) >= LOAD.requests + 2, 120, interval=0.5, what="every request span")
        with urllib.request.urlopen(server.metrics_url, timeout=30) as response:
            ours_text = response.read().decode()
        return Run(
            server,
            vllm_start,
            ours_start,
            completions,
            chunks,
            rejected,
            malformed,
            scrape(server.url + "/metrics"),
            scrape(server.metrics_url),
            ours_text,
            list(otlp_sink.spans()),
        )


def _vllm_series_equal(vllm: Samples, ours: Samples) -> tuple[int, dict, list]:
    missing = sorted(k for k in vllm if k not in ours)
    differ = {k: (v, ours[k]) for k, v in vllm.items() if k in ours and ours[k] != v}
    return len(vllm), differ, missing


def test_every_vllm_series_is_on_our_endpoint_with_vllms_value_at_start(run: Run) -> None:
    vllm = {k: v for k, v in run.vllm_start.items() if k[0].startswith("vllm:")}
    n, differ, missing = _vllm_series_equal(vllm, run.ours_start)
    assert n > 300  # the zero series vLLM creates at start, all five finish reasons included
    assert not missing, missing[:10]
    assert not differ, differ


def test_every_vllm_series_equals_vllms_after_a_load_with_real_preemptions(run: Run) -> None:
    assert [c.status for c in run.completions] == [200] * LOAD.requests
    assert all(c.completion_tokens == LOAD.max_tokens for c in run.completions)
    vllm = {k: v for k, v in run.vllm.items() if k[0].startswith("vllm:")}
    n, differ, missing = _vllm_series_equal(vllm, run.ours)
    assert not missing, missing[:10]
    assert not differ, differ
    labels = frozenset({"model_name": MODEL_NAME, "engine": "0"}.items())
    preemptions = run.vllm[("vllm:num_preemptions_total", labels)]
    assert preemptions >= 10  # the KV cache is too small for 64 concurrent requests: real preemptions
    # Ours beyond vLLM: le=0.5 holds the never-preempted requests; the counts add up.
    count = run.ours[("vllm:request_num_preemptions_count", labels)]
    assert count == _success_total(run.vllm) >= LOAD.requests + 1
    assert run.ours[("vllm:request_num_preemptions_sum", labels)] == preemptions
    never = run.ours[("vllm:request_num_preemptions_bucket", labels | {("le", "0.5")})]
    once_or_never = run.ours[("vllm:request_num_preemptions_bucket", labels | {("le", "1.0")})]
    assert 0 < never <= once_or_never <= count


def test_each_request_span_is_a_child_of_the_callers_traceparent(run: Run) -> None:
    spans = [s for s in run.spans if s.name == "llm_request"]
    by_trace: dict[str, list] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id.hex(), []).append(s)
    for i in range(LOAD.requests):
        _, trace_id, span_id = traceparent(i, LOAD.seed)
        assert len(by_trace.get(trace_id, [])) == 1, f"request {i}: {len(by_trace.get(trace_id, []))} spans"
        assert by_trace[trace_id][0].parent_span_id.hex() == span_id
    # The malformed header: a 200 and a root span of its own, in a new trace.
    assert run.malformed_status == 200
    sent = {traceparent(i, LOAD.seed)[1] for i in range(LOAD.requests)} | {ABORTED_TRACE[0]}
    roots = [s for s in spans if s.trace_id.hex() not in sent]
    assert len(roots) == 1 and not roots[0].parent_span_id
    assert len(spans) == LOAD.requests + 2


def test_preempted_span_events_equal_vllms_preemption_counter(run: Run) -> None:
    labels = frozenset({"model_name": MODEL_NAME, "engine": "0"}.items())
    preemptions = run.vllm[("vllm:num_preemptions_total", labels)]
    spans = [s for s in run.spans if s.name == "llm_request"]
    events = [e for s in spans for e in s.events if e.name == "preempted"]
    assert len(events) == preemptions
    for s in spans:  # ordinals 1..n on each span, n = its llm.request.num_preemptions
        ordinals = [
            next(a.value.int_value for a in e.attributes if a.key == "ordinal")
            for e in s.events
            if e.name == "preempted"
        ]
        assert ordinals == list(range(1, len(ordinals) + 1))
        assert span_attributes(s).get("llm.request.num_preemptions", 0) == len(ordinals)


def test_a_client_disconnect_is_counted_as_vllm_counts_it_with_one_span(run: Run) -> None:
    assert run.streamed_chunks == 6
    labels = {"model_name": MODEL_NAME, "engine": "0"}
    for reason in ("abort", "stop", "length", "error", "repetition"):
        key = ("vllm:request_success_total", frozenset({**labels, "finished_reason": reason}.items()))
        assert run.ours[key] == run.vllm[key]
    trace_id, span_id = ABORTED_TRACE
    aborted = [s for s in run.spans if s.trace_id.hex() == trace_id]
    assert len(aborted) == 1  # one span, whichever way the request ended
    span = aborted[0]
    assert span.parent_span_id.hex() == span_id
    attrs = span_attributes(span)
    if attrs["gen_ai.response.finish_reasons"] == ["abort"]:
        # vLLM aborted it when the client went: it counts it nowhere, the deep hook gave it its span.
        assert _success_total(run.vllm) == LOAD.requests + 1
        assert 0 < attrs["gen_ai.usage.output_tokens"] < 200
    else:  # it finished before vLLM saw the client go (a busy machine): counted as it finished
        assert attrs["gen_ai.response.finish_reasons"] == ["length"]
        assert _success_total(run.vllm) == LOAD.requests + 2


def test_a_request_vllm_rejects_is_counted_nowhere_as_by_vllm(run: Run) -> None:
    assert run.rejected_status == 400
    assert _success_total(run.vllm) == _success_total(run.ours)
    labels = frozenset({"model_name": MODEL_NAME, "engine": "0"}.items())
    # Every request vLLM finished has its prompt observed; the rejected one never reached the engine.
    assert run.ours[("vllm:request_prompt_tokens_count", labels)] == _success_total(run.vllm)


def test_vllms_own_expected_metrics_list_passes_on_our_endpoint(run: Run, vllm_sdist: Path) -> None:
    """vLLM's test of its /metrics (tests/entrypoints/.../test_metrics.py): every name of its
    expected list appears, and cache_config_info carries its sizing labels."""
    source = (vllm_sdist / "tests/entrypoints/serve/instrumentator/test_metrics.py").read_text()
    tree = ast.parse(source)
    expected = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EXPECTED_METRICS_V1" for t in node.targets)
    )
    assert len(expected) > 40
    absent = [name for name in expected if name not in run.ours_text]
    assert not absent, absent
    info = [labels for (name, labels) in run.ours if name == "vllm:cache_config_info"]
    assert info
    for labels in info:
        assert dict(labels).get("kv_cache_size_tokens") not in (None, "None", "")
        assert dict(labels).get("kv_cache_max_concurrency") not in (None, "None", "")


def test_every_series_vllms_example_dashboards_query_is_on_our_endpoint(run: Run, vllm_sdist: Path) -> None:
    names: set[str] = set()
    for path in sorted((vllm_sdist / "examples/observability").rglob("*.json")):
        text = json.dumps(json.loads(path.read_text()))
        for expr in re.findall(r'"expr": "((?:[^"\\]|\\.)*)"', text):
            names.update(re.findall(r"vllm:[a-zA-Z0-9_:]+", expr))
    assert len(names) > 10
    ours = {name for name, _ in run.ours}
    vllm = {name for name, _ in run.vllm}
    queried = names & vllm  # names that vLLM 0.32 itself no longer exports stay empty on both sides
    assert len(queried) > 10
    absent = sorted(queried - ours)
    assert not absent, absent
