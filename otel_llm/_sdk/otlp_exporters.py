"""What the OTLP metric exporters read of the encoded request that otel_llm.export.metric_encoding
hands them in place of the SDK's message: whether an exporter splits its batches by size (kept in
``_max_export_batch_size``; a split reads the SDK's message), and the HTTP exporter module's count
of a request's data points (``_count_data_points``, which reads the SDK's message; older SDKs have
none)."""

from __future__ import annotations

import importlib
import inspect
import re
from types import ModuleType
from typing import Any, Callable, TypeVar

from otel_llm._sdk import require, require_parameters

HTTP_METRICS = "opentelemetry.exporter.otlp.proto.http.metric_exporter"
GRPC_METRICS = "opentelemetry.exporter.otlp.proto.grpc.metric_exporter"

_Own = TypeVar("_Own")


def splits_batches(exporter: Any) -> bool:
    """Whether the metric exporter splits each export into requests of at most
    ``max_export_batch_size`` data points (exporters that take no such setting do not split)."""
    return getattr(exporter, "_max_export_batch_size", None) is not None


def count_data_points(module: ModuleType, own: type[_Own], points: Callable[[_Own], int]) -> bool:
    """Make ``module``'s count of a request's data points count an ``own`` request by ``points``
    (the SDK's count for any other). False where the module has no such count."""
    sdk_count = getattr(module, "_count_data_points", None)
    if not callable(sdk_count):
        return False

    def count(export_request: Any) -> int:  # the SDK's parameter: check() holds once replaced
        return points(export_request) if isinstance(export_request, own) else sdk_count(export_request)

    module._count_data_points = count  # type: ignore[attr-defined]  # found by getattr above
    return True


def check() -> None:
    for name in (HTTP_METRICS, GRPC_METRICS):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue  # that exporter is not installed: nothing of it is used
        exporter = module.OTLPMetricExporter
        if "max_export_batch_size" in inspect.signature(exporter.__init__).parameters:
            # Read in the source: building a gRPC exporter opens a channel.
            source = inspect.getsource(exporter.__init__)
            require(
                re.search(r"self\._max_export_batch_size\b[^=\n]*=\s*max_export_batch_size\b", source),
                f"{name}.OTLPMetricExporter keeps max_export_batch_size in _max_export_batch_size",
            )
        count = getattr(module, "_count_data_points", None)
        if count is not None:
            require_parameters(count, ["export_request"], f"{name}._count_data_points")
