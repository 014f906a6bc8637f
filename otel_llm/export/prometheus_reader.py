"""The Prometheus endpoint's readers: opentelemetry-exporter-prometheus's reader, registered in a
given registry with a collector of our own, which adds this to upstream's translation and nothing
more:

* exemplars: upstream drops ``HistogramDataPoint.exemplars`` (opentelemetry-python PR #4178).
  Here each histogram bucket carries the most recent exemplar whose value falls in it, with
  ``trace_id``/``span_id`` labels, value and timestamp. Only the OpenMetrics format can carry
  them; the classic text format is rendered by prometheus_client unchanged (no exemplars).
  The SDK's exemplar reservoirs reset on every collection, so a scrape would see an exemplar
  once and the next scrape (or a scrape in the other format) would lose it; we keep the last
  exemplar per (series, bucket), as prometheus_client's own histograms do. Bounded: only
  series present in the latest collection are kept.
* ``le`` label values are rendered as canonical floats (``floatToGoString``: ``0.5``, ``1.0``,
  ``+Inf``), the way prometheus_client (and so vLLM's own endpoint) renders them, whether the
  configured boundaries are ints or floats. Upstream renders ``f"{bound}"`` (``1`` or ``1.0``
  depending on the Python type), and Prometheus 2.x stores ``le`` verbatim: a rule on
  ``le="1.0"`` would silently match nothing.

Where the exporter's internals are not what this relies on, the exporter's own reader and
collector, in a given registry all the same.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics.export import Histogram, HistogramDataPoint, Metric
from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.samples import Exemplar, Timestamp
from prometheus_client.utils import floatToGoString

from otel_llm._sdk import prometheus_exporter as sdk_prometheus


class _ExemplarCollector(sdk_prometheus.CustomCollector):
    """Upstream's collector, with exemplars on histogram buckets and canonical ``le``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._exemplar_lock = threading.Lock()
        # (family name, label values) -> per bucket the latest Exemplar (or None)
        self._last_exemplars: dict[tuple, list[Exemplar | None]] = {}
        self._seen: dict[tuple, list[Exemplar | None]] = {}

    def collect(self):
        # Materialized under the lock: a lock must not be held across a generator's yields.
        with self._exemplar_lock:
            self._seen = {}
            families = list(super().collect())
            # Keep only the series present in this collection: bounded by live series.
            if self._seen:
                self._last_exemplars = self._seen
        return iter(families)

    def _translate_metric(
        self,
        metric: Metric,
        scope_attrs: dict,
        resource_attrs: dict,
        metric_family_id_metric_family: dict,
    ) -> None:
        if not isinstance(metric.data, Histogram):
            super()._translate_metric(
                metric=metric,
                scope_attrs=scope_attrs,
                resource_attrs=resource_attrs,
                metric_family_id_metric_family=metric_family_id_metric_family,
            )
            return
        metric_name = self._resolve_metric_name(metric.name)
        description = metric.description or ""
        unit = sdk_prometheus.map_unit(metric.unit or "")  # type: ignore[misc]  # set when the prometheus contract holds
        label_keys, label_rows, _ = self._collect_data_points(metric.data, scope_attrs, resource_attrs)
        per_metric_family_id = "|".join((metric_name, description, unit))
        family = sdk_prometheus.get_or_create_family(  # type: ignore[misc]  # set when the prometheus contract holds
            metric_family_id_metric_family,
            "|".join([per_metric_family_id, HistogramMetricFamily.__name__]),
            HistogramMetricFamily,
            name=metric_name,
            documentation=description,
            labels=label_keys,
            unit=unit,
        )
        for point, label_values in zip(metric.data.data_points, label_rows):
            key = (family.name, tuple(label_keys), tuple(label_values))
            exemplars = self._bucket_exemplars(key, point)
            buckets: list[tuple[str, float] | tuple[str, float, Exemplar]] = []
            total = 0
            bounds = list(point.explicit_bounds) + [float("inf")]
            for i, (bound, count) in enumerate(zip(bounds, point.bucket_counts)):
                total += count
                le = floatToGoString(bound)
                exemplar = exemplars[i]
                if exemplar is not None:
                    buckets.append((le, total, exemplar))
                else:
                    buckets.append((le, total))
            family.add_metric(labels=label_values, buckets=buckets, sum_value=point.sum)

    def _bucket_exemplars(self, key: tuple, point: HistogramDataPoint) -> list[Exemplar | None]:
        nbuckets = len(point.explicit_bounds) + 1
        previous = self._last_exemplars.get(key)
        if previous is None or len(previous) != nbuckets:
            previous = [None] * nbuckets
        current = list(previous)
        newest: list[int] = [-1] * nbuckets
        for ex in point.exemplars or ():
            if not ex.trace_id or not ex.span_id:
                continue  # an exemplar without a trace links nothing
            index = bisect.bisect_left(point.explicit_bounds, ex.value)  # le is inclusive
            if ex.time_unix_nano < newest[index]:
                continue
            newest[index] = ex.time_unix_nano
            sec, nsec = divmod(int(ex.time_unix_nano), 1_000_000_000)
            current[index] = Exemplar(
                {"trace_id": format(ex.trace_id, "032x"), "span_id": format(ex.span_id, "016x")},
                ex.value,
                Timestamp(sec, nsec),
            )
        self._seen[key] = current
        return current


class _PullReader(PrometheusMetricReader):
    """A reader that scrapes collect. It has nothing to push, so a flush does not collect: the
    exporter's collector queues every collection for the next scrape, which would then serve the
    flush's samples beside its own (every series twice)."""

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    # final to the type checker only: this guard adds nothing but the check, then the SDK's own.
    def collect(self, timeout_millis: float = 10_000) -> None:  # type: ignore[misc]
        # A scrape can come between the reader's registration on the endpoint and the
        # MeterProvider taking it (setup_telemetry binds the port first): it serves nothing yet,
        # without the SDK's warning.
        if getattr(self, "_collect", None) is not None:
            super().collect(timeout_millis=timeout_millis)


class ExemplarPrometheusMetricReader(_PullReader):
    """``PrometheusMetricReader`` registering an exemplar-aware collector in a given registry."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        disable_target_info: bool = False,
        scope_info_enabled: bool = False,
        prefix: str = "",
        **kwargs: Any,
    ) -> None:
        # Upstream registers its own _CustomCollector in `registry`; build it in a throwaway
        # registry and put ours in its place in the real one.
        super().__init__(
            disable_target_info=disable_target_info,
            prefix=prefix,
            scope_info_enabled=scope_info_enabled,
            registry=CollectorRegistry(auto_describe=False),
            **kwargs,
        )
        sdk_prometheus.replace_collector(
            self,
            _ExemplarCollector(
                disable_target_info=disable_target_info,
                prefix=prefix,
                scope_info_enabled=scope_info_enabled,
                resource_attribute_filter=kwargs.get("resource_attribute_filter"),
            ),
        )
        self._registry = registry
        self._registry.register(sdk_prometheus.collector(self))
        self._unregistered = False

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        _unregister(self, self._registry)


class UpstreamPrometheusMetricReader(_PullReader):
    """The exporter's own reader and collector (no exemplars, ``le`` as the exporter writes it),
    registered in a given registry: where the exporter's internals that
    :class:`ExemplarPrometheusMetricReader` extends are not what it relies on."""

    def __init__(
        self, registry: CollectorRegistry, *, disable_target_info: bool = False, scope_info_enabled: bool = False
    ) -> None:
        if "registry" in sdk_prometheus.READER_PARAMETERS:
            super().__init__(
                disable_target_info=disable_target_info, scope_info_enabled=scope_info_enabled, registry=registry
            )
        else:  # before exporter 0.63b0: it registers in the global REGISTRY (and has no scope labels)
            super().__init__(disable_target_info=disable_target_info)
            sdk_prometheus.move_to(self, registry)
        self._registry = registry
        self._unregistered = False

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        _unregister(self, self._registry)


def _unregister(reader: Any, registry: CollectorRegistry) -> None:
    if reader._unregistered:
        return
    reader._unregistered = True
    try:
        registry.unregister(sdk_prometheus.collector(reader))
    except KeyError:
        pass
