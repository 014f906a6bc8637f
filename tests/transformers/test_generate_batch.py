"""`model.generate_batch` on transformers' real continuous batching with too little KV cache: the
telemetry equals what the engine did (EngineTruth, observed without the instrumentor), exactly."""

from __future__ import annotations

import math
from typing import Any

from otel_llm.config import buckets
from tests.transformers.conftest import EngineTruth, Instrumented, cb_config, generation_config, prompts

NUM_REQUESTS = 20
MAX_NEW_TOKENS = 48


def run(model: Any, seed: int = 0, num_blocks: int = 6, num_requests: int = NUM_REQUESTS) -> dict[str, Any]:
    return model.generate_batch(
        inputs=prompts(num_requests, seed),
        generation_config=generation_config(MAX_NEW_TOKENS),
        continuous_batching_config=cb_config(num_blocks),
        warmup=False,
    )


def expected_buckets(counts: list[int], bounds: tuple[float, ...]) -> list[int]:
    found = [0] * (len(bounds) + 1)
    for n in counts:
        found[next((i for i, b in enumerate(bounds) if n <= b), len(bounds))] += 1
    return found


def test_generate_batch_equals_the_engine(model: Any, engine_truth: EngineTruth, instrumented: Instrumented) -> None:
    outputs = run(model)
    assert len(outputs) == NUM_REQUESTS and all(o.error is None for o in outputs.values())
    truth = engine_truth.preemptions(outputs)
    evictions = sum(truth.values())
    assert evictions == engine_truth.logged_evictions >= NUM_REQUESTS // 2  # real pressure: the engine's log agrees
    recomputed = engine_truth.recomputed_tokens(outputs.values())
    assert recomputed > 0

    m = instrumented.metrics()
    h = m.histogram("request_num_preemptions")
    assert h.bounds == buckets.REQUEST_NUM_PREEMPTIONS
    assert list(h.bucket_counts) == expected_buckets(list(truth.values()), h.bounds)
    assert h.bucket_counts[0] == sum(1 for n in truth.values() if n == 0)  # le=0.5: never evicted
    assert (h.count, h.sum) == (NUM_REQUESTS, evictions)
    assert m.counter("num_preemptions") == evictions
    assert m.counter("num_preemptions_by_reason", {"llm.preemption.reason": "kv_cache_full"}) == evictions
    assert m.counter("num_recomputed_tokens") == recomputed
    assert m.counter("generation_tokens") == sum(len(o.generated_tokens) for o in outputs.values())
    assert m.counter("prompt_tokens") == sum(len(o.prompt_ids) for o in outputs.values())
    assert m.counter("request_success", {"gen_ai.response.finish_reason": "length"}) == NUM_REQUESTS
    assert m.counter("dropped_events") == 0
    assert m.histogram("time_to_first_token_seconds").count == NUM_REQUESTS

    spans = instrumented.spans()
    assert sorted(spans) == sorted(outputs)
    thrown_away = 0
    for rid, output in outputs.items():
        span = spans[rid]
        events = [e for e in span.events if e.name == "preempted"]
        assert [e.attributes["ordinal"] for e in events] == list(range(1, truth[rid] + 1)), rid
        assert all(e.attributes["reason"] == "kv_cache_full" for e in events)
        assert span.attributes["llm.request.num_preemptions"] == truth[rid]
        assert span.attributes["gen_ai.usage.input_tokens"] == len(output.prompt_ids)
        assert span.attributes["gen_ai.usage.output_tokens"] == len(output.generated_tokens) == MAX_NEW_TOKENS
        assert span.attributes["gen_ai.response.finish_reasons"] == ("length",)
        assert span.attributes["gen_ai.provider.name"] == "transformers"
        thrown_away += sum(e.attributes["num_computed_tokens"] for e in events)
    assert thrown_away == recomputed

    # Exemplars: the histogram's observations point at the requests' traces.
    [point] = m.points("request_num_preemptions")
    trace_ids = {s.context.trace_id for s in spans.values()}
    assert point.exemplars and {e.trace_id for e in point.exemplars} <= trace_ids


def test_a_seeded_run_is_reproducible(model: Any, engine_truth: EngineTruth, instrumented: Instrumented) -> None:
    first = run(model, seed=1)
    first_truth = engine_truth.preemptions(first)
    first_spans = {rid: s.attributes["llm.request.num_preemptions"] for rid, s in instrumented.spans().items()}
    engine_truth.resets.clear()
    second = run(model, seed=1)
    assert {rid: o.generated_tokens for rid, o in first.items()} == {
        rid: o.generated_tokens for rid, o in second.items()
    }
    assert engine_truth.preemptions(second) == first_truth == first_spans
    h = instrumented.metrics().histogram("request_num_preemptions")
    assert (h.count, h.sum) == (2 * NUM_REQUESTS, 2 * sum(first_truth.values()))


def test_enough_kv_cache_no_eviction(model: Any, engine_truth: EngineTruth, instrumented: Instrumented) -> None:
    outputs = run(model, num_blocks=256)
    assert engine_truth.logged_evictions == 0 and sum(engine_truth.resets.values()) == 0
    m = instrumented.metrics()
    h = m.histogram("request_num_preemptions")
    assert h.bucket_counts[0] == h.count == len(outputs) == NUM_REQUESTS
    assert m.counter("num_preemptions") == 0 == m.counter("num_recomputed_tokens")
    assert engine_truth.recomputed_tokens(outputs.values()) == 0
    assert not math.isnan(m.point("kv_cache_usage_perc").value)


def test_a_tenant_source_is_the_model_or_refused_with_one_warning(model: Any, caplog: Any) -> None:
    """generate_batch hands over the model only (docs/tenants.md): with ``OTEL_LLM_TENANT=model``
    each request's series carry its model; any other source, a header or baggage too (no HTTP
    request here), is refused once, and the telemetry runs without a tenant label."""
    import dataclasses
    import logging

    from tests.transformers.conftest import CONFIG, instrument

    caplog.set_level(logging.WARNING)
    refused = ("priority", "header:x-team", "baggage:team")
    for tenant in ("model", *refused):
        found = instrument(dataclasses.replace(CONFIG, tenant=tenant))
        try:
            num_requests = NUM_REQUESTS if tenant == "model" else 2
            run(model, num_requests=num_requests)
            m = found.metrics()
            assert m.counter("request_success") == num_requests
            tenants = {p.attributes.get("llm.tenant") for p in m.points("request_success")}
            assert tenants == ({CONFIG.model_name} if tenant == "model" else {None}), tenant
        finally:
            found.instrumentor.uninstrument()
            found.meter_provider.shutdown()
            found.tracer_provider.shutdown()
    refusals = [r.getMessage() for r in caplog.records if "OTEL_LLM_TENANT" in r.getMessage()]
    assert refusals == [
        f"otel_llm: OTEL_LLM_TENANT={tenant} does not reach transformers generate_batch, which hands over model: "
        "no tenant label on any series"
        for tenant in refused
    ]
