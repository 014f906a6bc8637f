"""opentelemetry-exporter-prometheus internals: the collector that otel_llm.export.prometheus_reader extends
(exemplars, canonical ``le``; exporter 0.64b0+), and, for the exporter's own reader, the
collector it registers (moved into a registry of ours where the reader takes no ``registry``,
before 0.63b0)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from opentelemetry.exporter import prometheus as _exporter
from opentelemetry.exporter.prometheus import PrometheusMetricReader, _mapping
from prometheus_client import REGISTRY, CollectorRegistry

from otel_llm._sdk import require, require_parameters

# ``object``/None when the exporter lacks them: otel_llm still imports, and check() fails.
CustomCollector: type[Any] = getattr(_exporter, "_CustomCollector", object)
get_or_create_family: Optional[Callable[..., Any]] = getattr(_exporter, "_get_or_create_family", None)
map_unit: Optional[Callable[[str], str]] = getattr(_mapping, "map_unit", None)

READER_PARAMETERS = frozenset(inspect.signature(PrometheusMetricReader.__init__).parameters)


def collector(reader: PrometheusMetricReader) -> Any:
    """The collector through which ``reader`` hands its collections to prometheus_client."""
    return reader._collector


def replace_collector(reader: PrometheusMetricReader, replacement: Any) -> None:
    """Make ``replacement`` the collector that ``reader``'s collections go through; the one the
    reader registered itself stops collecting (unregister it yourself)."""
    upstream = reader._collector
    reader._collector = replacement
    replacement._callback = reader.collect
    upstream._callback = None


def move_to(reader: PrometheusMetricReader, registry: CollectorRegistry) -> None:
    """Move the collector that ``reader`` registered in prometheus_client's global REGISTRY (the
    exporter's reader before 0.63b0 registers nowhere else) into ``registry``."""
    REGISTRY.unregister(reader._collector)
    registry.register(reader._collector)


def check() -> None:
    require(CustomCollector is not object, "opentelemetry.exporter.prometheus._CustomCollector exists")
    require(get_or_create_family is not None, "opentelemetry.exporter.prometheus._get_or_create_family exists")
    require(map_unit is not None, "opentelemetry.exporter.prometheus._mapping.map_unit exists")
    require(
        {"disable_target_info", "prefix", "scope_info_enabled", "registry"} <= READER_PARAMETERS,
        "PrometheusMetricReader takes disable_target_info, prefix, scope_info_enabled, registry",
    )
    require(
        {"disable_target_info", "prefix", "scope_info_enabled", "resource_attribute_filter"}
        <= set(inspect.signature(CustomCollector.__init__).parameters),
        "_CustomCollector takes disable_target_info, prefix, scope_info_enabled, resource_attribute_filter",
    )
    require_parameters(
        getattr(CustomCollector, "_translate_metric", None),
        ["metric", "scope_attrs", "resource_attrs", "metric_family_id_metric_family"],
        "_CustomCollector._translate_metric",
    )
    require_parameters(
        getattr(CustomCollector, "_resolve_metric_name", None), ["name"], "_CustomCollector._resolve_metric_name"
    )
    require_parameters(
        getattr(CustomCollector, "_collect_data_points", None),
        ["metric_data", "scope_attrs", "resource_attrs"],
        "_CustomCollector._collect_data_points",
    )
    require_parameters(get_or_create_family, ["registry", "family_id", "factory"], "_get_or_create_family")
    assert get_or_create_family is not None  # required to exist above
    require(
        {"name", "documentation", "labels", "unit"} <= set(inspect.signature(get_or_create_family).parameters),
        "_get_or_create_family takes name, documentation, labels, unit",
    )
    reader = PrometheusMetricReader(registry=CollectorRegistry(auto_describe=False))
    require(
        isinstance(getattr(reader, "_collector", None), CustomCollector)
        and getattr(reader._collector, "_callback", None) == reader.collect,
        "PrometheusMetricReader._collector is its _CustomCollector, calling back reader.collect",
    )


def check_collector() -> None:
    """What the exporter's own reader needs from us: taking it out of the global REGISTRY (before
    0.63b0, where it takes no registry)."""
    if "registry" in READER_PARAMETERS:
        return
    reader = PrometheusMetricReader()
    try:
        require(
            getattr(reader, "_collector", None) in getattr(REGISTRY, "_collector_to_names", {}),
            "PrometheusMetricReader._collector is the collector it registered in REGISTRY",
        )
    finally:
        REGISTRY.unregister(reader._collector)
