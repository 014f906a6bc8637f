"""The drill-down on real back ends, both ways: from the worst bucket of ``request_num_preemptions``
in a real Prometheus to the victim's trace in a real trace store (Arize Phoenix), and on to the
traces of the requests that evicted it; and from the worst bucket of
``request_num_preemptions_caused`` straight to the worst evictor's trace.

engine_stub runs under KV pressure with the plugin (once for the module); Prometheus (exemplar
storage on) scrapes its endpoint in OpenMetrics; the spans go to Phoenix over OTLP/HTTP. The tests
read each worst bucket's exemplar from Prometheus's own API, fetch that trace from Phoenix's REST
API and check it against the engine's ground truth: the victim's preemption count and each
``preempted`` event (the engine's own PREEMPTED events, in order), the cause the engine recorded at
each preemption (its outputs' ``preempted_by``) and the preemptions each request caused
(``num_preemptions_caused``). Phoenix keeps no span links, so a victim leads to its evictor by the
request id its ``preempted`` event names; the span found there is the one the victim's span links
to as the SDK exported it. Then the bad input: Phoenix not installed, exiting, not ready in time;
a trace id that is not in the store.
"""

from __future__ import annotations

import os
import secrets
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_llm.events import EventType
from otel_llm.stack.drilldown import (
    bucket_counts,
    evictor_spans,
    exemplars_by_bucket,
    preemption_causes,
    worst_bucket,
)
from otel_llm.stack.phoenix import MISSING, PhoenixUnavailable, TraceNotFound, executable, start_phoenix
from tests.support.backends import backend, free_port, require_backend, start_prometheus, wait_until
from tests.support.phoenix import phoenix_backend
from tests.support.sdk_versions import needs_prometheus_exporter
from tests.support.workloads import NUM_REQUESTS, add_requests, preempting_engine_config

pytestmark = pytest.mark.backend

HISTOGRAM = "vllm:request_num_preemptions"
CAUSED = "vllm:request_num_preemptions_caused"
BOUNDS = (0.5, 1, 2, 3, 4, 5, 10, 20)
needs_exemplars = needs_prometheus_exporter("0.64b0", "exemplars on the Prometheus endpoint")


class EnginePreemptions:
    """The engine's own PREEMPTED events, by request, as (num_computed_tokens, reason) in order."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[tuple[int, str]]] = defaultdict(list)

    def on_events(self, events: Any) -> None:
        for event in events:
            if event.type is EventType.PREEMPTED:
                self.by_request[event.request_id].append((event.num_computed_tokens, event.reason))


@dataclass
class Run:
    outputs: dict[str, Any]  # the engine's outputs by request id: its ground truth
    truth: EnginePreemptions
    start: float  # wall clock
    instance: str  # PromQL matcher of the plugin's endpoint
    links: dict[str, list[tuple[int, str, str]]]  # request id: (ordinal, trace id, span id) of its span's links


@pytest.fixture(scope="module")
def phoenix():
    with phoenix_backend() as started:
        yield started


@pytest.fixture(scope="module")
def port():
    return free_port()


@pytest.fixture(scope="module")
def prometheus(port):
    with backend("prometheus"):
        with start_prometheus([f"127.0.0.1:{port}"], scrape_interval="1s", exemplars=True) as prom:
            yield prom


@pytest.fixture(scope="module")
def run(phoenix, prometheus, port) -> Iterator[Run]:
    """One engine run under KV pressure, its telemetry in Prometheus and Phoenix; the spans also
    kept in memory as the SDK exported them, for their links (which Phoenix does not keep)."""
    import otel_llm
    from engine_stub import Engine

    with pytest.MonkeyPatch.context() as env:
        for key in [k for k in os.environ if k.startswith(("OTEL_", "ENGINE_STUB_"))]:
            env.delenv(key)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        config = otel_llm.TelemetryConfig(
            model_name="tiny",
            preemption_buckets=BOUNDS,
            metrics_exporters=("prometheus",),
            traces_exporters=("otlp",),
            otlp_protocol="http/protobuf",
            otlp_endpoint=phoenix.otlp_endpoint,
            prometheus_port=port,
            exemplar_filter="trace_based",
        )
        exported = InMemorySpanExporter()
        handle = otel_llm.setup_telemetry(config, extra_span_processors=[SimpleSpanProcessor(exported)])
        instance = f'instance="127.0.0.1:{port}"'
        try:
            prometheus.wait_for(f"up{{{instance}}}", lambda r: r and r[0]["value"][1] == "1", timeout=20)
            engine = Engine(preempting_engine_config())
            truth = EnginePreemptions()
            engine.hooks.subscribe(truth)
            engine.hooks.subscribe(handle.telemetry)
            add_requests(engine)
            start = time.time()
            outputs = {o.request_id: o for o in engine.run()}
            assert handle.force_flush(), "spans not exported to Phoenix"
            for histogram in (HISTOGRAM, CAUSED):
                prometheus.wait_for(
                    f"{histogram}_count{{{instance}}}",
                    lambda r: len(r) == 1 and float(r[0]["value"][1]) == NUM_REQUESTS,
                    timeout=20,
                )
            links = {
                str((span.attributes or {})["gen_ai.request.id"]): _links(span)
                for span in exported.get_finished_spans()
                if span.name == "llm_request"
            }
            yield Run(outputs, truth, start, instance, links)
        finally:
            handle.shutdown()


def _links(span: Any) -> list[tuple[int, str, str]]:
    """(ordinal, trace id, span id) of each link of a span the SDK exported, ids in hex as Phoenix has them."""
    return [
        (
            int(link.attributes["llm.preemption.ordinal"]),
            format(link.context.trace_id, "032x"),
            format(link.context.span_id, "016x"),
        )
        for link in span.links
    ]


def _worst_exemplar(prometheus: Any, histogram: str, run: Run) -> tuple[str, dict[str, Any]]:
    """The worst non-empty bucket of ``histogram`` (as an operator finds it: the highest le whose
    count grows) and its newest exemplar (the last request recorded in it)."""
    le = worst_bucket(bucket_counts(prometheus, histogram, run.instance))
    assert le is not None
    return le, exemplars_by_bucket(prometheus, histogram, run.start, run.instance)[le][-1]


def _bucket(value: float) -> str:
    """The ``le`` label (as Prometheus shows it) of the bucket of BOUNDS holding ``value``."""
    return next((repr(float(b)) for b in BOUNDS if value <= b), "+Inf")


def _victim(phoenix: Any, prometheus: Any, run: Run) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The request span of the worst bucket's exemplar, its exemplar, the bucket's le."""
    le, exemplar = _worst_exemplar(prometheus, HISTOGRAM, run)
    trace_id = exemplar["labels"]["trace_id"]
    [span] = phoenix.wait_for_spans(trace_id, lambda found: any(s["name"] == "llm_request" for s in found))
    return span, exemplar, le  # the request span is the trace's root and only span


@needs_exemplars
def test_worst_bucket_exemplar_leads_to_the_request_span_in_phoenix(phoenix, prometheus, run) -> None:
    counts = {r: o.num_preemptions for r, o in run.outputs.items()}
    assert len(counts) == NUM_REQUESTS and max(counts.values()) > 10, counts  # the workload thrashes
    assert {r: len(run.truth.by_request.get(r, ())) for r in counts} == counts  # the engine agrees with itself

    span, exemplar, worst_le = _victim(phoenix, prometheus, run)
    assert worst_le == _bucket(max(counts.values()))
    request_id = span["attributes"]["gen_ai.request.id"]
    assert span["context"] == {"trace_id": exemplar["labels"]["trace_id"], "span_id": exemplar["labels"]["span_id"]}
    assert _bucket(float(exemplar["value"])) == worst_le
    assert span["attributes"]["llm.request.num_preemptions"] == counts[request_id] == float(exemplar["value"])
    events = [e for e in span["events"] if e["name"] == "preempted"]
    assert [e["attributes"]["ordinal"] for e in events] == list(range(1, counts[request_id] + 1))
    assert [(e["attributes"]["num_computed_tokens"], e["attributes"]["reason"]) for e in events] == (
        run.truth.by_request[request_id]
    )

    # Every request span, read back in pages of 7 (following next_cursor), holds its request's count.
    spans = wait_until(
        lambda: len(found := phoenix.spans(name="llm_request", page_size=7)) >= NUM_REQUESTS and found,
        30,
        interval=0.2,
        what=f"{NUM_REQUESTS} llm_request spans in Phoenix",
    )
    stored = {s["attributes"]["gen_ai.request.id"]: s["attributes"]["llm.request.num_preemptions"] for s in spans}
    assert len(spans) == NUM_REQUESTS and stored == counts


@needs_exemplars
def test_the_victims_trace_leads_on_to_the_traces_of_its_evictors(phoenix, prometheus, run) -> None:
    victim, _, _ = _victim(phoenix, prometheus, run)
    request_id = victim["attributes"]["gen_ai.request.id"]
    preempted_by = run.outputs[request_id].preempted_by  # the engine's cause of each preemption, in order
    kinds = ["self" if cause == request_id else "request" for cause in preempted_by]
    assert preemption_causes(victim) == [(n, kind, [c]) for n, (kind, c) in enumerate(zip(kinds, preempted_by), 1)]
    assert "links" not in victim  # Phoenix keeps none: the way on is the cause's request id

    found = evictor_spans(phoenix, victim)
    expected = [(ordinal, cause) for ordinal, cause in enumerate(preempted_by, 1) if cause != request_id]
    assert expected  # the worst victim was also evicted by another request, not only by itself
    assert [(ordinal, span["attributes"]["gen_ai.request.id"]) for ordinal, span in found] == expected
    # The span reached is the very one the victim's span links to.
    assert [(o, s["context"]["trace_id"], s["context"]["span_id"]) for o, s in found] == run.links[request_id]
    for _, span in found:
        evictor = span["attributes"]["gen_ai.request.id"]
        assert span["attributes"]["llm.request.num_preemptions_caused"] == run.outputs[evictor].num_preemptions_caused


@needs_exemplars
def test_worst_caused_bucket_exemplar_leads_to_the_worst_evictors_trace(phoenix, prometheus, run) -> None:
    caused = {r: o.num_preemptions_caused for r, o in run.outputs.items()}
    assert sum(caused.values()) == sum(o.num_preemptions for o in run.outputs.values())  # each has one cause here
    worst_le, exemplar = _worst_exemplar(prometheus, CAUSED, run)
    assert worst_le == _bucket(max(caused.values()))
    assert _bucket(float(exemplar["value"])) == worst_le

    trace_id = exemplar["labels"]["trace_id"]
    [span] = phoenix.wait_for_spans(trace_id, lambda found: any(s["name"] == "llm_request" for s in found))
    evictor = span["attributes"]["gen_ai.request.id"]
    assert span["context"] == {"trace_id": trace_id, "span_id": exemplar["labels"]["span_id"]}
    assert span["attributes"]["llm.request.num_preemptions_caused"] == caused[evictor] == float(exemplar["value"])

    # Whom it evicted: the victims' preempted events in Phoenix name it as often as the engine says,
    # and each other victim's span links to this very span.
    victims = Counter(r for r, o in run.outputs.items() for cause in o.preempted_by if cause == evictor)
    assert sum(victims.values()) == caused[evictor]
    spans = wait_until(
        lambda: len(found := phoenix.spans(name="llm_request")) >= NUM_REQUESTS and found,
        30,
        interval=0.2,
        what=f"{NUM_REQUESTS} llm_request spans in Phoenix",
    )
    named = Counter(
        s["attributes"]["gen_ai.request.id"]
        for s in spans
        for _, _, causes in preemption_causes(s)
        if evictor in causes
    )
    assert named == victims
    target = (span["context"]["trace_id"], span["context"]["span_id"])
    linked = Counter(r for r, links in run.links.items() for _, *to in links if tuple(to) == target)
    assert linked == Counter({r: n for r, n in victims.items() if r != evictor})


def test_phoenix_runs_in_a_network_namespace_whose_only_interface_is_loopback(phoenix) -> None:
    relay = phoenix.relay.pid
    [server] = Path(f"/proc/{relay}/task/{relay}/children").read_text().split()
    assert os.readlink(f"/proc/{server}/ns/net") != os.readlink("/proc/self/ns/net")
    interfaces = [line.split(":")[0].strip() for line in Path(f"/proc/{server}/net/dev").read_text().splitlines()[2:]]
    assert interfaces == ["lo"]
    with urllib.request.urlopen(phoenix.url + "/healthz", timeout=5) as resp:  # its HTTP port, bridged
        assert resp.read() == b"OK"


def test_a_trace_not_in_the_store_fails_naming_its_trace_id(phoenix) -> None:
    trace_id = secrets.token_hex(16)
    with pytest.raises(TraceNotFound, match=f"trace {trace_id} not in Phoenix at .* after 1 s .0 spans"):
        phoenix.wait_for_spans(trace_id, bool, timeout_s=1.0)


def test_phoenix_not_installed_is_named_with_the_way_to_install_it(tmp_path) -> None:
    with pytest.raises(PhoenixUnavailable, match="Phoenix is not installed: run `make setup-phoenix`"):
        with start_phoenix(str(tmp_path / "no-such-phoenix")):
            pass


def test_phoenix_exiting_before_ready_is_named_with_its_exit_code() -> None:
    with pytest.raises(PhoenixUnavailable, match="Phoenix exited with 1 before it was ready"):
        with start_phoenix("/bin/false", ready_timeout_s=30):
            pass


def test_phoenix_not_ready_in_time_fails_in_ci_and_skips_elsewhere(monkeypatch) -> None:
    # The real Phoenix, given less time than it needs to start.
    if executable() is None:
        require_backend("phoenix", MISSING)
    for required, outcome in (("1", pytest.fail.Exception), ("", pytest.skip.Exception)):
        monkeypatch.setenv("OTEL_LLM_REQUIRE_BACKENDS", required)
        with pytest.raises(outcome, match=r"backend phoenix unavailable: Phoenix not ready at .*/healthz after 0.5 s"):
            with phoenix_backend(ready_timeout_s=0.5):
                pass
