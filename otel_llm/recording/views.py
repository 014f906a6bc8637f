"""The Views built from the metric table, and how to tell a MeterProvider was built with them."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from opentelemetry.sdk.metrics.view import View

from otel_llm._sdk import provider_views as sdk_views
from otel_llm.catalogue.metrics import BY_KEY, METRICS, SCOPE
from otel_llm.config.settings import TelemetryConfig
from otel_llm.recording.cell_aggregation import InProcessHistogram


def views(config: Optional[TelemetryConfig] = None) -> list[View]:
    """Every View the telemetry needs: renames (``vllm:`` names) and explicit buckets (or, with
    ``config.histogram_aggregation`` base2_exponential_bucket_histogram, exponential ones for the
    histograms that are not ``explicit_only``).

    Pass them when you build your own MeterProvider: ``MeterProvider(views=otel_llm.views(config))``.
    """
    config = config or TelemetryConfig()
    by_preemptions = {"request_num_preemptions", "request_num_preemptions_caused"}
    allowed = {m.key for m in METRICS if m.kind == "histogram"} - by_preemptions
    unknown = sorted(set(config.histogram_buckets) - allowed)
    if unknown:
        raise ValueError(
            f"histogram_buckets: {unknown} are not histogram keys of otel_llm.catalogue.metrics.METRICS "
            "(request_num_preemptions and request_num_preemptions_caused have preemption_buckets)"
        )
    out = []
    for m in METRICS:
        instrument = m.instrument_name(config.naming)
        rename = m.name(config.naming) if instrument != m.name(config.naming) else None
        if m.kind == "histogram":
            aggregation = InProcessHistogram(m.boundaries(config), exponential=m.exponential(config))
            out.append(View(instrument_name=instrument, meter_name=SCOPE, name=rename, aggregation=aggregation))
        elif rename:
            out.append(View(instrument_name=instrument, meter_name=SCOPE, name=rename))
    return out


def use_reader_views(meter_provider: Any, reader: Any, reader_views: Sequence[View]) -> None:
    """Give one reader of ``meter_provider`` Views of its own (the SDK has Views per provider only):
    OTLP readers get exponential histograms while a Prometheus reader keeps explicit buckets.
    Before any instrument records (its streams are made from the Views on first use). Relies on
    SDK internals (otel_llm._sdk.provider_views)."""
    sdk_views.set_reader_views(meter_provider, reader, reader_views)


def provider_has_views(meter_provider: Any, config: TelemetryConfig) -> bool:
    """True when ``meter_provider`` was built with :func:`views` for this naming profile."""
    wanted = BY_KEY["inter_token_latency_seconds"].instrument_name(config.naming)
    return any(
        isinstance(sdk_views.aggregation(v), InProcessHistogram) and sdk_views.instrument_name(v) == wanted
        for v in sdk_views.provider_views(meter_provider)
    )
