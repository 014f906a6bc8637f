"""The drill-down on real back ends: from the worst bucket of ``request_num_preemptions`` in a real
Prometheus to the request's trace in a real trace store (Arize Phoenix).

engine_stub runs under KV pressure with the plugin; Prometheus (exemplar storage on) scrapes its
endpoint in OpenMetrics; the spans go to Phoenix over OTLP/HTTP. The test reads the exemplar of
the worst non-empty bucket from Prometheus's own API, fetches that trace from Phoenix's REST API
and checks the request span against the engine's ground truth: its preemption count (the engine's
output) and each ``preempted`` event (the engine's own PREEMPTED events, in order). Then the bad
input: Phoenix not installed, exiting, not ready in time; a trace id that is not in the store.
"""

from __future__ import annotations

import math
import os
import secrets
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from otel_llm.events import EventType
from otel_llm.stack.phoenix import MISSING, PhoenixUnavailable, TraceNotFound, executable, start_phoenix
from tests.support.backends import backend, free_port, require_backend, start_prometheus, wait_until
from tests.support.phoenix import phoenix_backend
from tests.support.sdk_versions import needs_prometheus_exporter
from tests.support.workloads import NUM_REQUESTS, add_requests, preempting_engine_config

pytestmark = pytest.mark.backend

HISTOGRAM = "vllm:request_num_preemptions"
BOUNDS = (0.5, 1, 2, 3, 4, 5, 10, 20)


class EnginePreemptions:
    """The engine's own PREEMPTED events, by request, as (num_computed_tokens, reason) in order."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[tuple[int, str]]] = defaultdict(list)

    def on_events(self, events: Any) -> None:
        for event in events:
            if event.type is EventType.PREEMPTED:
                self.by_request[event.request_id].append((event.num_computed_tokens, event.reason))


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


def _bucket_of(value: float) -> str:
    """The ``le`` label (as Prometheus shows it) of the bucket holding ``value``."""
    bound = next((b for b in BOUNDS if value <= b), math.inf)
    return "+Inf" if bound == math.inf else repr(float(bound))


@needs_prometheus_exporter("0.64b0", "exemplars on the Prometheus endpoint")
def test_worst_bucket_exemplar_leads_to_the_request_span_in_phoenix(phoenix, prometheus, port, clean_env) -> None:
    import otel_llm
    from engine_stub import Engine

    clean_env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
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
    handle = otel_llm.setup_telemetry(config)
    instance = f'instance="127.0.0.1:{port}"'
    try:
        prometheus.wait_for(f"up{{{instance}}}", lambda r: r and r[0]["value"][1] == "1", timeout=20)
        engine = Engine(preempting_engine_config())
        truth = EnginePreemptions()
        engine.hooks.subscribe(truth)
        engine.hooks.subscribe(handle.telemetry)
        add_requests(engine)
        start = time.time()
        outputs = engine.run()
        assert handle.force_flush(), "spans not exported to Phoenix"
        counts = {o.request_id: o.num_preemptions for o in outputs}
        assert len(counts) == NUM_REQUESTS and max(counts.values()) > 10, counts  # the workload thrashes
        assert {r: len(truth.by_request.get(r, ())) for r in counts} == counts  # the engine agrees with itself

        prometheus.wait_for(
            f"{HISTOGRAM}_count{{{instance}}}",
            lambda r: len(r) == 1 and float(r[0]["value"][1]) == NUM_REQUESTS,
            timeout=20,
        )
        # The worst non-empty bucket, as an operator finds it: the highest le whose count grows.
        cumulative = sorted(
            (float(r["metric"]["le"]), float(r["value"][1]), r["metric"]["le"])
            for r in prometheus.query(f"{HISTOGRAM}_bucket{{{instance}}}")
        )
        per_bucket = [(le, c - below) for (_, c, le), below in zip(cumulative, [0.0] + [c for _, c, _ in cumulative])]
        worst_le = [le for le, n in per_bucket if n > 0][-1]
        assert worst_le == _bucket_of(max(counts.values()))

        bucket = f'{HISTOGRAM}_bucket{{{instance}, le="{worst_le}"}}'
        [series] = prometheus.exemplars(bucket, start - 60, time.time() + 60)
        exemplar = series["exemplars"][-1]  # the newest: the last request recorded in the bucket
        trace_id, span_id = exemplar["labels"]["trace_id"], exemplar["labels"]["span_id"]

        spans = phoenix.wait_for_spans(trace_id, lambda found: any(s["name"] == "llm_request" for s in found))
        [span] = spans  # the request span is the trace's root and only span
        request_id = span["attributes"]["gen_ai.request.id"]
        assert span["context"] == {"trace_id": trace_id, "span_id": span_id}
        assert _bucket_of(float(exemplar["value"])) == worst_le
        assert span["attributes"]["llm.request.num_preemptions"] == counts[request_id] == float(exemplar["value"])
        events = [e for e in span["events"] if e["name"] == "preempted"]
        assert [e["attributes"]["ordinal"] for e in events] == list(range(1, counts[request_id] + 1))
        assert [(e["attributes"]["num_computed_tokens"], e["attributes"]["reason"]) for e in events] == (
            truth.by_request[request_id]
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
    finally:
        handle.shutdown()


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
