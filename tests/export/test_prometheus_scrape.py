"""A real Prometheus (2.42, Debian) scrapes the plugin's endpoint during an engine_stub run.

PromQL over its HTTP API must return the engine's ground truth exactly: the per-request
preemption histogram's count and every bucket, the preemption counter, histogram_quantile by
Prometheus' own interpolation rule, and exemplars linking buckets to the request spans. Both
naming profiles. Prometheus negotiates OpenMetrics, so this is also the end-to-end check that
``vllm:`` names keep their colon there (client_python #1177).
"""

from __future__ import annotations

import math
import time

import pytest

from tests.support.backends import backend, free_port, histogram_quantile, start_prometheus
from tests.support.sdk_versions import prometheus_exporter_at_least
from tests.support.workloads import NUM_REQUESTS, add_requests, preempting_engine_config

pytestmark = pytest.mark.backend

BOUNDS = (0.5, 1, 2, 3, 4, 5, 10, 20)
LE = ["0.5", "1.0", "2.0", "3.0", "4.0", "5.0", "10.0", "20.0", "+Inf"]

# What the endpoint serves for each profile (asserted exactly).
NAMES = {
    "vllm": {
        "histogram": "vllm:request_num_preemptions",
        "counter": "vllm:num_preemptions_total",
        "model_label": "model_name",
        "e2e": "vllm:e2e_request_latency_seconds",  # unit "s", name already ends _seconds
    },
    "semconv": {
        # llm.server.request.num_preemptions, unit "{preemption}": the annotation maps to no suffix
        "histogram": "llm_server_request_num_preemptions",
        "counter": "llm_server_preemptions_total",
        "model_label": "gen_ai_request_model",  # attribute gen_ai.request.model, sanitized
        "e2e": "gen_ai_server_request_duration_seconds",  # gen_ai.server.request.duration, unit "s"
    },
}


@pytest.fixture(scope="module")
def ports():
    return {"vllm": free_port(), "semconv": free_port()}


@pytest.fixture(scope="module")
def prometheus(ports):
    # One Prometheus for the module: its scrape manager applies new targets only every 5 s, so
    # both endpoints are targets from the start (down until their test starts them).
    with backend("prometheus"):
        with start_prometheus([f"127.0.0.1:{p}" for p in ports.values()], scrape_interval="1s") as prom:
            yield prom


@pytest.fixture
def scrape_env(clean_env):
    clean_env.setenv("OTEL_METRICS_EXEMPLAR_FILTER", "trace_based")


def _expected_buckets(counts: list[int]) -> dict[str, float]:
    bounds = list(BOUNDS) + [math.inf]
    return {le: float(sum(1 for c in counts if c <= b)) for le, b in zip(LE, bounds)}


@pytest.mark.parametrize("profile", ["vllm", "semconv"])
def test_prometheus_scrapes_exact_preemption_histogram(profile, prometheus, ports, scrape_env):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import otel_llm
    from engine_stub import Engine

    names = NAMES[profile]
    port = ports[profile]
    instance = f'instance="127.0.0.1:{port}"'
    hist = names["histogram"]

    spans = InMemorySpanExporter()
    config = otel_llm.TelemetryConfig(
        model_name="tiny",
        naming=profile,
        preemption_buckets=BOUNDS,
        metrics_exporters=("prometheus",),
        traces_exporters=("none",),
        prometheus_port=port,
    )
    handle = otel_llm.setup_telemetry(config, extra_span_processors=(SimpleSpanProcessor(spans),))
    try:
        assert handle.prometheus is not None, "metrics_exporters=('prometheus',) must start the endpoint"
        assert handle.prometheus.port == port
        assert handle.prometheus.url == f"http://127.0.0.1:{port}/metrics"

        # Prometheus is scraping us before the engine starts, so it scrapes during the run too.
        prometheus.wait_for(f"up{{{instance}}}", lambda r: r and r[0]["value"][1] == "1", timeout=20)

        engine = Engine(preempting_engine_config())
        engine.hooks.subscribe(handle.telemetry)
        add_requests(engine)
        start = time.time()
        outputs = engine.run()
        assert len(outputs) == NUM_REQUESTS
        counts = [o.num_preemptions for o in outputs]
        assert max(counts) > 10 and min(counts) == 0, counts  # the workload really spreads

        # A final scrape: wait until Prometheus holds every request.
        prometheus.wait_for(
            f"{hist}_count{{{instance}}}",
            lambda r: len(r) == 1 and float(r[0]["value"][1]) == NUM_REQUESTS,
            timeout=15,
        )

        count_series = prometheus.query(f"{hist}_count{{{instance}}}")
        assert count_series[0]["metric"][names["model_label"]] == "tiny"
        assert float(count_series[0]["value"][1]) == NUM_REQUESTS
        assert prometheus.value(f"{hist}_sum{{{instance}}}") == float(sum(counts))

        expected = _expected_buckets(counts)
        buckets = {r["metric"]["le"]: float(r["value"][1]) for r in prometheus.query(f"{hist}_bucket{{{instance}}}")}
        assert buckets == expected

        assert prometheus.value(f"{names['counter']}{{{instance}}}") == float(sum(counts))

        for q in (0.5, 0.9, 0.99):
            got = prometheus.value(f"histogram_quantile({q}, sum by (le) ({hist}_bucket{{{instance}}}))")
            want = histogram_quantile(q, [(float(le), v) for le, v in expected.items()])
            assert got == pytest.approx(want, rel=1e-12), (q, got, want, expected)

        # Seconds histograms: the unit suffix added once, never doubled.
        assert prometheus.value(f"{names['e2e']}_count{{{instance}}}") == NUM_REQUESTS
        assert not [n for n in prometheus.series_names() if "_seconds_seconds" in n]

        # Names as served: with the colon for vllm (OpenMetrics negotiated), none of it for semconv.
        series = set(prometheus.series_names())
        if profile == "vllm":
            assert "vllm_request_num_preemptions_bucket" not in series
            assert "vllm_num_preemptions_total" not in series
        else:
            assert not prometheus.query(f'{{__name__=~"vllm:.*", {instance}}}')

        # Exemplars came through OpenMetrics into Prometheus' exemplar storage and point at the
        # request spans' traces; each exemplar's value lies in its bucket. They come from our
        # collector: opentelemetry-exporter-prometheus 0.64b0+ (the exporter's own renders none).
        if not prometheus_exporter_at_least("0.64b0"):
            return
        request_traces = {
            format(s.context.trace_id, "032x") for s in spans.get_finished_spans() if s.name == "llm_request"
        }
        assert len(request_traces) == NUM_REQUESTS
        exemplar_sets = prometheus.exemplars(f"{hist}_bucket{{{instance}}}", start - 60, time.time() + 60)
        found = 0
        for series_exemplars in exemplar_sets:
            le = series_exemplars["seriesLabels"]["le"]
            upper = float(le)
            lower = max((float(x) for x in LE if float(x) < upper), default=-math.inf)
            for ex in series_exemplars["exemplars"]:
                found += 1
                assert ex["labels"]["trace_id"] in request_traces
                assert len(ex["labels"]["span_id"]) == 16
                assert lower < float(ex["value"]) <= upper
        populated = sum(1 for le in LE if expected[le] > (expected[LE[LE.index(le) - 1]] if LE.index(le) else 0))
        assert found >= populated, (found, exemplar_sets)
    finally:
        handle.shutdown()
