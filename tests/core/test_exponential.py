"""Exponential histograms (OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION).

The in-process cells' exponential buckets must be exactly the SDK's own exponential aggregation
for the same observations and collections (scale, offsets, counts, zero count), cumulative and
delta; the fast path and the SDK path must export equal points; and setup_telemetry must send
the latency and token histograms over OTLP as exponential histograms while
request_num_preemptions and the Prometheus endpoint keep explicit buckets.
"""

from __future__ import annotations

import random
import urllib.request
from types import SimpleNamespace
from typing import Any, cast

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.metrics._internal.aggregation import (
    AggregationTemporality,
    _ExponentialBucketHistogramAggregation,
)
from opentelemetry.sdk.metrics._internal.exemplar import SimpleFixedSizeExemplarReservoir
from opentelemetry.sdk.metrics._internal.measurement import Measurement
from opentelemetry.sdk.metrics.export import ExponentialHistogramDataPoint

from otel_llm import TelemetryConfig, setup_telemetry
from otel_llm.catalogue.metrics import BY_KEY, METRICS
from otel_llm.recording.cell_aggregation import _ExponentialCellAggregation
from otel_llm.recording.cells import ExponentialHistogramCell
from otel_llm.testing import in_memory_telemetry
from tests.support.backends import rotel_to_sink, wait_until
from tests.support.otel_helpers import FAST, SDK, Paths, assert_same_snapshots, attrs, workload
from tests.support.sdk_versions import needs_sdk

EXPONENTIAL = "base2_exponential_bucket_histogram"
# The SDK's delta exponential histogram starts each interval afresh, at scale 20, as ours does;
# 1.28 carries the previous interval's final scale over.
DELTA_SCALE_PER_INTERVAL = needs_sdk("1.45", "a delta exponential histogram starting each interval at scale 20")
CUMULATIVE, DELTA = AggregationTemporality.CUMULATIVE, AggregationTemporality.DELTA


def _buckets(b: Any) -> tuple[int, tuple[int, ...]]:
    counts = list(b.bucket_counts)
    while counts and counts[-1] == 0:  # the SDK's arrays may carry unused capacity
        counts.pop()
    return (b.offset, tuple(counts)) if counts else (0, ())


def exponential_point(p: Any) -> tuple:
    return (p.count, p.scale, p.zero_count, _buckets(p.positive), _buckets(p.negative), p.min, p.max)


def _sdk_aggregation() -> _ExponentialBucketHistogramAggregation:
    return _ExponentialBucketHistogramAggregation(
        {},
        lambda size: SimpleFixedSizeExemplarReservoir(size=size),  # type: ignore[arg-type]  # SDK alias says dict; SDK calls builder(size=)
        DELTA,
        0,
    )


def _values(rnd: random.Random, n: int) -> list[float]:
    kinds = [
        lambda: rnd.lognormvariate(-3, 1.5),
        lambda: float(rnd.randint(0, 9000)),
        lambda: 0.0,
        lambda: 2.0 ** rnd.randint(-20, 20),
        lambda: rnd.uniform(1e-9, 1e9),
        lambda: -rnd.lognormvariate(0, 3),
    ]
    weights = [6, 3, 1, 1, 1, 1]
    return [rnd.choices(kinds, weights)[0]() for _ in range(n)]


@pytest.mark.parametrize("temporality", [CUMULATIVE, DELTA], ids=["cumulative", "delta"])
@pytest.mark.parametrize("seed", range(12))
def test_cell_buckets_equal_the_sdk_exponential_aggregation(seed, temporality):
    rnd = random.Random(seed)
    cell = ExponentialHistogramCell((1.0,), {})
    ours = _ExponentialCellAggregation({}, 0, lambda _cls: lambda size: SimpleFixedSizeExemplarReservoir(size=size))
    ours._cell = cell
    sdk = _sdk_aggregation()
    now = 1
    for interval in range(8):
        # some intervals are empty, some hold zeros only (the SDK's scale-0 case), most a mix
        n = rnd.choice([0, 1, 3, 40, 400])
        values = [0.0] * n if interval == 2 else _values(rnd, n)
        for v in values:
            cell.observe(v)
            # A stand-in for a Measurement: the fields the aggregation reads, without an instrument.
            measurement = SimpleNamespace(value=v, time_unix_nano=now, attributes={}, context=Context())
            sdk.aggregate(cast(Measurement, measurement), False)
        now += 1
        expected, got = sdk.collect(temporality, now), ours.collect(temporality, now)
        if temporality is DELTA:
            sdk = _sdk_aggregation()  # the SDK's storage starts a new aggregation per delta interval
        if expected is None:
            assert got is None
            continue
        assert got is not None and isinstance(expected, ExponentialHistogramDataPoint)
        assert exponential_point(got) == exponential_point(expected), (seed, interval)
        # delta sums are differences of running totals: rounding of the largest values seen
        assert got.sum == pytest.approx(expected.sum, rel=1e-9, abs=1e-12 * cell.total + 1e-9)


def comparable(r: Any, request_of_trace: dict[int, str]) -> dict:
    out: dict = {}
    for name, points in r.metrics().items():
        for p in points:
            key = (name, tuple(sorted(p.attributes.items())))
            if hasattr(p, "scale"):
                # exemplars: the SDK samples them at random here; ours are the latest per explicit
                # bucket. Both must be observations of the requests' own spans.
                assert all(request_of_trace.get(e.trace_id) for e in p.exemplars), name
                out[key] = ("exponential", *exponential_point(p), pytest.approx(p.sum))
            elif hasattr(p, "bucket_counts"):
                out[key] = ("explicit", tuple(p.bucket_counts), p.count, pytest.approx(p.sum))
            elif not (getattr(p, "value", None) == 0 and r.delta):
                out[key] = p.value
    return out


def run(paths: Paths, naming: str, delta: bool) -> list[dict]:
    r = in_memory_telemetry(
        TelemetryConfig(model_name="tiny", naming=naming, histogram_aggregation=EXPONENTIAL), **paths, delta=delta
    )
    r.delta = delta
    batches, steps = workload()
    snapshots = []
    for i, batch in enumerate(batches):
        r.telemetry.on_events(batch)
        r.telemetry.on_step(steps[i % len(steps)])
        if i % 20 == 19:
            traces = {s.context.trace_id: attrs(s.attributes)["gen_ai.request.id"] for s in r.finished_spans()}
            snapshots.append(comparable(r, traces))
    return snapshots


@pytest.mark.parametrize("naming", ["vllm", "semconv"])
@pytest.mark.parametrize(
    "delta", [False, pytest.param(True, marks=DELTA_SCALE_PER_INTERVAL)], ids=["cumulative", "delta"]
)
def test_fast_path_equals_sdk_path_with_exponential_histograms(naming, delta):
    fast, sdk = run(FAST, naming, delta), run(SDK, naming, delta)
    assert_same_snapshots(fast, sdk, 3)
    config = TelemetryConfig(naming=naming)
    kinds = {name: value[0] for (name, _), value in fast[-1].items() if isinstance(value, tuple)}
    for m in METRICS:
        if m.kind == "histogram" and m.name(naming) in kinds:
            assert kinds[m.name(naming)] == ("explicit" if m.explicit_only else "exponential")
    assert kinds[BY_KEY["request_num_preemptions"].name(config.naming)] == "explicit"
    assert kinds[BY_KEY["request_num_preemptions_caused"].name(config.naming)] == "explicit"
    assert kinds[BY_KEY["inter_token_latency_seconds"].name(config.naming)] == "exponential"


def test_an_invalid_histogram_aggregation_fails_naming_the_variable(clean_env):
    var = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
    env = {"OTEL_METRICS_EXPORTER": "none", "OTEL_TRACES_EXPORTER": "none", var: "exponential"}
    with pytest.raises(ValueError, match=rf"^{var}='exponential': histogram_aggregation"):
        TelemetryConfig.from_env(env)
    with pytest.raises(ValueError, match=rf"^{var}='exponential'"):
        setup_telemetry(environ=env)


@pytest.mark.backend
def test_otlp_gets_exponential_histograms_and_prometheus_explicit_buckets(clean_env):
    """Through rotel: the latency and token histograms arrive exponential, request_num_preemptions
    explicit; the Prometheus endpoint of the same provider keeps explicit buckets (the Python
    Prometheus exporter cannot render exponential ones) with the same counts."""
    from tests.support.workloads import engine_run

    with rotel_to_sink() as (sink, rotel):
        env = {
            "OTEL_METRICS_EXPORTER": "otlp,prometheus",
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_EXPORTER_PROMETHEUS_PORT": "0",
            "OTEL_METRIC_EXPORT_INTERVAL": "600000",
            "OTEL_EXPORTER_OTLP_ENDPOINT": rotel.grpc_endpoint,
            "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": EXPONENTIAL,
        }
        for k, v in env.items():
            clean_env.setenv(k, v)
        handle = setup_telemetry(TelemetryConfig.from_env(env, model_name="tiny"), environ=env)
        try:
            truth = engine_run(handle.telemetry, 16)
            handle.force_flush()
            e2e = "vllm:e2e_request_latency_seconds"
            wait_until(lambda: sink.metric_points(e2e), timeout=15, what="metrics through rotel")
            scrape = (
                urllib.request.urlopen(f"http://127.0.0.1:{handle.prometheus_port}/metrics", timeout=10).read().decode()
            )
        finally:
            handle.shutdown()

    for m in METRICS:
        if m.kind != "histogram" or m.key == "request_preempted_time_seconds" and not any(truth.values()):
            continue
        received = sink.metric_points(m.vllm)
        assert received, m.vllm
        metric, point = received[0]
        want = "histogram" if m.explicit_only else "exponential_histogram"
        assert metric.WhichOneof("data") == want, m.vllm
        if m.key in ("e2e_request_latency_seconds", "request_num_preemptions", "request_num_preemptions_caused"):
            assert point.count == len(truth)
    _, e2e_point = sink.metric_points("vllm:e2e_request_latency_seconds")[0]
    assert e2e_point.scale <= 20 and sum(e2e_point.positive.bucket_counts) + e2e_point.zero_count == len(truth)
    # Prometheus: explicit buckets with our boundaries, the same count
    assert 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="tiny"}' in scrape
    assert f'vllm:e2e_request_latency_seconds_count{{engine="0",model_name="tiny"}} {float(len(truth))}' in scrape


def test_reader_views_give_one_reader_exponential_and_another_explicit():
    """use_reader_views (SDK internals): exponential for one reader, explicit for the other, one engine."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    import otel_llm
    from otel_llm import EngineTelemetry
    from otel_llm.recording.views import use_reader_views
    from otel_llm.testing import collect_metrics, lifecycle

    config = TelemetryConfig(model_name="tiny", histogram_aggregation=EXPONENTIAL)
    explicit, exponential = InMemoryMetricReader(), InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[explicit, exponential], views=otel_llm.views(TelemetryConfig(model_name="tiny")))
    use_reader_views(mp, exponential, otel_llm.views(config))
    telemetry = EngineTelemetry(config, meter_provider=mp)
    for i in range(5):
        telemetry.on_events(lifecycle(f"r{i}", 1.0 + i, preemptions=i))
    a, b = collect_metrics(explicit), collect_metrics(exponential)
    for name in ("vllm:e2e_request_latency_seconds", "vllm:inter_token_latency_seconds"):
        (pa,), (pb,) = a[name], b[name]
        assert hasattr(pa, "explicit_bounds") and hasattr(pb, "scale") and pa.count == pb.count > 0
    (pa,), (pb,) = a["vllm:request_num_preemptions"], b["vllm:request_num_preemptions"]
    assert pa.bucket_counts == pb.bucket_counts and pa.count == 5


def test_inlined_index_is_the_sdk_mapping():
    from opentelemetry.sdk.metrics._internal.exponential_histogram.mapping.logarithm_mapping import LogarithmMapping

    from otel_llm._sdk.exponential_mapping import MAX_SCALE, index_at_max_scale

    mapping = LogarithmMapping(MAX_SCALE)
    rnd = random.Random(5)
    values = [rnd.lognormvariate(0, 10) for _ in range(20000)] + [2.0**k for k in range(-1074, 1024)]
    values += [5e-324, 1e-310, 2.2250738585072014e-308, 1.7976931348623157e308, 3.0, 1.0, 0.1]
    assert [index_at_max_scale(v) for v in values] == [mapping.map_to_index(v) for v in values]


@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
def test_record_iteration_latencies_go_into_the_exponential_buckets_on_both_paths(delta):
    """Engines that hand over a step's latencies at once (record_iteration: vLLM's stat logger)."""
    points = []
    for paths in (FAST, SDK):
        r = in_memory_telemetry(
            TelemetryConfig(model_name="tiny", histogram_aggregation=EXPONENTIAL), **paths, delta=delta
        )
        r.telemetry.record_iteration(ttfts=[0.02, 0.3], itls=[0.01, 0.01, 0.2, 3.0])
        (itl,) = r.metrics()["vllm:inter_token_latency_seconds"]
        points.append((exponential_point(itl), itl.count, pytest.approx(itl.sum)))
    assert points[0] == points[1]
    assert points[0][1] == 4
