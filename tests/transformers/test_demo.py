"""`otel-llm demo --engine transformers` (`make demo-transformers`): `make demo`'s summary on
transformers' real continuous batching: the telemetry equals the engine's own eviction count, and
the worst evictors it lists are the engine's, as a record taken at its preemption point
(``OffloadingManager.offload_requests``, beneath the instrumentor) has them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_llm.cli.main import main
from tests.engine.test_demo import check_evictors, parse_evictors
from tests.transformers.test_attribution import PreemptionRecord, record  # noqa: F401 - record: a fixture


def test_demo_on_transformers(
    record: PreemptionRecord,  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import otel_llm.export.setup

    exported = InMemorySpanExporter()
    setup_telemetry = otel_llm.export.setup.setup_telemetry

    def setup_also_in_memory(*args: Any, extra_span_processors: Any = (), **kwargs: Any) -> Any:
        processors = [*extra_span_processors, SimpleSpanProcessor(exported)]
        return setup_telemetry(*args, extra_span_processors=processors, **kwargs)

    monkeypatch.setattr(otel_llm.export.setup, "setup_telemetry", setup_also_in_memory)
    assert main(["demo", "--engine", "transformers", "--requests", "16", "--prometheus-port", "0"]) == 0
    out = capsys.readouterr().out
    assert "otel-llm demo: transformers continuous batching, 6 KV blocks" in out
    assert "ground truth   telemetry equals the engine" in out
    assert "requests per preemption count (llm.server.request.num_preemptions)" in out
    assert "worst requests" in out and "trace_id " in out

    # Whom each request evicted, by the record: the victims of the evictions it was a cause of
    # (no starved request left: the victim was its own cause).
    victims: dict[str, Counter[str]] = {}
    for victim, causes in record.preemptions:
        for cause in causes or (victim,):
            victims.setdefault(cause, Counter())[victim] += 1
    assert any(victim != c for c, of in victims.items() for victim in of)  # requests evicting others
    assert any(c in of for c, of in victims.items())  # and requests evicting themselves
    request_ids = {str((s.attributes or {}).get("gen_ai.request.id")) for s in exported.get_finished_spans()}
    caused = {r: record.caused(r) for r in request_ids}
    assert caused == {r: sum(victims.get(r, Counter()).values()) for r in request_ids}
    evictors = parse_evictors(out.splitlines())
    assert len(evictors) == 5
    check_evictors(evictors, caused, {r: victims.get(r, Counter()) for r in request_ids})
    traces = {
        str((s.attributes or {})["gen_ai.request.id"]): format(s.context.trace_id, "032x")
        for s in exported.get_finished_spans()
        if s.name == "llm_request" and s.context is not None
    }
    assert [e.trace_id for e in evictors] == [traces[e.request_id] for e in evictors]
