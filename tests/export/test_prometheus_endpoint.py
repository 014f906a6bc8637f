"""otel_llm.export.prometheus: the endpoint on its own registry and port, exemplars, `:` in names."""

from __future__ import annotations

import dataclasses
import re
import socket
import threading
import urllib.error
import urllib.request

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from otel_llm import TelemetryConfig, setup_telemetry
from otel_llm.export.prometheus import PrometheusEndpoint
from tests.support.backends import wait_until
from tests.support.sdk_versions import needs_prometheus_exporter

BOUNDS = (0.5, 1, 2, 3, 4, 5, 10, 20)
OPENMETRICS = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
VALUES = [0, 0, 0, 1, 3, 3, 7, 25]  # per-request preemption counts
LE = ["0.5", "1.0", "2.0", "3.0", "4.0", "5.0", "10.0", "20.0", "+Inf"]
CUMULATIVE = [3, 4, 4, 6, 6, 6, 7, 7, 8]


def _global_registry_names() -> set[str]:
    return set(REGISTRY._names_to_collectors)


def _scrape(url: str, accept: str | None = None) -> tuple[str, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return resp.read().decode(), resp.headers["Content-Type"]


@pytest.fixture
def setup():
    before = _global_registry_names()
    endpoint = PrometheusEndpoint(port=0)
    mp = MeterProvider(
        metric_readers=[endpoint.reader],
        views=[
            View(
                instrument_name="vllm.request_num_preemptions",
                name="vllm:request_num_preemptions",
                aggregation=ExplicitBucketHistogramAggregation(BOUNDS),
            ),
            View(instrument_name="vllm.num_preemptions", name="vllm:num_preemptions"),
            View(instrument_name="vllm.e2e_request_latency_seconds", name="vllm:e2e_request_latency_seconds"),
        ],
    )
    tp = TracerProvider()
    meter = mp.get_meter("otel_llm")
    hist = meter.create_histogram("vllm.request_num_preemptions", unit="1")
    counter = meter.create_counter("vllm.num_preemptions")
    latency = meter.create_histogram("vllm.e2e_request_latency_seconds", unit="s")
    tracer = tp.get_tracer("test")
    spans = {}
    attrs = {"model_name": "tiny", "engine": "0"}
    for i, v in enumerate(VALUES):
        with tracer.start_as_current_span(f"r{i}") as span:
            hist.record(v, attrs)
            latency.record(0.25, attrs)
            spans[v] = span.get_span_context()  # last span recorded per value wins the bucket
    counter.add(sum(VALUES), attrs)
    endpoint.start()
    try:
        yield endpoint, spans
    finally:
        endpoint.shutdown()
        mp.shutdown()
        assert _global_registry_names() == before, "the global prometheus_client REGISTRY was touched"


# Our collector (le as 1.0, exemplars on OpenMetrics) renders from opentelemetry-exporter-prometheus
# 0.64b0 on; with an older one the endpoint renders through the exporter's own collector.
OUR_COLLECTOR = needs_prometheus_exporter("0.64b0", "our Prometheus collector (le as 1.0, exemplars)")


@OUR_COLLECTOR
def test_text_format_exact_buckets(setup):
    endpoint, _ = setup
    body, ctype = _scrape(endpoint.url)
    assert ctype.startswith("text/plain; version=0.0.4")
    for le, count in zip(LE, CUMULATIVE):
        line = f'vllm:request_num_preemptions_bucket{{engine="0",le="{le}",model_name="tiny"}} {float(count)}'
        assert line in body.splitlines(), line
    assert 'vllm:request_num_preemptions_count{engine="0",model_name="tiny"} 8.0' in body
    assert f'vllm:request_num_preemptions_sum{{engine="0",model_name="tiny"}} {float(sum(VALUES))}' in body
    assert 'vllm:num_preemptions_total{engine="0",model_name="tiny"} 39.0' in body
    # unit "s" on a name already ending in _seconds: no double suffix
    assert "vllm:e2e_request_latency_seconds_count" in body
    assert "_seconds_seconds" not in body
    # classic text carries no exemplars, and no otel_scope_* labels (scope_info_enabled=False)
    assert " # {" not in body
    assert "otel_scope_" not in body
    assert "vllm_request_num_preemptions" not in body


@OUR_COLLECTOR
def test_openmetrics_keeps_colon_and_carries_exemplars(setup):
    endpoint, spans = setup
    body, ctype = _scrape(endpoint.url, OPENMETRICS)
    assert ctype.startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith("# EOF\n")
    assert "vllm_request_num_preemptions" not in body  # client_python #1177 worked around
    assert "vllm_num_preemptions" not in body
    lines = body.splitlines()
    pattern = re.compile(
        r'^vllm:request_num_preemptions_bucket\{engine="0",le="(?P<le>[^"]+)",model_name="tiny"\} (?P<count>\S+)'
        r'(?: # \{span_id="(?P<span>[0-9a-f]{16})",trace_id="(?P<trace>[0-9a-f]{32})"\} '
        r"(?P<value>\S+) (?P<ts>\d+\.\d{9}))?$"
    )
    seen = {}
    for line in lines:
        m = pattern.match(line)
        if m:
            seen[m["le"]] = m
    assert list(seen) == LE
    for le, count in zip(LE, CUMULATIVE):
        assert float(seen[le]["count"]) == count
    # each bucket holding a recorded value carries the exemplar of the last span that recorded into it
    expected_bucket = {0: "0.5", 1: "1.0", 3: "3.0", 7: "10.0", 25: "+Inf"}
    for value, le in expected_bucket.items():
        m = seen[le]
        assert m["trace"] is not None, f"no exemplar on le={le}"
        ctx = spans[value]
        assert m["trace"] == format(ctx.trace_id, "032x")
        assert m["span"] == format(ctx.span_id, "016x")
        assert float(m["value"]) == value
    for le in ("2.0", "4.0", "5.0", "20.0"):
        assert seen[le]["trace"] is None
    assert 'vllm:num_preemptions_total{engine="0",model_name="tiny"} 39.0' in lines
    # prometheus_client's own OpenMetrics parser accepts the body, names with ':' and exemplars
    families = {f.name: f for f in text_string_to_metric_families(body)}
    hist = families["vllm:request_num_preemptions"]
    assert hist.type == "histogram"
    assert sum(1 for s in hist.samples if s.exemplar is not None) == 5
    assert families["vllm:num_preemptions"].type == "counter"


@OUR_COLLECTOR
def test_exemplars_survive_the_next_scrape(setup):
    """The SDK reservoir resets on collect; the endpoint keeps the last exemplar per bucket."""
    endpoint, spans = setup
    _scrape(endpoint.url)  # a text scrape consumes the SDK's exemplars
    for _ in range(2):
        body, _ = _scrape(endpoint.url, OPENMETRICS)
        assert format(spans[25].trace_id, "032x") in body
        assert body.count(" # {span_id=") >= 5


def test_render_without_http(setup):
    endpoint, _ = setup
    body, ctype = endpoint.render("application/openmetrics-text")
    assert ctype.startswith("application/openmetrics-text")
    assert b"vllm:request_num_preemptions_bucket{" in body


def test_gzip_and_404(setup):
    endpoint, _ = setup
    req = urllib.request.Request(endpoint.url, headers={"Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.headers["Content-Encoding"] == "gzip"
        import gzip

        assert b"vllm:request_num_preemptions_count" in gzip.decompress(resp.read())
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(endpoint.url.replace("/metrics", "/nope"), timeout=5)
    assert err.value.code == 404


def test_concurrent_scrapes_all_get_data(setup):
    """Upstream hands data through a deque: unserialized, concurrent scrapes could come back empty."""
    endpoint, _ = setup
    bodies: list[str] = []
    errors: list[BaseException] = []

    def worker():
        try:
            for _ in range(5):
                bodies.append(_scrape(endpoint.url)[0])
        except BaseException as exc:  # noqa: BLE001 - any failure of a scraper thread is reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors
    assert len(bodies) == 20
    assert all("vllm:request_num_preemptions_count" in b for b in bodies)


def test_defaults_bind_loopback():
    endpoint = PrometheusEndpoint()
    assert endpoint.host == "127.0.0.1"
    assert endpoint.port == 9464
    assert endpoint.reader is not None  # usable before start()
    endpoint.shutdown()
    endpoint.shutdown()


def test_port_zero_binds_loopback_only():
    endpoint = PrometheusEndpoint(port=0)
    endpoint.start()
    try:
        assert endpoint.port > 0
        assert endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
        assert endpoint._server is not None
        assert endpoint._server.server_address[0] == "127.0.0.1"
    finally:
        endpoint.shutdown()


def test_taken_port_raises_clear_oserror():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        endpoint = PrometheusEndpoint(port=port)
        with pytest.raises(OSError, match=rf"127\.0\.0\.1:{port}"):
            endpoint.start()
        endpoint.shutdown()


def test_setup_telemetry_with_a_taken_port_raises_unless_told_to_warn(caplog):
    """One rule for a taken port: a program that asked for it gets the OSError; an entry point
    (port_taken="warn") gets one line naming the address and OTEL_LLM_PROMETHEUS_PORTS, no
    /metrics, and its other exporters."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        config = TelemetryConfig(metrics_exporters=("prometheus", "console"), traces_exporters=("none",))
        env = {"OTEL_EXPORTER_PROMETHEUS_PORT": str(port)}
        with pytest.raises(OSError, match=rf"127\.0\.0\.1:{port}"):
            setup_telemetry(config, environ=env)
        with caplog.at_level("WARNING", logger="otel_llm.export.setup"):
            handle = setup_telemetry(config, environ=env, port_taken="warn")
        try:
            said = [r.getMessage() for r in caplog.records if "no /metrics endpoint" in r.getMessage()]
            assert len(said) == 1, said
            assert f"127.0.0.1:{port}" in said[0] and "OTEL_LLM_PROMETHEUS_PORTS" in said[0], said
            assert said[0].endswith("The rest goes on: metrics to console"), said  # the exporters that go on
            assert handle.prometheus is None
            assert handle.prometheus_port is None
        finally:
            handle.shutdown()
        with pytest.raises(ValueError, match="port_taken"):
            setup_telemetry(config, environ=env, port_taken="ignore")


def test_shutdown_idempotent_stops_serving_and_unregisters():
    endpoint = PrometheusEndpoint(port=0)
    mp = MeterProvider(metric_readers=[endpoint.reader])
    mp.get_meter("t").create_counter("c").add(1)
    endpoint.start()
    url = endpoint.url
    assert "c_total 1.0" in _scrape(url)[0]
    endpoint.shutdown()
    endpoint.shutdown()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=2)
    assert list(endpoint.registry.collect()) == []
    mp.shutdown()  # the provider shutting the reader down again is fine
    endpoint.shutdown()


def _context_switches(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as f:
        fields = dict(line.split(":", 1) for line in f if "ctxt_switches" in line)
    return sum(int(v) for v in fields.values())


EPOLL_WAITS = {232, 281, 441}  # x86-64 epoll_wait, epoll_pwait, epoll_pwait2


def _waits_in_epoll(native_id: int) -> bool:
    """The thread is asleep in its selector (not still on its way back to it, e.g. waiting for the GIL)."""
    with open(f"/proc/self/task/{native_id}/syscall") as f:
        return int(f.read().split()[0]) in EPOLL_WAITS


def test_the_serving_thread_sleeps_between_scrapes():
    """No wake-up while nobody scrapes (each would take the GIL from the engine's event loop);
    a scrape and the shutdown still wake it. Over one second, a thread polling every 0.2 s would
    be switched in at least 5 times."""
    endpoint = PrometheusEndpoint(port=0)
    mp = MeterProvider(metric_readers=[endpoint.reader])
    mp.get_meter("t").create_counter("c").add(1)
    endpoint.start()
    thread = endpoint._thread
    assert thread is not None and thread.native_id is not None
    tid = thread.native_id
    assert "c_total 1.0" in _scrape(endpoint.url)[0]
    wait_until(lambda: _waits_in_epoll(tid), timeout=10, what="the serving thread asleep after the scrape")
    before = _context_switches(tid)
    threading.Event().wait(1.0)  # an observation window, not a synchronisation
    assert _context_switches(tid) == before
    assert "c_total 1.0" in _scrape(endpoint.url)[0]
    endpoint.shutdown()
    thread.join(5)
    assert not thread.is_alive()
    mp.shutdown()


def test_two_endpoints_do_not_share_series():
    """Own registry each: two providers (or vLLM's and ours) never see each other's series."""
    a, b = PrometheusEndpoint(port=0), PrometheusEndpoint(port=0)
    mpa = MeterProvider(metric_readers=[a.reader])
    mpb = MeterProvider(metric_readers=[b.reader])
    mpa.get_meter("t").create_counter("only_a").add(1)
    mpb.get_meter("t").create_counter("only_b").add(1)
    try:
        body_a = a.render()[0].decode()
        body_b = b.render()[0].decode()
        assert "only_a_total" in body_a and "only_b" not in body_a
        assert "only_b_total" in body_b and "only_a" not in body_b
    finally:
        for x in (a, b, mpa, mpb):
            x.shutdown()


def test_require_backend_skips_or_fails(monkeypatch):
    from tests.support.backends import BackendUnavailable, backend, require_backend

    monkeypatch.delenv("OTEL_LLM_REQUIRE_BACKENDS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="backend prometheus unavailable: gone"):
        require_backend("prometheus", "gone")
    monkeypatch.setenv("OTEL_LLM_REQUIRE_BACKENDS", "1")
    with pytest.raises(pytest.fail.Exception, match="OTEL_LLM_REQUIRE_BACKENDS=1"):
        with backend("rotel"):
            raise BackendUnavailable("no binary")


@OUR_COLLECTOR
def test_text_format_matches_upstream_exporter():
    """Only histograms go through our code; with float bounds the text is upstream's, byte for byte."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.resources import Resource
    from prometheus_client import CollectorRegistry, generate_latest

    resource = Resource.create({"service.name": "svc", "service.instance.id": "i-1"})
    upstream_registry = CollectorRegistry()
    upstream = PrometheusMetricReader(scope_info_enabled=False, registry=upstream_registry)
    ours = PrometheusEndpoint(port=0)
    views = [
        View(instrument_name="h", name="vllm:h", aggregation=ExplicitBucketHistogramAggregation((0.5, 1.0, 2.0, 20.0))),
        View(instrument_name="c", name="vllm:c"),
    ]
    providers = [MeterProvider(metric_readers=[r], views=views, resource=resource) for r in (upstream, ours.reader)]
    for mp in providers:
        meter = mp.get_meter("otel_llm")
        meter.create_counter("c").add(3, {"model_name": "tiny"})
        meter.create_up_down_counter("running").add(2)
        meter.create_histogram("h").record(1.5, {"model_name": "tiny"})
        meter.create_histogram("lat_seconds", unit="s").record(0.1)
        meter.create_gauge("kv").set(0.25)
    try:
        assert ours.render()[0].decode() == generate_latest(upstream_registry).decode()
    finally:
        for mp in providers:
            mp.shutdown()
        ours.shutdown()


def test_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    endpoint = PrometheusEndpoint(host="::1", port=0)
    try:
        endpoint.start()
    except OSError as exc:
        endpoint.shutdown()
        pytest.skip(f"IPv6 loopback unavailable: {exc}")
    try:
        assert endpoint.url == f"http://[::1]:{endpoint.port}/metrics"
        _scrape(endpoint.url)
    finally:
        endpoint.shutdown()


def test_processes_on_one_host_take_consecutive_ports_from_the_base(clean_env):
    """OTEL_LLM_PROMETHEUS_PORTS=N: each process binds the first free port of base..base+N-1."""
    from tests.support.backends import free_port_block

    base = free_port_block(2)
    config = TelemetryConfig.from_env(
        {
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_EXPORTER_PROMETHEUS_PORT": str(base),
            "OTEL_LLM_PROMETHEUS_PORTS": "2",
        }
    )
    first, second = setup_telemetry(config), setup_telemetry(config)
    try:
        assert (first.prometheus_port, second.prometheus_port) == (base, base + 1)
        with pytest.raises(OSError, match=rf"cannot bind 127.0.0.1:{base}..{base + 1}"):
            setup_telemetry(config)
        single = TelemetryConfig.from_env(
            {
                "OTEL_METRICS_EXPORTER": "prometheus",
                "OTEL_TRACES_EXPORTER": "none",
                "OTEL_EXPORTER_PROMETHEUS_PORT": str(base),
            }
        )
        with pytest.raises(OSError, match=rf"cannot bind 127.0.0.1:{base}: "):
            setup_telemetry(single)
    finally:
        first.shutdown()
        second.shutdown()


def test_a_flush_before_a_scrape_serves_every_series_once(clean_env):
    """A pull reader does not collect on flush: the exporter's collector would hand that
    collection to the next scrape beside the scrape's own, every series twice."""
    from otel_llm.events import EventType, RequestEvent

    handle = setup_telemetry(
        TelemetryConfig(
            model_name="tiny", metrics_exporters=("prometheus",), traces_exporters=("none",), prometheus_port=0
        )
    )
    try:
        handle.telemetry.on_events(
            [
                RequestEvent(EventType.ARRIVED, "r1", 1.0, prompt_tokens=3, max_tokens=4),
                RequestEvent(EventType.SCHEDULED, "r1", 1.1),
                RequestEvent(EventType.FINISHED, "r1", 1.2, finish_reason="stop"),
            ]
        )
        assert handle.force_flush() and handle.force_flush()
        body, _ = _scrape(f"http://127.0.0.1:{handle.prometheus_port}/metrics")
        samples = [line for line in body.splitlines() if line and not line.startswith("#")]
        assert len(samples) == len(set(samples)), sorted(s for s in samples if samples.count(s) > 1)[:3]
        count = [s for s in samples if s.startswith("vllm:request_num_preemptions_count{")]
        assert count == ['vllm:request_num_preemptions_count{engine="0",model_name="tiny"} 1.0']
    finally:
        handle.shutdown()


def test_two_engines_of_their_own_identity_are_served_on_one_endpoint(clean_env):
    """An engine's providers served on another's endpoint (``serve_on``): each family once, each
    engine's series under its ``engine`` label with its own values, one ``target_info`` per
    identity; shutting the second down leaves the first's."""
    from otel_llm.events import EventType, RequestEvent
    from otel_llm.export.resource import part_of_process

    base = TelemetryConfig(
        model_name="tiny",
        metrics_exporters=("prometheus",),
        traces_exporters=("none",),
        prometheus_port=0,
        resource_attributes={"service.instance.id": "serve-7"},
    )
    first = setup_telemetry(part_of_process(dataclasses.replace(base, engine="0"), "engine-0"))
    second = setup_telemetry(
        part_of_process(dataclasses.replace(base, engine="1"), "engine-1"), serve_on=first.prometheus
    )
    url = f"http://127.0.0.1:{first.prometheus_port}/metrics"
    try:
        assert second.prometheus is None and second.prometheus_port is None
        for handle, requests in ((first, 1), (second, 3)):
            for i in range(requests):
                handle.telemetry.on_events(
                    [
                        RequestEvent(EventType.ARRIVED, f"r{i}", 1.0, prompt_tokens=3, max_tokens=4),
                        RequestEvent(EventType.SCHEDULED, f"r{i}", 1.1),
                        RequestEvent(EventType.PREEMPTED, f"r{i}", 1.15, reason="kv_cache_full"),
                        RequestEvent(EventType.SCHEDULED, f"r{i}", 1.16),
                        RequestEvent(EventType.FINISHED, f"r{i}", 1.2, finish_reason="stop"),
                    ]
                )
            handle.telemetry.flush()
        for _ in range(2):  # each scrape merges the families afresh: nothing added to them at each
            text, _ = _scrape(url)
            assert [line.split(",")[0] for line in text.splitlines() if line.startswith("target_info{")] == [
                'target_info{service_instance_id="serve-7-engine-0"',
                'target_info{service_instance_id="serve-7-engine-1"',
            ]
        body, _ = _scrape(url, OPENMETRICS)
        families = list(text_string_to_metric_families(body))
        names = [f.name for f in families]
        assert len(names) == len(set(names))
        samples = [(s.name, tuple(sorted(s.labels.items()))) for f in families for s in f.samples]
        assert len(samples) == len(set(samples))
        by_engine = {
            s.labels["engine"]: s.value
            for f in families
            for s in f.samples
            if s.name == "vllm:request_num_preemptions_bucket" and s.labels["le"] == "1.0"
        }
        assert by_engine == {"0": 1.0, "1": 3.0}
        [target] = [f for f in families if f.name == "target"]
        assert sorted(s.labels["service_instance_id"] for s in target.samples) == [
            "serve-7-engine-0",
            "serve-7-engine-1",
        ]
        second.shutdown()
        body, _ = _scrape(url, OPENMETRICS)
        engines = {s.labels.get("engine") for f in text_string_to_metric_families(body) for s in f.samples}
        assert "0" in engines and "1" not in engines
    finally:
        second.shutdown()
        first.shutdown()


def test_a_scrape_before_the_meter_provider_takes_the_reader_serves_nothing_quietly(caplog):
    """setup_telemetry binds the port before it builds the MeterProvider: a scrape in between
    answers with no series and no warning from the SDK."""
    with caplog.at_level("WARNING"), PrometheusEndpoint(port=0) as endpoint:
        body, _ = _scrape(endpoint.url)
        provider = MeterProvider(metric_readers=[endpoint.reader])
        provider.get_meter("otel_llm").create_counter("vllm.num_preemptions").add(2, {"engine": "0"})
        after, _ = _scrape(endpoint.url)
        provider.shutdown()
    assert [line for line in body.splitlines() if line and not line.startswith("#")] == []
    assert 'vllm_num_preemptions_total{engine="0"} 2.0' in after
    assert [r.getMessage() for r in caplog.records if "registered" in r.getMessage()] == []
