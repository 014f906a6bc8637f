"""Who evicted whom on transformers' real continuous batching: every eviction's cause, link by link,
against a record taken at the engine's preemption point without otel-llm.

The record (``PreemptionRecord``) sits beneath the instrumentor, in
``OffloadingManager.offload_requests``: it notes each starved request that the engine pops (the
victims, in order) and the starved requests left when the call returns (the causes; none left:
each victim its own cause). The load (20 requests, 8 KV blocks of 16 tokens) has both kinds, and
an eviction with two causes.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest

from tests.transformers.conftest import EngineTruth, Instrumented, cb_config, generation_config
from tests.transformers.conftest import prompts as make_prompts
from tests.transformers.test_generate_batch import expected_buckets

NUM_REQUESTS = 20
MAX_NEW_TOKENS = 48
NUM_BLOCKS = 8


@dataclass
class PreemptionRecord:
    """(victim, causes) of each eviction, in the engine's order; causes () = its own."""

    preemptions: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)

    def of(self, victim: str) -> list[tuple[str, ...]]:
        """The causes of each of ``victim``'s evictions, ordinal 1 first."""
        return [causes for rid, causes in self.preemptions if rid == victim]

    def kind(self, causes: tuple[str, ...]) -> str:
        return "request" if causes else "self"

    def caused(self, request_id: str) -> int:
        """The evictions that ``request_id``'s KV demand caused, its own included."""
        return sum(request_id in causes if causes else rid == request_id for rid, causes in self.preemptions)


class _Popped(list):
    """The scheduler's starved requests, noting the id of each one popped."""

    def __init__(self, entries: list[Any], popped: list[str]) -> None:
        super().__init__(entries)
        self.popped = popped

    def pop(self, *args: Any) -> Any:
        entry = super().pop(*args)
        self.popped.append(entry[0].request_id)
        return entry


@pytest.fixture
def record(monkeypatch: pytest.MonkeyPatch) -> PreemptionRecord:
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    found = PreemptionRecord()
    original = OffloadingManager.offload_requests

    @functools.wraps(original)
    def offload_requests(manager: Any) -> Any:
        scheduler = manager.scheduler
        popped: list[str] = []
        scheduler.starved_requests = _Popped(scheduler.starved_requests, popped)
        result = original(manager)
        left = tuple(state.request_id for state, _ in scheduler.starved_requests)
        found.preemptions += [(victim, left) for victim in popped]
        return result

    monkeypatch.setattr(OffloadingManager, "offload_requests", offload_requests)
    return found


@pytest.fixture
def over_record(record: PreemptionRecord, instrumented: Instrumented) -> Instrumented:
    """The instrumentor, installed over the record (``record`` is set up first, so the
    instrumentor wraps the record's wrapper)."""
    return instrumented


def run(model: Any) -> dict[str, Any]:
    outputs = model.generate_batch(
        inputs=make_prompts(NUM_REQUESTS),
        generation_config=generation_config(MAX_NEW_TOKENS),
        continuous_batching_config=cb_config(NUM_BLOCKS),
        warmup=False,
    )
    assert len(outputs) == NUM_REQUESTS and all(o.error is None for o in outputs.values())
    return outputs


def _preempted(span: Any) -> list[Any]:
    return [e for e in span.events if e.name == "preempted"]


def _links(span: Any) -> list[tuple[int, int, int]]:
    return sorted(
        (link.attributes["llm.preemption.ordinal"], link.context.trace_id, link.context.span_id) for link in span.links
    )


def test_every_eviction_names_its_causes_and_links_to_them(
    model: Any, engine_truth: EngineTruth, record: PreemptionRecord, over_record: Instrumented
) -> None:
    outputs = run(model)
    # The record's victims are the requests the engine evicted (its soft resets), all of them.
    assert Counter(rid for rid, _ in record.preemptions) == +engine_truth.resets
    kinds = Counter(record.kind(causes) for _, causes in record.preemptions)
    assert kinds["self"] >= 1 and kinds["request"] >= 1  # both kinds happen in this load
    assert any(len(causes) >= 2 for _, causes in record.preemptions)  # and a set of causes
    assert all(rid not in causes for rid, causes in record.preemptions)  # a victim is never among the starved left

    spans = over_record.spans()
    assert sorted(spans) == sorted(outputs)
    contexts = {rid: span.context for rid, span in spans.items()}
    for rid, span in spans.items():
        mine = record.of(rid)
        events = _preempted(span)
        assert [e.attributes["ordinal"] for e in events] == list(range(1, len(mine) + 1)), rid
        assert [e.attributes["cause"] for e in events] == [record.kind(c) for c in mine], rid
        assert [tuple(e.attributes["cause_request_ids"]) for e in events] == [c or (rid,) for c in mine], rid
        expected = sorted(
            (ordinal, contexts[c].trace_id, contexts[c].span_id)
            for ordinal, causes in enumerate(mine, 1)
            for c in causes  # its own cause: named, not linked
        )
        assert _links(span) == expected, rid
        assert span.attributes["llm.request.num_preemptions_caused"] == record.caused(rid), rid

    m = over_record.metrics()
    caused = [record.caused(rid) for rid in outputs]
    h = m.histogram("request_num_preemptions_caused")
    assert (h.count, h.sum) == (NUM_REQUESTS, sum(caused))
    assert sum(caused) == sum(len(c) or 1 for _, c in record.preemptions)
    assert list(h.bucket_counts) == expected_buckets(caused, h.bounds)
    for kind in ("request", "self", "unknown", "cache_reset"):
        assert m.counter("num_preemptions_by_cause", {"llm.preemption.cause": kind}) == kinds.get(kind, 0), kind
    assert m.counter("num_preemptions") == len(record.preemptions)
    assert m.counter("dropped_events") == 0


class _Opaque:
    """A starved entry as another release might keep it: unpacks like a pair, is no tuple."""

    def __init__(self, pair: tuple[Any, int]) -> None:
        self.pair = pair

    def __iter__(self) -> Iterator[Any]:
        return iter(self.pair)


def test_starved_requests_not_as_relied_on_every_cause_unknown_one_warning(
    model: Any,
    engine_truth: EngineTruth,
    instrumented: Instrumented,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import threading

    from transformers.generation.continuous_batching.scheduler import Scheduler

    from otel_llm.integrations.transformers import observer

    monkeypatch.setattr(observer, "_warned", threading.Event())  # once per process: this test's own
    original = Scheduler._process_candidates

    @functools.wraps(original)
    def process_candidates(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(scheduler, *args, **kwargs)
        scheduler.starved_requests = [_Opaque(pair) for pair in scheduler.starved_requests]
        return result

    monkeypatch.setattr(Scheduler, "_process_candidates", process_candidates)
    with caplog.at_level(logging.WARNING, logger=observer.__name__):
        outputs = run(model)
    evictions = sum(engine_truth.resets.values())
    assert evictions >= NUM_REQUESTS // 2
    warnings = [r for r in caplog.records if r.name == observer.__name__]
    assert len(warnings) == 1 and "unknown" in warnings[0].getMessage()

    spans = instrumented.spans()
    for rid in outputs:
        events = _preempted(spans[rid])
        assert len(events) == engine_truth.resets[rid], rid
        assert all(e.attributes["cause"] == "unknown" and "cause_request_ids" not in e.attributes for e in events)
        assert not spans[rid].links and spans[rid].attributes["llm.request.num_preemptions_caused"] == 0
    m = instrumented.metrics()
    assert m.counter("num_preemptions_by_cause", {"llm.preemption.cause": "unknown"}) == evictions
    assert m.counter("num_preemptions") == evictions
