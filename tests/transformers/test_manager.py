"""The manager API (`init_continuous_batching`, `add_request` / `get_result`, streaming), the
caller's trace context, cancellation, a request that fails inside transformers, and a hard stop
with requests in flight, on transformers' real engine."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from tests.transformers.conftest import EngineTruth, Instrumented, cb_config, generation_config, prompts

MAX_NEW_TOKENS = 32


def collect(manager: Any, count: int) -> tuple[dict[str, Any], dict[str, int]]:
    """Every finished output (by id) and how many outputs each request delivered."""
    finished: dict[str, Any] = {}
    delivered: dict[str, int] = {}
    while len(finished) < count:
        result = manager.get_result(timeout=60)
        assert result is not None, f"no result within 60 s ({len(finished)} of {count} finished)"
        delivered[result.request_id] = delivered.get(result.request_id, 0) + 1
        if result.is_finished():
            finished[result.request_id] = result
    return finished, delivered


def test_add_request_get_result_streaming_and_trace_context(
    model: Any, engine_truth: EngineTruth, instrumented: Instrumented
) -> None:
    client = TracerProvider().get_tracer("client")
    manager = model.init_continuous_batching(generation_config(MAX_NEW_TOKENS), cb_config())
    manager.start()
    parents = {}
    try:
        ids = []
        for i, input_ids in enumerate(prompts(12, seed=2)):
            streaming = i % 2 == 0
            if i < 4:  # no id given: transformers names it; the caller's span is current
                with client.start_as_current_span(f"caller-{i}") as span:
                    rid = manager.add_request(input_ids, streaming=streaming)
                parents[rid] = span.get_span_context()
            else:
                rid = manager.add_request(input_ids, request_id=f"mine-{i}", streaming=streaming)
            ids.append(rid)
        finished, delivered = collect(manager, len(ids))
    finally:
        manager.stop(block=True, timeout=30)
    assert sorted(finished) == sorted(ids)
    truth = engine_truth.preemptions(ids)
    assert sum(truth.values()) == engine_truth.logged_evictions > 0
    for i, rid in enumerate(ids):
        # A streaming request delivers one output per token; the others one at the end.
        assert delivered[rid] == (MAX_NEW_TOKENS if i % 2 == 0 else 1), rid

    spans = instrumented.spans()
    assert sorted(spans) == sorted(ids)
    for rid, output in finished.items():
        span = spans[rid]
        assert span.attributes["llm.request.num_preemptions"] == truth[rid]
        assert span.attributes["gen_ai.usage.output_tokens"] == len(output.generated_tokens) == MAX_NEW_TOKENS
    for rid, parent in parents.items():
        assert spans[rid].parent is not None and spans[rid].parent.span_id == parent.span_id
        assert spans[rid].context.trace_id == parent.trace_id
    assert all(spans[rid].parent is None for rid in ids if rid not in parents)

    m = instrumented.metrics()
    h = m.histogram("request_num_preemptions")
    assert (h.count, h.sum) == (len(ids), sum(truth.values()))
    assert m.counter("num_recomputed_tokens") == engine_truth.recomputed_tokens(finished.values())
    # One inter-token latency per output token after the first.
    assert m.histogram("inter_token_latency_seconds").count == len(ids) * (MAX_NEW_TOKENS - 1)


def test_cancelled_failed_and_hard_stopped_requests_each_get_one_span(model: Any, instrumented: Instrumented) -> None:
    manager = model.init_continuous_batching(generation_config(MAX_NEW_TOKENS), cb_config(num_blocks=64))
    manager.start()
    try:
        bad = manager.add_request([1, 2, 3], request_id="bad", not_a_logits_processor_kwarg=1)
        assert bad == "bad"
        failed = manager.get_result(request_id="bad", timeout=60)
        assert failed is not None and failed.error is not None  # the engine's own verdict
        manager.add_request(prompts(1, seed=3)[0], request_id="cancelled", max_new_tokens=400, streaming=True)
        first = manager.get_result(request_id="cancelled", timeout=60)
        assert first is not None and not first.is_finished()
        manager.cancel_request("cancelled")
        for i, input_ids in enumerate(prompts(8, seed=4)):
            manager.add_request(input_ids, request_id=f"inflight-{i}", max_new_tokens=400, streaming=True)
        started: set[str] = set()
        while len(started) < 8:  # each has produced a token: running (a stop before would lose them unseen)
            result = manager.get_result(timeout=60)
            assert result is not None
            if result.request_id.startswith("inflight-"):
                started.add(result.request_id)
    finally:
        manager.stop(block=True, timeout=30, hard_stop=True)
    outputs = []
    while (result := manager.get_result(timeout=0)) is not None:
        if result.is_finished():
            outputs.append(result)
    hard_stopped = {o.request_id for o in outputs if o.request_id.startswith("inflight-")}
    assert hard_stopped == {f"inflight-{i}" for i in range(8)} and all(
        o.error for o in outputs if o.request_id in hard_stopped
    )

    spans = instrumented.spans()
    assert sorted(spans) == sorted({"bad", "cancelled", *hard_stopped})
    assert spans["bad"].attributes["gen_ai.response.finish_reasons"] == ("error",)
    assert spans["cancelled"].attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert all(spans[rid].attributes["gen_ai.response.finish_reasons"] == ("error",) for rid in hard_stopped)
    m = instrumented.metrics()
    assert m.counter("request_success", {"gen_ai.response.finish_reason": "error"}) == 1 + len(hard_stopped)
    assert m.counter("request_success", {"gen_ai.response.finish_reason": "abort"}) == 1
    assert m.counter("dropped_events") == 0
