"""Tenants under `opentelemetry-instrument transformers serve --continuous-batching`, from a
request header (``OTEL_LLM_TENANT=header:X-Team``) and from the caller's W3C baggage
(``baggage:team``), one server per source, at most 2 distinct tenants.

Concurrent completions carry two tenants, a value too long, one not ASCII and none; once they are
done, more carry two new tenants (beyond the cap: ``other``) and a known one. The engine's
evictions cannot be counted from outside the server process (test_serve.py), so each request's
tenant is checked against what its client sent, and the per-tenant histograms and the tenant
matrix on /metrics against the spans' own counts and the causes their preemption events name."""

from __future__ import annotations

import urllib.parse
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from otel_llm.config import buckets
from tests.support.backends import wait_until
from tests.transformers.serving import MAX_TOKENS, Server, attributes, complete, request_spans, serve, trace_id

MAX_VALUES = 2
SOURCES = {"header": "header:X-Team", "baggage": "baggage:team"}
# Each request's tenant as its client sends it (None: not sent), in two rounds, and its label.
FIRST = ["acme", "acme", "acme", "globex corp", "globex corp", "globex corp", "x" * 65, "zürich", None, "acme"]
THEN = ["initech", "initech", "umbrella", "globex corp"]
LABEL = {
    "acme": "acme",
    "globex corp": "globex corp",
    "x" * 65: "invalid",  # longer than 64 characters
    "zürich": "invalid",  # not ASCII
    None: "unset",
    "initech": "other",  # the cap is taken by the first round's two tenants
    "umbrella": "other",
}
PROMPT_WORDS = ("alpha", "beta", "gamma", "delta")  # every prompt is made of these (serving.complete)


@pytest.fixture(scope="module", params=sorted(SOURCES))
def served(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Server]]:
    """(the source's kind, the server reading it)."""
    env = {"OTEL_LLM_TENANT": SOURCES[request.param], "OTEL_LLM_TENANT_MAX_VALUES": str(MAX_VALUES)}
    with serve(tiny_model_dir, tmp_path_factory.mktemp("serve") / "serve.log", env) as server:
        yield request.param, server


def tenant_headers(source: str, value: Optional[str]) -> dict[str, str]:
    """The request's headers for its tenant; the baggage has other entries, never read."""
    if source == "header":
        return {} if value is None else {"X-Team": value}
    entries = ["user=alice"] + ([] if value is None else [f"team={urllib.parse.quote(value)};ttl=60"]) + ["session=s1"]
    return {"baggage": ",".join(entries)}


def test_each_request_has_its_tenant_on_its_span_series_and_matrix(served: tuple[str, Server]) -> None:
    source, server = served
    sent = FIRST + THEN
    responses: list[dict[str, Any]] = []
    for first, values in ((0, FIRST), (len(FIRST), THEN)):  # the second round once the first is done
        with ThreadPoolExecutor(len(values)) as pool:
            responses += pool.map(
                lambda i: complete(server, i, trace_id(i), tenant_headers(source, sent[i])),
                range(first, first + len(values)),
            )
    ids = [f"http-{i}" for i in range(len(sent))]
    assert [r["id"] for r in responses] == ids
    assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in responses)

    spans = request_spans(server, ids)
    tenant = {rid: LABEL[value] for rid, value in zip(ids, sent)}
    assert {rid: attributes(spans[rid]).get("llm.tenant") for rid in ids} == tenant
    preemptions = {rid: int(attributes(spans[rid])["llm.request.num_preemptions"]) for rid in ids}
    matrix: Counter[tuple[str, str]] = Counter()  # (victim's tenant, cause's) from the spans' preemption events
    for rid in ids:
        events = [attributes(e) for e in spans[rid].events if e.name == "preempted"]
        assert len(events) == preemptions[rid]
        for event in events:
            causes = event.get("cause_request_ids", ())
            matrix[tenant[rid], tenant[causes[0]] if causes else "none"] += 1
    assert sum(matrix.values()) > 0  # 6 blocks of 16 tokens: the engine evicted

    def scraped() -> list[Any]:
        samples = server.samples()
        done = sum(s.value for s in samples if s.name == "llm_server_request_num_preemptions_count")
        return samples if done == len(sent) else []

    samples = wait_until(scraped, 30, interval=0.2, what="every request on /metrics")
    by_tenant = Counter(tenant.values())
    assert {
        s.labels["llm_tenant"]: s.value for s in samples if s.name == "llm_server_request_num_preemptions_count"
    } == by_tenant
    assert {s.labels["llm_tenant"]: s.value for s in samples if s.name == "llm_server_request_num_preemptions_sum"} == {
        t: sum(n for rid, n in preemptions.items() if tenant[rid] == t) for t in by_tenant
    }
    assert {
        (s.labels["llm_tenant"], float(s.labels["le"])): s.value
        for s in samples
        if s.name == "llm_server_request_num_preemptions_bucket"
    } == {
        (t, le): sum(1 for rid, n in preemptions.items() if tenant[rid] == t and n <= le)
        for t in by_tenant
        for le in (*buckets.REQUEST_NUM_PREEMPTIONS, float("inf"))
    }
    assert {
        (s.labels["llm_tenant"], s.labels["llm_cause_tenant"]): s.value
        for s in samples
        if s.name == "llm_server_preemptions_by_tenant_total"
    } == matrix
    assert [s.value for s in samples if s.name == "llm_server_preemptions_total"] == [sum(matrix.values())]

    # Only the named header or baggage entry is read: no other entry, and no prompt text, anywhere.
    values = [str(v) for rid in ids for v in attributes(spans[rid]).values()]
    values += [str(v) for rid in ids for e in spans[rid].events for v in attributes(e).values()]
    values += [v for s in samples for v in s.labels.values()]
    assert not [v for v in values if "alice" in v or "session" in v or any(w in v for w in PROMPT_WORDS)]
    log = server.log_text()
    assert log.count(f"more than {MAX_VALUES} distinct tenants") == 1, log[-3000:]
    assert "does not reach" not in log
