"""Request spans: one per request, preempted span events with ordinals, exemplars linking to them."""

from __future__ import annotations

from opentelemetry.trace import SpanKind, StatusCode

from otel_llm import TelemetryConfig
from otel_llm.testing import in_memory_telemetry, lifecycle
from tests.support.otel_helpers import E, RequestEvent, attrs

COUNTS = (0, 0, 1, 2, 2, 3, 7, 25)


def spans_by_id(r):
    return r.spans_by_request()


def test_one_span_per_request_with_exact_preempted_events():
    r = in_memory_telemetry()
    for i, k in enumerate(COUNTS):
        r.telemetry.on_events(lifecycle(f"r{i}", 10.0 + i, preemptions=k))
    spans = spans_by_id(r)
    assert len(spans) == len(COUNTS)
    for i, k in enumerate(COUNTS):
        span = spans[f"r{i}"]
        assert span.name == "llm_request" and span.kind is SpanKind.SERVER
        assert span.attributes["llm.request.num_preemptions"] == k
        assert span.attributes["gen_ai.request.model"] == "tiny"
        assert span.attributes["gen_ai.response.finish_reasons"] == ("stop",)
        preempted = [e for e in span.events if e.name == "preempted"]
        assert [e.attributes["ordinal"] for e in preempted] == list(range(1, k + 1))
        assert [e.timestamp for e in preempted] == sorted(e.timestamp for e in preempted)
        assert all(e.attributes["reason"] == "kv_cache_full" for e in preempted)
        assert [e.attributes["num_computed_tokens"] for e in preempted] == [10 + j for j in range(k)]
        assert len([e for e in span.events if e.name == "resumed"]) == k
        assert len([e for e in span.events if e.name == "first_token"]) == 1


def test_span_times_are_the_engine_times_on_the_wall_clock():
    r = in_memory_telemetry()
    r.telemetry.on_events(lifecycle("a", 1000.0, preemptions=1))
    span = spans_by_id(r)["a"]
    assert abs((span.end_time - span.start_time) - 0.095e9) < 1e3  # finish - arrival, in ns
    pre = [e for e in span.events if e.name == "preempted"][0]
    assert abs((pre.timestamp - span.start_time) - 0.012e9) < 1e3


def test_exact_count_survives_the_event_limit():
    r = in_memory_telemetry()
    r.telemetry.on_events(lifecycle("thrash", 0.0, preemptions=200))
    span = spans_by_id(r)["thrash"]
    assert span.attributes["llm.request.num_preemptions"] == 200
    assert len(span.events) == 128  # the SDK's default event limit dropped the rest
    assert span.dropped_events > 0


def test_exemplars_carry_the_request_trace_ids():
    r = in_memory_telemetry()
    for i, k in enumerate(COUNTS):
        r.telemetry.on_events(lifecycle(f"r{i}", 10.0 + i, preemptions=k))
    spans = spans_by_id(r)
    trace_ids = {s.context.trace_id: s for s in spans.values()}
    points = r.metrics()
    pre = points["vllm:request_num_preemptions"][0]
    assert pre.exemplars
    for ex in pre.exemplars:
        span = trace_ids[ex.trace_id]
        assert ex.span_id == span.context.span_id
        assert ex.value == span.attributes["llm.request.num_preemptions"]
    e2e = points["vllm:e2e_request_latency_seconds"][0]
    assert e2e.exemplars and all(ex.trace_id in trace_ids for ex in e2e.exemplars)
    # The worst bucket (> 20) links to the request preempted 25 times.
    worst = [ex for ex in pre.exemplars if ex.value > 20]
    assert [trace_ids[ex.trace_id].attributes["gen_ai.request.id"] for ex in worst] == ["r7"]


def test_parent_from_w3c_trace_context():
    r = in_memory_telemetry()
    parent_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    carrier = {"traceparent": f"00-{parent_trace}-00f067aa0ba902b7-01"}
    events = lifecycle("p", 5.0)
    events[0] = RequestEvent(E.ARRIVED, "p", 5.0, prompt_tokens=10, max_tokens=16, trace_context=carrier)
    r.telemetry.on_events(events)
    span = spans_by_id(r)["p"]
    assert format(span.context.trace_id, "032x") == parent_trace
    assert format(span.parent.span_id, "016x") == "00f067aa0ba902b7"


def test_error_finish_sets_error_status():
    r = in_memory_telemetry()
    r.telemetry.on_events(lifecycle("x", 1.0, finish_reason="error"))
    assert spans_by_id(r)["x"].status.status_code is StatusCode.ERROR


def test_no_text_unless_asked_then_truncated():
    def run(config):
        r = in_memory_telemetry(config)
        r.telemetry.on_events(
            [
                RequestEvent(E.ARRIVED, "t", 1.0, prompt_tokens=3, prompt_text="secret prompt " * 20),
                RequestEvent(E.SCHEDULED, "t", 1.1),
                RequestEvent(E.TOKENS, "t", 1.2, num_tokens=1),
                RequestEvent(E.FINISHED, "t", 1.3, finish_reason="stop", output_text="the answer"),
            ]
        )
        return spans_by_id(r)["t"].attributes

    plain = run(TelemetryConfig(model_name="m"))
    assert not any("secret" in str(v) or "answer" in str(v) for v in plain.values())
    recorded = run(TelemetryConfig(model_name="m", record_content=True, content_max_length=10))
    assert recorded["gen_ai.prompt"] == "secret pro"
    assert recorded["gen_ai.completion"] == "the answer"


def test_spans_off_still_counts_and_records_no_exemplar():
    r = in_memory_telemetry(TelemetryConfig(model_name="m", spans=False))
    r.telemetry.on_events(lifecycle("a", 1.0, preemptions=2))
    assert r.finished_spans() == ()
    p = r.point("vllm:request_num_preemptions")
    assert p.count == 1 and p.exemplars == []


def test_shutdown_ends_open_spans_once():
    r = in_memory_telemetry()
    r.telemetry.on_events(lifecycle("done", 1.0)[:3])  # arrived, queued, scheduled: in flight
    r.telemetry.shutdown()
    r.telemetry.shutdown()
    (span,) = r.finished_spans()
    assert attrs(span.attributes)["llm.request.incomplete"] == "shutdown"
    assert span.status.status_code is StatusCode.ERROR


def test_a_span_cut_short_says_what_its_request_had_done():
    """An engine core dead mid-request: the span ends marked, with its counts so far, and the
    telemetry goes on (end_in_flight, unlike shutdown)."""
    for span_path in ("auto", "tracer"):
        r = in_memory_telemetry(span_path=span_path)
        events = lifecycle("cut", 1.0, preemptions=2, tokens=5, prompt_tokens=9)
        r.telemetry.on_events(events[:-3])  # up to its first tokens, after both preemptions
        assert r.telemetry.end_in_flight("engine_dead") == 1
        r.telemetry.on_events(lifecycle("next", 9.0))
        spans = {attrs(s.attributes)["gen_ai.request.id"]: s for s in r.finished_spans()}
        cut = attrs(spans["cut"].attributes)
        assert cut["llm.request.incomplete"] == "engine_dead", span_path
        assert (cut["llm.request.num_preemptions"], cut["gen_ai.usage.input_tokens"]) == (2, 9), span_path
        assert [attrs(e.attributes)["ordinal"] for e in spans["cut"].events if e.name == "preempted"] == [1, 2]
        assert "llm.request.incomplete" not in attrs(spans["next"].attributes), span_path
