"""vLLM's ``PrometheusStatLogger`` recording into families of our own, where vLLM's code runs in
the plugin (``replace`` mode, API servers sharing the scheduler gauges).

vLLM's logger builds its metrics through the class attributes ``_gauge_cls``, ``_counter_cls``,
``_histogram_cls`` (and its helpers' ``_spec_decoding_cls``, ``_kv_connector_cls``, ...), which
vLLM's Ray integration replaces to send the same series to Ray. :func:`build_logger` replaces
them with :mod:`~otel_llm.integrations.vllm.series.families`, so the names, labels, buckets, zero
series created at start, and values are vLLM's by construction, for whatever vLLM version and
settings are running.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from otel_llm.integrations.vllm.series.families import (
    CounterFamily,
    Family,
    FamilyOwner,
    GaugeFamily,
    HistogramFamily,
    construct_lock,
)

__all__ = ["build_logger"]


def build_logger(series: FamilyOwner, vllm_config: Any, engine_indexes: list[int]) -> Any:
    """A ``PrometheusStatLogger`` of vLLM's whose families are created for ``series``."""
    from vllm.v1.metrics import loggers

    def family_class(base: type[Family]) -> type:
        return type(base.__name__, (base,), {"__init__": lambda s, *a, **k: base.__init__(s, series, *a, **k)})

    counter, gauge, histogram = family_class(CounterFamily), family_class(GaugeFamily), family_class(HistogramFamily)
    metric_classes = {"_counter_cls": counter, "_gauge_cls": gauge, "_histogram_cls": histogram}
    attrs: dict[str, Any] = dict(metric_classes)
    # The logger's helpers (speculative decoding, KV/EC connectors, performance counters)
    # take the same three class attributes.
    for helper in ("_spec_decoding_cls", "_kv_connector_cls", "_ec_connector_cls", "_perf_metrics_cls"):
        base = getattr(loggers.PrometheusStatLogger, helper, None)
        if isinstance(base, type):
            attrs[helper] = type(base.__name__, (base,), dict(metric_classes))
    attrs["_unregister_vllm_metrics"] = staticmethod(lambda: None)
    cls = type("OtelPrometheusStatLogger", (loggers.PrometheusStatLogger,), attrs)
    with construct_lock, _no_unregister(loggers):
        return cls(vllm_config, engine_indexes)


@contextlib.contextmanager
def _no_unregister(loggers: Any) -> Iterator[None]:
    """vLLM's logger unregisters every ``vllm:`` collector from prometheus_client's global
    registry when it is built, vLLM's own included: not while ours is built."""
    original = getattr(loggers, "unregister_vllm_metrics", None)
    if original is not None:
        loggers.unregister_vllm_metrics = lambda: None
    try:
        yield
    finally:
        if original is not None:
            loggers.unregister_vllm_metrics = original
