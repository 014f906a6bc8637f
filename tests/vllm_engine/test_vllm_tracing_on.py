"""vLLM's own tracing on (``--otlp-traces-endpoint``) beside the plugin: one ``llm_request`` span
per request (vLLM's), and ours, with the preemption events, an internal sibling
``llm_request.scheduling`` under the same caller span. Both export to one loopback sink."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from otel_llm.integrations.vllm.plan import SIBLING_SPAN_NAME
from otel_llm.testing.vllm.server import ADD_MODE, MODEL_NAME, Load, VllmServer, run_load, scrape, traceparent
from tests.support.backends import wait_until

LOAD = Load(requests=24, concurrency=24, max_tokens=96, seed=1)
SERVER, INTERNAL = 2, 1  # OTLP span kinds


@pytest.fixture(scope="module")
def traced(tiny_model: Path, otlp_sink: Any) -> tuple[list[Any], float]:
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_sink.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_LLM_VLLM_DEEP_HOOK": "1",
        **ADD_MODE,
    }
    with VllmServer(tiny_model, env=env, args=["--otlp-traces-endpoint", otlp_sink.endpoint]) as server:
        completions = run_load(server.url, LOAD)
        assert [c.status for c in completions] == [200] * LOAD.requests
        # vLLM also traces its start-up (worker init, model load, ...): count request spans only.
        wait_until(
            lambda: sum(s.name in ("llm_request", SIBLING_SPAN_NAME) for s in otlp_sink.spans()) >= 2 * LOAD.requests,
            120,
            interval=0.5,
            what="vLLM's and our request spans",
        )
        labels = frozenset({"model_name": MODEL_NAME, "engine": "0"}.items())
        preemptions = scrape(server.url + "/metrics")[("vllm:num_preemptions_total", labels)]
        return list(otlp_sink.spans()), preemptions


def test_exactly_one_llm_request_span_per_request_and_ours_beside_it(traced: tuple[list[Any], float]) -> None:
    spans, preemptions = traced
    for i in range(LOAD.requests):
        _, trace_id, span_id = traceparent(i, LOAD.seed)
        in_trace = [s for s in spans if s.trace_id.hex() == trace_id]
        requests = [s for s in in_trace if s.name == "llm_request"]
        ours = [s for s in in_trace if s.name == SIBLING_SPAN_NAME]
        assert len(requests) == 1 and requests[0].kind == SERVER, [s.name for s in in_trace]
        assert len(ours) == 1 and ours[0].kind == INTERNAL
        assert requests[0].parent_span_id.hex() == span_id == ours[0].parent_span_id.hex()
    events = sum(1 for s in spans if s.name == SIBLING_SPAN_NAME for e in s.events if e.name == "preempted")
    assert preemptions > 0
    assert events == preemptions
