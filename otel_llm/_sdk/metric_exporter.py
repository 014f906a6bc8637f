"""A MetricExporter's temporality and aggregation preferences, which a wrapping exporter must
pass on (the SDK keeps them in ``_preferred_temporality`` / ``_preferred_aggregation``, read by
the PeriodicExportingMetricReader at construction)."""

from __future__ import annotations

from typing import Any, Optional

from opentelemetry.sdk.metrics import Counter
from opentelemetry.sdk.metrics.export import AggregationTemporality, ConsoleMetricExporter, MetricExporter
from opentelemetry.sdk.metrics.view import Aggregation, SumAggregation

from otel_llm._sdk import require


def preferences(exporter: MetricExporter) -> tuple[Optional[dict[type, Any]], Optional[dict[type, Any]]]:
    """(preferred temporality, preferred aggregation) per instrument class, as given (None: the defaults)."""
    return exporter._preferred_temporality, exporter._preferred_aggregation


def check() -> None:
    temporality: dict[type, AggregationTemporality] = {Counter: AggregationTemporality.DELTA}
    aggregation: dict[type, Aggregation] = {Counter: SumAggregation()}
    exporter = ConsoleMetricExporter(preferred_temporality=temporality, preferred_aggregation=aggregation)
    require(
        getattr(exporter, "_preferred_temporality", None) == temporality,
        "MetricExporter._preferred_temporality holds the preferred_temporality given",
    )
    require(
        getattr(exporter, "_preferred_aggregation", None) == aggregation,
        "MetricExporter._preferred_aggregation holds the preferred_aggregation given",
    )
