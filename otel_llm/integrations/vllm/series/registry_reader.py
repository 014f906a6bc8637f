"""vLLM's series read where vLLM's own ``PrometheusStatLogger`` records them (``add`` mode):
:class:`RegistryReader` turns a family's values in prometheus_client's registry into
OpenTelemetry observations at collection time, sample for sample."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from opentelemetry.metrics import Observation

from otel_llm.integrations.vllm.series.families import Family
from otel_llm.recording.cells import HistogramCell

__all__ = ["RegistryReader"]

# The name a family's prometheus_client metric is registered under, by kind.
_REGISTERED_NAME: dict[str, Callable[[str], str]] = {
    "counter": lambda name: f"{name}_total",
    "gauge": lambda name: name,
    "histogram": lambda name: f"{name}_bucket",
}
_ATTRIBUTE_SETS_KEPT = 4096  # of vLLM's series read; cleared when full (label values vLLM let grow)


class RegistryReader:
    """The observations of vLLM's families as vLLM's logger holds them in ``registry``
    (prometheus_client's global ``REGISTRY``, where vLLM's metrics register)."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self._cells: dict[tuple[str, tuple[tuple[str, str], ...]], HistogramCell] = {}
        self._attributes: dict[tuple[str, tuple[str, ...]], dict[str, str]] = {}

    def read(self, family: Family) -> Iterator[Observation]:
        """The observations of ``family`` (none when vLLM has no such family). A histogram's
        buckets and sum are vLLM's; it keeps no minimum or maximum (exported as the SDK does
        without them: +inf and -inf)."""
        observations = self.read_values(family)
        if observations is None:
            observations = self.read_samples(family)
        return iter(observations)

    def read_values(self, family: Family) -> Optional[list[Observation]]:
        """The observations read from the values of vLLM's prometheus_client metric itself: what
        its ``collect()`` would give, without building a sample per bucket (a third of a
        collection's cost in vLLM's API server). None where the metric is not of the shape
        read here (another prometheus_client, a gauge set to a function): read its samples."""
        registered = getattr(self.registry, "_names_to_collectors", None)
        if not isinstance(registered, dict):
            return None
        metric = registered.get(_REGISTERED_NAME[family.kind](family.name))
        if metric is None:
            return []  # vLLM has no such family
        try:
            names = metric._labelnames
            if names:
                with metric._lock:
                    children = list(metric._metrics.items())
            else:
                children = [((), metric)]
            out = []
            for values, child in children:
                # Gauge.set_function sets the child's own _child_samples (looked up, not through
                # vars(): a materialised __dict__ would slow every attribute read on vLLM's hot path).
                if getattr(child._child_samples, "__func__", None) is not type(child)._child_samples:
                    return None
                if family.kind != "histogram":
                    out.append(Observation(child._value.get(), self._attributes_of(family, names, values)))
                    continue
                buckets = child._buckets
                if len(buckets) != len(family.bounds) + 1:
                    continue  # not the buckets vLLM's code gave this family here: no point rather than a wrong one
                key = (family.name, tuple(zip(names, values)))
                cell = self._cells.get(key)
                if cell is None:
                    cell = self._cells[key] = HistogramCell(family.bounds, self._attributes_of(family, names, values))
                cell.counts = [int(b.get()) for b in buckets]
                cell.total = child._sum.get()
                out.append(cell.observation())
            return out
        except (AttributeError, TypeError):
            return None

    def _attributes_of(self, family: Family, names: tuple[str, ...], values: tuple[str, ...]) -> dict[str, str]:
        key = (family.name, values)
        attributes = self._attributes.get(key)
        if attributes is None:
            if len(self._attributes) >= _ATTRIBUTE_SETS_KEPT:
                self._attributes.clear()
            rename = dict(zip(family.labelnames, family.otel_labels))
            attributes = self._attributes[key] = {rename.get(n, n): v for n, v in zip(names, values)}
        return attributes

    def read_samples(self, family: Family) -> list[Observation]:
        """The observations read from the samples the registry collects for ``family``."""
        name = family.name
        wanted = {"counter": (f"{name}_total",), "gauge": (name,), "histogram": (f"{name}_bucket", f"{name}_sum")}
        rename = dict(zip(family.labelnames, family.otel_labels))
        out = []
        histograms: dict[tuple[tuple[str, str], ...], tuple[list[float], list[float]]] = {}
        for metric in self.registry.restricted_registry(wanted[family.kind]).collect():
            for s in metric.samples:
                if family.kind != "histogram":
                    out.append(Observation(s.value, {rename.get(k, k): v for k, v in s.labels.items()}))
                    continue
                key = tuple((k, v) for k, v in s.labels.items() if k != "le")
                cumulative, total = histograms.setdefault(key, ([], []))
                (cumulative if s.name.endswith("_bucket") else total).append(s.value)
        for key, (cumulative, total) in histograms.items():
            if len(cumulative) != len(family.bounds) + 1 or len(total) != 1:
                continue  # not the buckets vLLM's code gave this family here: no point rather than a wrong one
            cell = self._cells.get((name, key))
            if cell is None:
                cell = HistogramCell(family.bounds, {rename.get(k, k): v for k, v in key})
                self._cells[(name, key)] = cell
            # prometheus_client's buckets are cumulative, in bound order, +Inf last.
            cell.counts = [int(c - b) for c, b in zip(cumulative, [0.0, *cumulative[:-1]])]
            cell.total = total[0]
            out.append(cell.observation())
        return out
