"""Who evicted whom: each preemption attributed to the request(s) whose KV demand it served.

On engine_stub, against the engine's own record at its preemption point (``preempted_by``,
``num_preemptions_caused`` of each output): the ``preempted`` events name the cause, the victim's
span links to the cause's span with the victim's ordinal, every span counts the preemptions it
caused, the ``request_num_preemptions_caused`` histogram and the preemptions by cause hold the
engine's numbers, on both span paths. Then each edge case on its own: a cause that finished
first, one sampled out, a request that is its own cause, more links than the span limit, a cause
id never seen, a cache reset, a preemption storm, and the path of engines that hand over
summaries (vLLM), causes opened ahead included.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any, Sequence

import pytest
from opentelemetry.sdk.trace import SpanLimits
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

from engine_stub import Engine
from otel_llm import EventType as E
from otel_llm import RequestEvent, TelemetryConfig
from otel_llm.core import sink as sink_module
from otel_llm.summary import PreemptionCause, RequestSummary
from otel_llm.testing import in_memory_telemetry
from otel_llm.tracing.spans import LINKS_DROPPED
from tests.support.otel_helpers import attrs
from tests.support.workloads import add_requests, preempting_engine_config

BUCKETS = (0.5, 1, 2, 3, 4, 5, 10, 20)
SPAN_PATHS = pytest.mark.parametrize("span_path", ["auto", "tracer"], ids=["assembled", "tracer_api"])


def _rig(span_path: str = "auto", **kwargs: Any) -> Any:
    config = TelemetryConfig(model_name="tiny", preemption_buckets=BUCKETS)
    return in_memory_telemetry(config, span_path=span_path, **kwargs)


def _links(span: Any) -> list[tuple[int, int, int]]:
    """(ordinal, trace id, span id) of each preemption link of a finished span."""
    return [
        (link.attributes["llm.preemption.ordinal"], link.context.trace_id, link.context.span_id) for link in span.links
    ]


def _events(r: Any, request_id: str) -> list[dict[str, Any]]:
    return [dict(attrs(e.attributes)) for e in r.span(request_id).events if e.name == "preempted"]


@SPAN_PATHS
def test_engine_stub_every_preemption_names_its_cause_and_links_to_it(span_path: str) -> None:
    r = _rig(span_path)
    engine = Engine(preempting_engine_config())
    engine.hooks.subscribe(r.telemetry)
    add_requests(engine, 30)
    outputs = {o.request_id: o for o in engine.run()}
    truth_caused = {rid: o.num_preemptions_caused for rid, o in outputs.items()}
    kinds = Counter("self" if c == rid else "request" for rid, o in outputs.items() for c in o.preempted_by)
    assert sum(truth_caused.values()) == sum(o.num_preemptions for o in outputs.values()) >= 40
    assert kinds["self"] >= 1 and kinds["request"] >= 20  # both kinds happen in this load
    contexts = {rid: r.span(rid).context for rid in outputs}
    for rid, o in outputs.items():
        span = r.span(rid)
        assert span.attributes["llm.request.num_preemptions_caused"] == o.num_preemptions_caused, rid
        events = _events(r, rid)
        assert [e["cause_request_ids"] for e in events] == [(c,) for c in o.preempted_by], rid
        assert [e["cause"] for e in events] == ["self" if c == rid else "request" for c in o.preempted_by]
        expected = [
            (ordinal, contexts[c].trace_id, contexts[c].span_id)
            for ordinal, c in enumerate(o.preempted_by, 1)
            if c != rid  # its own cause: named, not linked
        ]
        assert _links(span) == expected, rid
        assert LINKS_DROPPED not in span.attributes
    metrics = r.metrics()
    hist = metrics.histogram("request_num_preemptions_caused")
    counts = [0] * (len(BUCKETS) + 1)
    for n in truth_caused.values():
        counts[bisect.bisect_left(BUCKETS, n)] += 1
    assert list(hist.bucket_counts) == counts and hist.sum == sum(truth_caused.values())
    assert hist.buckets[0.5] == list(truth_caused.values()).count(0)  # le=0.5: evicted nobody
    for kind in ("request", "self", "unknown", "cache_reset"):
        assert metrics.counter("num_preemptions_by_cause", cause=kind) == kinds.get(kind, 0), kind
    assert metrics.counter("dropped_events", reason="unknown_cause") == 0


def test_the_worst_evictors_bucket_has_an_exemplar_of_an_evictor_s_trace() -> None:
    r = _rig()
    engine = Engine(preempting_engine_config())
    engine.hooks.subscribe(r.telemetry)
    add_requests(engine, 30)
    caused = {o.request_id: o.num_preemptions_caused for o in engine.run()}
    point = r.point("request_num_preemptions_caused")
    worst = max(i for i, n in enumerate(point.bucket_counts) if n)
    low, high = (BUCKETS[worst - 1] if worst else 0), (BUCKETS[worst] if worst < len(BUCKETS) else float("inf"))
    by_trace = {r.span(rid).context.trace_id: rid for rid in caused}
    in_bucket = [e for e in point.exemplars if low < e.value <= high]
    assert in_bucket
    for exemplar in in_bucket:
        rid = by_trace[exemplar.trace_id]
        assert caused[rid] == exemplar.value and low < caused[rid] <= high


def _lifecycle_start(rid: str, t: float) -> list[RequestEvent]:
    return [RequestEvent(E.ARRIVED, rid, t, prompt_tokens=8, max_tokens=8), RequestEvent(E.SCHEDULED, rid, t)]


def _finish(rid: str, t: float) -> RequestEvent:
    return RequestEvent(E.FINISHED, rid, t, finish_reason="stop")


def _preempt(rid: str, t: float, *causes: str, kind: str = "") -> RequestEvent:
    return RequestEvent(
        E.PREEMPTED, rid, t, num_computed_tokens=4, reason="kv_cache_full", causes=causes, cause_kind=kind
    )


@SPAN_PATHS
def test_a_cause_that_finished_first_is_linked_and_counted(span_path: str) -> None:
    r = _rig(span_path)
    r.telemetry.on_events([*_lifecycle_start("victim", 1.0), *_lifecycle_start("cause", 1.0)])
    r.telemetry.on_events([_preempt("victim", 2.0, "cause"), _finish("cause", 3.0)])
    r.telemetry.on_events([RequestEvent(E.SCHEDULED, "victim", 4.0), _finish("victim", 5.0)])
    cause = r.span("cause")
    assert cause.attributes["llm.request.num_preemptions_caused"] == 1
    assert _links(r.span("victim")) == [(1, cause.context.trace_id, cause.context.span_id)]
    assert r.span("victim").attributes["llm.request.num_preemptions_caused"] == 0


@SPAN_PATHS
def test_causes_credited_before_the_victims_event_count_once(span_path: str) -> None:
    """An engine core reports a preemption's cause at once; the victim's event comes with its
    next output, here after the cause finished: credited then, counted once, still linked."""
    r = _rig(span_path)
    r.telemetry.on_events([*_lifecycle_start("victim", 1.0), *_lifecycle_start("cause", 1.0)])
    r.telemetry.credit_causes("victim", 1, ("cause",))
    r.telemetry.on_events([_finish("cause", 3.0)])
    r.telemetry.on_events([_preempt("victim", 2.5, "cause"), RequestEvent(E.SCHEDULED, "victim", 4.0)])
    r.telemetry.credit_causes("victim", 2, ("victim",))
    r.telemetry.on_events([_preempt("victim", 4.5, "victim"), RequestEvent(E.SCHEDULED, "victim", 4.6)])
    r.telemetry.on_events([_finish("victim", 5.0)])
    cause, victim = r.span("cause"), r.span("victim")
    assert cause.attributes["llm.request.num_preemptions_caused"] == 1
    assert victim.attributes["llm.request.num_preemptions_caused"] == 1  # itself, once
    assert _links(victim) == [(1, cause.context.trace_id, cause.context.span_id)]
    assert r.histogram("request_num_preemptions_caused").sum == 2


@SPAN_PATHS
def test_a_cause_credited_before_it_arrived_is_credited_by_the_victims_event(span_path: str) -> None:
    """A preemption's cause record can be read ahead of the row that makes its cause arrive: the
    credit finds no cause in flight, so the victim's event credits it, once."""
    r = _rig(span_path)
    r.telemetry.on_events(_lifecycle_start("victim", 1.0))
    r.telemetry.credit_causes("victim", 1, ("cause",))
    r.telemetry.on_events(_lifecycle_start("cause", 1.5))
    r.telemetry.on_events([_preempt("victim", 2.0, "cause"), RequestEvent(E.SCHEDULED, "victim", 2.5)])
    r.telemetry.on_events([_finish("cause", 3.0), _finish("victim", 4.0)])
    assert r.span("cause").attributes["llm.request.num_preemptions_caused"] == 1
    assert r.histogram("request_num_preemptions_caused").sum == 1


class _SampleOut(Sampler):
    """Samples every request but the one named (the SDK passes the span's start attributes)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def should_sample(
        self,
        parent_context: Any,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Any = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        out = (attributes or {}).get("gen_ai.request.id") == self.request_id
        if out:
            return SamplingResult(Decision.DROP)
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)  # the span's attributes: as given

    def get_description(self) -> str:
        return "sample out one request"


@SPAN_PATHS
def test_a_cause_sampled_out_is_named_not_linked(span_path: str) -> None:
    r = _rig(span_path, sampler=_SampleOut("cause"))
    r.telemetry.on_events([*_lifecycle_start("victim", 1.0), *_lifecycle_start("cause", 1.0)])
    r.telemetry.on_events([_preempt("victim", 2.0, "cause"), RequestEvent(E.SCHEDULED, "victim", 3.0)])
    r.telemetry.on_events([_finish("cause", 4.0), _finish("victim", 5.0)])
    with pytest.raises(LookupError):
        r.span("cause")  # not recorded
    assert _events(r, "victim")[0]["cause_request_ids"] == ("cause",)
    assert _links(r.span("victim")) == []
    assert r.counter("num_preemptions_by_cause", cause="request") == 1
    assert r.histogram("request_num_preemptions_caused").sum == 1  # the cause still counts


@SPAN_PATHS
def test_a_request_that_is_its_own_cause(span_path: str) -> None:
    r = _rig(span_path)
    r.telemetry.on_events(_lifecycle_start("big", 1.0))
    r.telemetry.on_events([_preempt("big", 2.0, "big"), RequestEvent(E.SCHEDULED, "big", 3.0), _finish("big", 4.0)])
    span = r.span("big")
    assert _events(r, "big") == [
        {
            "ordinal": 1,
            "num_computed_tokens": 4,
            "reason": "kv_cache_full",
            "cause": "self",
            "cause_request_ids": ("big",),
        }
    ]
    assert _links(span) == []
    assert span.attributes["llm.request.num_preemptions_caused"] == 1
    assert r.counter("num_preemptions_by_cause", cause="self") == 1


@SPAN_PATHS
def test_more_links_than_the_span_limit_are_counted(span_path: str) -> None:
    r = _rig(span_path, span_limits=SpanLimits(max_links=2))
    causes = [f"c{i}" for i in range(5)]
    r.telemetry.on_events([*_lifecycle_start("victim", 1.0)] + [e for c in causes for e in _lifecycle_start(c, 1.0)])
    for i, c in enumerate(causes):
        r.telemetry.on_events([_preempt("victim", 2.0 + i, c), RequestEvent(E.SCHEDULED, "victim", 2.5 + i)])
    r.telemetry.on_events([_finish(c, 9.0) for c in causes] + [_finish("victim", 10.0)])
    span = r.span("victim")
    assert [ordinal for ordinal, _, _ in _links(span)] == [4, 5]  # as the SDK's: the newest kept
    assert span.dropped_links == 3 and span.attributes[LINKS_DROPPED] == 3
    assert len(_events(r, "victim")) == 5 and span.attributes["llm.request.num_preemptions"] == 5


def test_a_cause_never_seen_is_counted_without_a_link_or_an_exception() -> None:
    r = _rig()
    r.telemetry.on_events(_lifecycle_start("victim", 1.0))
    r.telemetry.on_events([_preempt("victim", 2.0, "ghost"), RequestEvent(E.SCHEDULED, "victim", 3.0)])
    r.telemetry.on_events([_finish("victim", 4.0)])
    assert r.counter("dropped_events", reason="unknown_cause") == 1
    assert _events(r, "victim")[0]["cause_request_ids"] == ("ghost",) and _links(r.span("victim")) == []
    assert r.counter("num_preemptions_by_cause", cause="request") == 1


def test_a_cause_that_is_no_request_and_one_the_engine_cannot_say() -> None:
    r = _rig()
    r.telemetry.on_events(_lifecycle_start("a", 1.0))
    r.telemetry.on_events([_preempt("a", 2.0, kind="cache_reset"), RequestEvent(E.SCHEDULED, "a", 3.0)])
    r.telemetry.on_events([_preempt("a", 4.0), RequestEvent(E.SCHEDULED, "a", 5.0), _finish("a", 6.0)])
    assert [e["cause"] for e in _events(r, "a")] == ["cache_reset", "unknown"]
    assert "cause_request_ids" not in _events(r, "a")[0]
    for kind, n in (("cache_reset", 1), ("unknown", 1), ("request", 0)):
        assert r.counter("num_preemptions_by_cause", cause=kind) == n
    assert r.span("a").attributes["llm.request.num_preemptions_caused"] == 0


@pytest.mark.parametrize("causes", [("x", 3), (7,), "ab"], ids=["not-a-string", "int", "one-string-not-a-tuple"])
def test_causes_that_are_not_request_ids_are_dropped_as_invalid(causes: Any) -> None:
    r = _rig()
    r.telemetry.on_events(_lifecycle_start("a", 1.0))
    r.telemetry.on_events([RequestEvent(E.PREEMPTED, "a", 2.0, causes=causes)])
    assert r.counter("dropped_events", reason="invalid_value") == 1


def test_a_preemption_storm_keeps_the_link_targets_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every running request preempted at once, again and again: the span contexts kept for
    links stay within their bound, the oldest let go."""
    monkeypatch.setattr(sink_module, "MAX_LINK_TARGETS", 50)
    r = _rig()
    t = 1.0
    for wave in range(10):
        rids = [f"w{wave}-{i}" for i in range(20)]
        r.telemetry.on_events([e for rid in rids for e in _lifecycle_start(rid, t)])
        # The first request's growth preempts every other one, all at once, then all finish.
        r.telemetry.on_events([_preempt(rid, t + 0.1, rids[0]) for rid in rids[1:]])
        r.telemetry.on_events([RequestEvent(E.SCHEDULED, rid, t + 0.2) for rid in rids[1:]])
        r.telemetry.on_events([_finish(rid, t + 0.3) for rid in rids])
        t += 1
    assert len(r.telemetry._sink._finished_causes) <= 50
    assert r.histogram("request_num_preemptions_caused").sum == 10 * 19
    assert r.counter("dropped_events", reason="unknown_cause") == 0


def _summary(rid: str, causes: Sequence[PreemptionCause] = (), caused: int = 0, t: float = 1.0) -> RequestSummary:
    return RequestSummary(
        request_id=rid,
        finish_reason="stop",
        arrival_time=t,
        finish_time=t + 1,
        num_preemptions=len(causes),
        preemptions=tuple((t + 0.5, 0, "kv_cache_full") for _ in causes),
        preemption_causes=tuple(causes),
        preemptions_by_cause=tuple(Counter(c.kind for c in causes).items()),
        num_preemptions_caused=caused,
    )


@pytest.mark.parametrize("cause_first", [True, False], ids=["cause-finished-first", "cause-opened-ahead"])
@SPAN_PATHS
def test_summaries_link_a_victim_to_its_cause(span_path: str, cause_first: bool) -> None:
    """The path of engines that hand over summaries (vLLM): a cause that finished first is found
    by its id; one still in flight has its span opened ahead (reserve_span), and its summary
    later ends that very span."""
    r = _rig(span_path)
    tel = r.telemetry
    victim = _summary("victim", [PreemptionCause("request", ("cause",)), PreemptionCause("self", ("victim",))], 1)
    cause = _summary("cause", caused=1, t=0.5)
    if cause_first:
        tel.record_finished(cause)
        tel.record_finished(victim)
    else:
        tel.reserve_span("cause", 0.5)
        tel.record_finished(victim)
        tel.record_finished(cause)
    cause_span = r.span("cause")
    assert _links(r.span("victim")) == [(1, cause_span.context.trace_id, cause_span.context.span_id)]
    assert cause_span.start_time == r.telemetry.spans.wall_ns(0.5)
    assert [e["cause"] for e in _events(r, "victim")] == ["request", "self"]
    metrics = r.metrics()
    assert metrics.counter("num_preemptions_by_cause", cause="request") == 1
    assert metrics.counter("num_preemptions_by_cause", cause="self") == 1
    assert metrics.histogram("request_num_preemptions_caused").sum == 2
    assert len(r.span_exporter.get_finished_spans()) == 2  # the reserved span ended once


def test_a_summary_without_causes_counts_its_preemptions_unknown() -> None:
    r = _rig()
    r.telemetry.record_finished(
        RequestSummary("a", "stop", 1.0, 2.0, num_preemptions=3, preemptions=((1.5, 0, "kv_cache_full"),) * 3)
    )
    assert r.counter("num_preemptions_by_cause", cause="unknown") == 3
    assert [e["cause"] for e in _events(r, "a")] == ["unknown"] * 3
