"""A MeterProvider's Views: read (which Views was it built with) and set per reader (the SDK has
Views per provider only). Both go through the provider's ``_sdk_config`` and its reader storages,
which make their streams from the Views on an instrument's first use."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional, Sequence

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.metrics.view import View

from otel_llm._sdk import require


def provider_views(meter_provider: Any) -> Sequence[View]:
    """The Views ``meter_provider`` was built with (none for a provider that is not the SDK's)."""
    return getattr(getattr(meter_provider, "_sdk_config", None), "views", ())


def instrument_name(view: View) -> Optional[str]:
    return view._instrument_name


def aggregation(view: View) -> Any:
    return view._aggregation


def set_reader_views(meter_provider: MeterProvider, reader: Any, reader_views: Sequence[View]) -> None:
    """Give ``reader`` Views of its own, before any instrument records."""
    storage = meter_provider._measurement_consumer._reader_storages[reader]
    storage._sdk_config = dataclasses.replace(storage._sdk_config, views=list(reader_views))


def check() -> None:
    reader = InMemoryMetricReader()
    view = View(instrument_name="otel_llm.contract")
    provider = MeterProvider(metric_readers=[reader], views=[view])
    try:
        config = getattr(provider, "_sdk_config", None)
        require(
            dataclasses.is_dataclass(config) and list(getattr(config, "views", ())) == [view],
            "MeterProvider._sdk_config is a dataclass with the provider's views",
        )
        require(getattr(view, "_instrument_name", None) == "otel_llm.contract", "View._instrument_name")
        require(hasattr(view, "_aggregation"), "View._aggregation")
        storages = getattr(getattr(provider, "_measurement_consumer", None), "_reader_storages", None)
        require(
            isinstance(storages, Mapping) and reader in storages,
            "MeterProvider._measurement_consumer._reader_storages maps each reader to its storage",
        )
        assert storages is not None  # required to be a Mapping above
        storage_config = getattr(storages[reader], "_sdk_config", None)
        require(
            dataclasses.is_dataclass(storage_config) and hasattr(storage_config, "views"),
            "a reader storage's _sdk_config is a dataclass with views",
        )
        # The storage reads its Views when an instrument first records.
        set_reader_views(provider, reader, [View(instrument_name="otel_llm.contract", name="otel_llm.renamed")])
        provider.get_meter("otel_llm.contract").create_counter("otel_llm.contract").add(1)
        data = reader.get_metrics_data()
        assert data is not None  # the provider is live: its reader collects
        names = [m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]
        require(names == ["otel_llm.renamed"], f"a reader's own Views apply to its streams (got {names})")
    finally:
        provider.shutdown()
