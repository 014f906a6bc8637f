"""Faults under vLLM's Rust frontend (the telemetry in ``vllm serve``'s own process, fed by the
engine core's stream): SIGTERM to ``vllm serve`` mid-load, and SIGKILL to the engine-core process
(an OOM kill) followed by the orchestrator's SIGTERM, as tests/vllm_engine/test_faults.py does for
the Python frontend (its load, its hold of the engine until 2 requests finished, its receiver).
Whatever ends a request, it has exactly one span: those that finished are ordinary spans, the
others marked ``shutdown`` or ``engine_dead``; the final metric export counts every request that
finished. vllm-rs forwards no trace context: the spans are known by the engine core's request id,
the client's completion id with a suffix."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

from otel_llm.testing.span_receiver import span_attributes
from otel_llm.testing.vllm.server import rust_frontend_missing
from tests.support.backends import require_backend
from tests.vllm_engine.test_faults import FINISHED_AT_FAULT, MAX_TOKENS, REQUESTS, Outcome, _run

# (fault, vLLM's arguments); with 2 engines the second is recorded in a process of its own, which
# the serve tells to end at its SIGTERM.
CASES = [
    pytest.param(("sigterm", []), id="sigterm"),
    pytest.param(("engine-kill", []), id="engine-kill"),
    pytest.param(("sigterm", ["--data-parallel-size", "2"]), id="sigterm-data-parallel-2"),
]


@pytest.fixture(scope="module", params=CASES)
def outcome(request: Any, tiny_model: Path) -> Iterator[tuple[str, int, Outcome]]:
    missing = rust_frontend_missing()
    if missing is not None:
        require_backend("vllm-rs", missing)
    fault, args = request.param
    yield fault, 2 if args else 1, _run(tiny_model, fault, args, False, rust_frontend=True)


def _client_id(span: Any) -> str:
    return str(span_attributes(span)["gen_ai.request.id"]).rsplit("-", 1)[0]


def test_one_span_per_request_whatever_ended_it(outcome: Any) -> None:
    fault, _, o = outcome
    ids = Counter(span_attributes(s)["gen_ai.request.id"] for s in o.spans)
    assert len(ids) == len(o.spans) == REQUESTS, ids.most_common(3)  # every request had reached the engine core
    streamed = {s.response_id: s for s in o.streams if s.chunks}
    assert len(streamed) >= FINISHED_AT_FAULT
    assert set(streamed) <= {_client_id(s) for s in o.spans}
    ended: Counter = Counter()
    for span in o.spans:
        a = span_attributes(span)
        events = [e for e in span.events if e.name == "preempted"]
        assert [span_attributes(e)["ordinal"] for e in events] == list(range(1, len(events) + 1))
        assert a["llm.request.num_preemptions"] == len(events)
        stream = streamed.get(_client_id(span))
        if "llm.request.incomplete" not in a:
            assert a["gen_ai.response.finish_reasons"] == ["length"] and a["gen_ai.usage.output_tokens"] == MAX_TOKENS
            ended["finished"] += 1
            continue
        assert stream is None or not stream.finished, "a request the client saw finish is marked incomplete"
        assert span.status.code == span.status.STATUS_CODE_ERROR
        ended[a["llm.request.incomplete"]] += 1
    assert ended["finished"] >= sum(s.finished for s in o.streams)
    cut = "shutdown" if fault == "sigterm" else "engine_dead"
    assert set(ended) == {"finished", cut} and ended[cut] > 0, ended


def test_final_metric_export_counts_every_request_that_finished(outcome: Any) -> None:
    _, engines, o = outcome
    assert o.success is not None, "no metric export reached the collector"
    finished = sum("llm.request.incomplete" not in span_attributes(s) for s in o.spans)
    assert o.success["length"] == finished >= FINISHED_AT_FAULT
    assert len(o.instances) == engines  # each engine an instance of its own
