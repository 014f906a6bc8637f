"""The SDK's histogram aggregations, subclassed by otel_llm.recording.cells's in-process ones: the
metric reader storage recognises a histogram aggregation by these classes and wraps its points
as ``Histogram`` / ``ExponentialHistogram`` for every exporter. Views call an aggregation's
``_create_aggregation`` to make the per-attribute-set aggregation."""

from __future__ import annotations

import inspect
from typing import Any

from opentelemetry.sdk.metrics._internal import aggregation as _aggregation
from opentelemetry.sdk.metrics._internal import measurement as _measurement
from opentelemetry.sdk.metrics._internal import metric_reader_storage as _storage
from opentelemetry.sdk.metrics.view import Aggregation

from otel_llm._sdk import require, require_parameters

# ``object`` when the SDK lost them: otel_llm still imports, and check() fails.
ExplicitBucketHistogramAggregation: type[Any] = getattr(_aggregation, "_ExplicitBucketHistogramAggregation", object)
ExponentialBucketHistogramAggregation: type[Any] = getattr(
    _aggregation, "_ExponentialBucketHistogramAggregation", object
)

_MODULE = "opentelemetry.sdk.metrics._internal.aggregation"


def check() -> None:
    require(ExplicitBucketHistogramAggregation is not object, f"{_MODULE}._ExplicitBucketHistogramAggregation exists")
    require(
        ExponentialBucketHistogramAggregation is not object, f"{_MODULE}._ExponentialBucketHistogramAggregation exists"
    )
    require_parameters(
        getattr(Aggregation, "_create_aggregation", None),
        ["instrument", "attributes", "reservoir_factory", "start_time_unix_nano"],
        "Aggregation._create_aggregation",
    )
    require_parameters(
        ExplicitBucketHistogramAggregation.__init__,
        ["attributes", "instrument_aggregation_temporality", "start_time_unix_nano", "reservoir_builder", "boundaries"],
        "_ExplicitBucketHistogramAggregation.__init__",
    )
    require_parameters(
        ExponentialBucketHistogramAggregation.__init__,
        ["attributes", "reservoir_builder", "instrument_aggregation_temporality", "start_time_unix_nano"],
        "_ExponentialBucketHistogramAggregation.__init__",
    )
    for cls in (ExplicitBucketHistogramAggregation, ExponentialBucketHistogramAggregation):
        require_parameters(
            getattr(cls, "aggregate", None), ["measurement", "should_sample_exemplar"], f"{cls.__name__}.aggregate"
        )
        require_parameters(
            getattr(cls, "collect", None),
            ["collection_aggregation_temporality", "collection_start_nano"],
            f"{cls.__name__}.collect",
        )
    # Points are wrapped by the aggregation's class (isinstance), not by the point's type.
    source = inspect.getsource(_storage.MetricReaderStorage.collect)
    require(
        "_ExplicitBucketHistogramAggregation" in source and "_ExponentialBucketHistogramAggregation" in source,
        "MetricReaderStorage.collect wraps points by the histogram aggregation classes",
    )
    # An asynchronous instrument's Observation reaches aggregate() with its context.
    require(
        "context" in inspect.signature(_measurement.Measurement).parameters,
        "opentelemetry.sdk.metrics._internal.measurement.Measurement has a context",
    )
