"""`opentelemetry-instrument transformers serve --continuous-batching` end to end on a CPU: the
instrumentor loaded by its entry point, concurrent HTTP completions each with a `traceparent`,
spans over OTLP to a real receiver, metrics on the Prometheus endpoint.

What the engine reports here is what the HTTP client sees (request ids, token counts); its
evictions cannot be counted from outside the server process, so the telemetry's three views of
them (span attributes, span events, the node counter) are checked against each other, and the
exact count against the engine in test_generate_batch and test_manager."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.backends import wait_until
from tests.transformers.serving import MAX_TOKENS, Server, attributes, complete, request_spans, serve, trace_id

NUM_REQUESTS = 12


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(tiny_model_dir, tmp_path_factory.mktemp("serve") / "serve.log") as found:
        yield found


def test_serve_spans_parented_by_traceparent_and_metrics(server: Server) -> None:
    trace_ids = {i: trace_id(i) for i in range(NUM_REQUESTS)}
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        responses = list(pool.map(lambda i: complete(server, i, trace_ids[i]), range(NUM_REQUESTS)))
    assert [r["id"] for r in responses] == [f"http-{i}" for i in range(NUM_REQUESTS)]
    assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in responses)

    spans = request_spans(server, [f"http-{i}" for i in range(NUM_REQUESTS)])
    preempted_events = 0
    for i, response in enumerate(responses):
        span = spans[f"http-{i}"]
        attrs = attributes(span)
        assert span.trace_id.hex() == trace_ids[i] and span.parent_span_id.hex() == f"{i + 1:016x}"
        assert attrs["gen_ai.usage.output_tokens"] == response["usage"]["completion_tokens"]
        assert attrs["gen_ai.usage.input_tokens"] == response["usage"]["prompt_tokens"]
        assert attrs["gen_ai.provider.name"] == "transformers"
        events = [e for e in span.events if e.name == "preempted"]
        assert [attributes(e)["ordinal"] for e in events] == list(range(1, attrs["llm.request.num_preemptions"] + 1))
        preempted_events += len(events)

    def scraped() -> dict[str, float]:
        samples = {s.name: s.value for s in server.samples() if not s.labels.get("le")}
        return samples if samples.get("llm_server_request_num_preemptions_count") == NUM_REQUESTS else {}

    samples = wait_until(scraped, 30, interval=0.2, what="every request on /metrics")
    assert (
        samples["llm_server_request_num_preemptions_sum"] == samples["llm_server_preemptions_total"] == preempted_events
    )
    assert preempted_events > 0  # 6 blocks of 16 tokens: the engine evicted
    assert not any("llm_tenant" in s.labels for s in server.samples())  # no tenant source: no tenant label
