"""The SDK's base-2 exponential mapping at scale 20 (``LogarithmMapping``), whose constants
otel_llm.recording.cells inlines to index a value on the hot path; and the SDK's exponential
aggregation behaviour that the in-process cells reproduce (each delta interval starts afresh at
scale 20; SDK 1.28 carried the previous interval's scale over)."""

from __future__ import annotations

import math
import sys
from typing import cast

from opentelemetry.sdk.metrics import Histogram, MeterProvider
from opentelemetry.sdk.metrics._internal.exponential_histogram.mapping import logarithm_mapping
from opentelemetry.sdk.metrics.export import AggregationTemporality, ExponentialHistogram, InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExponentialBucketHistogramAggregation, View

from otel_llm._sdk import require

MAX_SCALE = 20
MIN_NORMAL_VALUE = sys.float_info.min  # the smallest normal double, as the SDK's ieee_754 module has it

_LogarithmMapping = getattr(logarithm_mapping, "LogarithmMapping", None)
_MAPPING = _LogarithmMapping(MAX_SCALE) if _LogarithmMapping is not None else None
SCALE_FACTOR: float = getattr(_MAPPING, "_scale_factor", math.nan)
MIN_NORMAL_INDEX: int = getattr(_MAPPING, "_min_normal_lower_boundary_index", 0)
MAX_NORMAL_INDEX: int = getattr(_MAPPING, "_max_normal_lower_boundary_index", 0)


def index_at_max_scale(value: float) -> int:
    """``LogarithmMapping(20).map_to_index(value)`` for value > 0, the same arithmetic, inlined
    (frexp's mantissa is 0.5 exactly for powers of two)."""
    if value <= MIN_NORMAL_VALUE:
        return MIN_NORMAL_INDEX - 1
    mantissa, exponent = math.frexp(value)
    if mantissa == 0.5:
        return ((exponent - 1) << MAX_SCALE) - 1
    index = math.floor(math.log(value) * SCALE_FACTOR)
    return index if index < MAX_NORMAL_INDEX else MAX_NORMAL_INDEX


# Powers of two, subnormals, the extremes and ordinary values: every branch of the mapping.
_PROBES = (1.0, 2.0, 0.5, 3.0, 1e-3, 0.1, 7.25, 1e9, 2.0**-1022, 5e-324, 1e-310, sys.float_info.max, 1.5e308)


def check() -> None:
    name = "opentelemetry.sdk.metrics._internal.exponential_histogram.mapping.logarithm_mapping.LogarithmMapping"
    require(_MAPPING is not None, f"{name} exists")
    for attribute in ("_scale_factor", "_min_normal_lower_boundary_index", "_max_normal_lower_boundary_index"):
        require(hasattr(_MAPPING, attribute), f"{name}(20).{attribute} exists")
    for value in _PROBES:
        expected = _MAPPING.map_to_index(value)  # type: ignore[union-attr]  # hasattr() was required just above
        require(
            index_at_max_scale(value) == expected,
            f"{name}(20).map_to_index({value!r}) == {expected}, as inlined (got {index_at_max_scale(value)})",
        )
    scales = _delta_scales()
    require(
        len(scales) == 2 and scales[1] == MAX_SCALE,
        f"the SDK's exponential histogram starts each delta interval at scale {MAX_SCALE} (interval scales: {scales})",
    )


def _delta_scales() -> list[int]:
    """Scales of two delta intervals of the SDK's own exponential histogram: a wide one, then one value."""
    reader = InMemoryMetricReader(preferred_temporality={Histogram: AggregationTemporality.DELTA})
    provider = MeterProvider(
        metric_readers=[reader],
        views=[View(instrument_name="otel_llm.contract", aggregation=ExponentialBucketHistogramAggregation())],
    )
    try:
        histogram = provider.get_meter("otel_llm.contract").create_histogram("otel_llm.contract")
        scales = []
        for values in ((1.5, 1e6), (1.5,)):
            for value in values:
                histogram.record(value)
            data = reader.get_metrics_data()
            assert data is not None  # the provider is live: its reader collects
            scales += [
                p.scale
                for rm in data.resource_metrics
                for sm in rm.scope_metrics
                for m in sm.metrics
                # the View above makes its one stream an exponential histogram
                for p in cast(ExponentialHistogram, m.data).data_points
            ]
        return scales
    finally:
        provider.shutdown()
