"""The SDK internals that otel_llm.aggregation and the batched records of metrics._Hub rely on
(pyproject pins opentelemetry-sdk 1.45.x). spans.AssembledSpans is held by
tests/core/test_spans_equivalence.py, which compares its spans with the SDK Tracer's.

If an SDK upgrade changes any of these, this file fails first and names what moved.
"""

from __future__ import annotations

import inspect
from importlib.metadata import version

from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics._internal import aggregation as sdk_aggregation
from opentelemetry.sdk.metrics._internal import metric_reader_storage
from opentelemetry.sdk.metrics._internal.point import HistogramDataPoint

from otel_llm.aggregation import HistogramCell, InProcessHistogram
from otel_llm.metric_views import provider_has_views
from otel_llm import TelemetryConfig, views


def test_sdk_version_in_the_pinned_range():
    assert version("opentelemetry-sdk").startswith("1.45.")


def test_observations_carry_a_context():
    assert "context" in inspect.signature(Observation.__init__).parameters


def test_histogram_points_are_recognised_by_aggregation_class():
    # MetricReaderStorage wraps points as Histogram when the aggregation is an explicit-bucket one.
    source = inspect.getsource(metric_reader_storage.MetricReaderStorage.collect)
    assert "_ExplicitBucketHistogramAggregation" in source
    init = inspect.signature(sdk_aggregation._ExplicitBucketHistogramAggregation.__init__).parameters
    assert list(init)[1:6] == ["attributes", "instrument_aggregation_temporality", "start_time_unix_nano",
                               "reservoir_builder", "boundaries"]
    assert {"attributes", "exemplars", "bucket_counts", "explicit_bounds", "min", "max"} <= set(
        inspect.signature(HistogramDataPoint).parameters)


def test_create_aggregation_signature():
    params = list(inspect.signature(sdk_aggregation.Aggregation._create_aggregation).parameters)
    assert params == ["self", "instrument", "attributes", "reservoir_factory", "start_time_unix_nano"]


def test_views_are_found_on_a_provider():
    from opentelemetry.sdk.metrics import MeterProvider

    config = TelemetryConfig()
    assert provider_has_views(MeterProvider(views=views(config)), config)
    assert not provider_has_views(MeterProvider(), config)


def test_cell_observation_binds_through_context():
    cell = HistogramCell((1.0, 2.0), {"a": "b"})
    cell.observe(1.5, (7, 9))
    obs = cell.observation()
    assert obs.attributes == {"a": "b"} and obs.context is not None
    assert isinstance(InProcessHistogram((1.0,)), sdk_aggregation.Aggregation)


def _preemption_points(reader) -> list[tuple[int, tuple, tuple]]:
    data = reader.get_metrics_data()
    return [(p.count, tuple(p.explicit_bounds), tuple(p.bucket_counts)) for rm in data.resource_metrics
            for sm in rm.scope_metrics for m in sm.metrics if m.name == "vllm:request_num_preemptions"
            for p in m.data.data_points]


def test_request_num_preemptions_reaches_every_reader_with_its_explicit_positive_buckets():
    """The in-process cell behind request_num_preemptions is read by every reader of the
    provider, through the explicit-bucket View (the configured boundaries, no others)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_llm import EngineTelemetry
    from tests.support.otel_helpers import lifecycle

    config = TelemetryConfig(model_name="tiny", defer_steps=1)
    first, second = InMemoryMetricReader(), InMemoryMetricReader()
    telemetry = EngineTelemetry(config, meter_provider=MeterProvider(metric_readers=[first, second],
                                                                     views=views(config)))
    for i in range(3):
        telemetry.on_events(lifecycle(f"r{i}", 10.0 + i, preemptions=i))
    expected = [(3, (0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0), (1, 1, 1, 0, 0, 0, 0, 0, 0))]
    assert _preemption_points(first) == expected
    assert _preemption_points(second) == expected
