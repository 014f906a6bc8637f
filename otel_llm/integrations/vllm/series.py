"""Every other series of vLLM's Prometheus logger, through OpenTelemetry.

The core telemetry (:mod:`otel_llm.catalogue.metrics`) reproduces vLLM's request, token, latency and
preemption metrics with its own logic (exemplars, spans, the never-preempted bucket). vLLM
exports many more: prefix and multi-modal cache counters, prompt tokens by source, waiting
requests by reason, ``cache_config_info``, sleep state, admission rejections, estimated FLOPs
and bytes, and, when the feature is on, speculative decoding, KV connector, LoRA and KV block
metrics. Those are reproduced here *by vLLM's own code*: vLLM's ``PrometheusStatLogger`` builds
its metrics through the class attributes ``_gauge_cls``, ``_counter_cls``, ``_histogram_cls``
(and its helpers' ``_spec_decoding_cls``, ``_kv_connector_cls``, ...), which vLLM's Ray
integration replaces to send the same series to Ray. :class:`VllmSeries` replaces them with
recording families of its own, so the names, labels, buckets, zero series created at start,
and values are vLLM's by construction, for whatever vLLM version and settings are running.

Families that the core telemetry already exports (``vllm:`` names of :data:`otel_llm.catalogue.metrics.METRICS`)
are left to it: here they record nothing (beside vLLM's logger, the adapter has those of each step
read from vLLM's registry by :meth:`VllmSeries.read` too). The rest are OpenTelemetry observable instruments
reading plain Python values (a histogram is an :class:`~otel_llm.recording.cells.HistogramCell`),
renamed to vLLM's ``vllm:`` names by Views, which must exist when the MeterProvider is built:
``setup_telemetry(config, extra_views=series.views())`` (the plugin does this itself). In the
``semconv`` naming profile the names are ``vllm.<name>`` and the ``model_name``/``engine``
labels are ``gen_ai.request.model``/``llm.engine``.

Beside vLLM's own logger (``add`` mode) that code need not run twice: vLLM's logger records
every one of these series into prometheus_client's registry anyway, so after
:meth:`VllmSeries.read_from` the instruments read them there at collection time, sample for
sample, and nothing here runs per engine step. Where vLLM's logger is not built (``replace``
mode), or where the API servers share the scheduler gauges, vLLM's code runs here, on
:attr:`VllmSeries.logger`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics.view import View

from otel_llm.catalogue.metrics import METRICS, SCOPE
from otel_llm.recording.cell_aggregation import InProcessHistogram
from otel_llm.recording.cells import HistogramCell
from otel_llm.recording.in_process import drain
from otel_llm.version import __version__

__all__ = ["VllmSeries", "SeriesView"]

CORE_NAMES = frozenset(m.vllm for m in METRICS)
# The name a family's prometheus_client metric is registered under, by kind.
_REGISTERED_NAME: dict[str, Callable[[str], str]] = {
    "counter": lambda name: f"{name}_total",
    "gauge": lambda name: name,
    "histogram": lambda name: f"{name}_bucket",
}
_SEMCONV_LABELS = {"model_name": "gen_ai.request.model", "engine": "llm.engine"}
_ATTRIBUTE_SETS_KEPT = 4096  # of vLLM's series read; cleared when full (label values vLLM let grow)
_construct_lock = threading.Lock()
_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs


class SeriesView(View):
    """A View made for one vLLM family, so that a provider's Views can be checked for it."""

    def __init__(self, series_name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.series_name = series_name


class _Family:
    """The part of prometheus_client's Counter/Gauge/Histogram API that vLLM's loggers use."""

    kind = ""

    def __init__(
        self,
        series: "VllmSeries",
        name: str,
        documentation: str = "",
        labelnames: Sequence[str] = (),
        buckets: Optional[Sequence[float]] = None,
        **_: Any,
    ) -> None:
        if self.kind == "counter" and name.endswith("_total"):
            name = name[: -len("_total")]  # prometheus_client's rule: the exported name gets it back
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.otel_labels = series.otel_labels(self.labelnames)
        self.bounds: tuple[float, ...] = ()
        if buckets is not None:
            self.bounds = tuple(sorted({float(b) for b in buckets if not math.isinf(float(b))}))
        self.children: dict[tuple[str, ...], Any] = {}
        self.recording = name not in CORE_NAMES
        series.add(self)
        self._value: Any = None
        if not self.labelnames:
            self._value = self._child(())

    def labels(self, *values: Any, **kwargs: Any) -> Any:
        if kwargs:
            values = tuple(kwargs[n] for n in self.labelnames)
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(values)} label values for labels {self.labelnames}")
        key = tuple(str(v) for v in values)
        child = self.children.get(key)
        if child is None:
            child = self._child(key)
        return child

    def _child(self, key: tuple[str, ...]) -> Any:
        if not self.recording:
            return _NOOP
        child = self.children[key] = self._new_child(key)
        return child

    def _new_child(self, key: tuple[str, ...]) -> Any:
        raise NotImplementedError

    # An unlabelled family is its own single series.
    def inc(self, amount: float = 1) -> None:
        self._value.inc(amount)

    def dec(self, amount: float = 1) -> None:
        self._value.dec(amount)

    def set(self, value: float) -> None:
        self._value.set(value)

    def set_to_current_time(self) -> None:
        self._value.set_to_current_time()

    def observe(self, value: float) -> None:
        self._value.observe(value)


class _Value:
    """A series' value; ``read``, when set, is what collection exports instead (None: nothing)."""

    __slots__ = ("value", "read")

    def __init__(self) -> None:
        self.value = 0.0
        self.read: Optional[Callable[[], Optional[float]]] = None

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)

    def set_to_current_time(self) -> None:
        self.value = time.time()


class _NoOp:
    def inc(self, amount: float = 1) -> None: ...
    def dec(self, amount: float = 1) -> None: ...
    def set(self, value: float) -> None: ...
    def set_to_current_time(self) -> None: ...
    def observe(self, value: float) -> None: ...


_NOOP = _NoOp()


class _Counter(_Family):
    kind = "counter"

    def _new_child(self, key: tuple[str, ...]) -> _Value:
        return _Value()


class _Gauge(_Family):
    kind = "gauge"

    def _new_child(self, key: tuple[str, ...]) -> _Value:
        return _Value()


class _Histogram(_Family):
    kind = "histogram"

    def _new_child(self, key: tuple[str, ...]) -> HistogramCell:
        return HistogramCell(self.bounds, dict(zip(self.otel_labels, key)))


class VllmSeries:
    """vLLM's ``PrometheusStatLogger`` recording into OpenTelemetry (see the module docstring).

    ``record``, ``record_sleep_state``, ``record_admission_rejection`` and
    ``log_engine_initialized`` are vLLM's own methods; :meth:`bind` creates the instruments on
    a MeterProvider built with :meth:`views`.
    """

    def __init__(self, vllm_config: Any, engine_indexes: Sequence[int], naming: str = "vllm") -> None:
        self.naming = naming
        self.families: dict[str, _Family] = {}
        # A prometheus_client registry where vLLM's own logger records these series: read there
        # at collection (read_from); None: recorded here by ``logger``.
        self.source: Optional[Any] = None
        self._failed: set[str] = set()  # logger methods whose failure was reported
        self._read_cells: dict[tuple[str, tuple[tuple[str, str], ...]], HistogramCell] = {}
        self._read_attributes: dict[tuple[str, tuple[str, ...]], dict[str, str]] = {}
        # Families recorded but not exported by this process: another process reports them.
        self.withheld: set[str] = set()
        self.logger = self._build(vllm_config, list(engine_indexes))
        # The info gauge (cache_config_info) is created when the engine reports it is up, after
        # the providers exist: declared now so that its View exists, exported from vLLM's call on.
        before = set(self.families)
        self.logger.log_engine_initialized()
        for name in set(self.families) - before:
            self.families[name].children.clear()

    def run(self, method: str, *args: Any, **kwargs: Any) -> None:
        """One of vLLM's own logger methods on :attr:`logger` (none when the series are read
        from vLLM's own logger); a failure is reported once and leaves the rest untouched."""
        if self.source is not None:
            return
        try:
            getattr(self.logger, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - vLLM's own logger code must not break the telemetry's hook
            if method not in self._failed:
                self._failed.add(method)
                _log.warning(
                    "otel-llm vLLM adapter: vLLM's PrometheusStatLogger.%s failed (%r): vLLM's series beyond "
                    "the core metrics may be incomplete (reported once)",
                    method,
                    exc,
                )

    def read_from(self, registry: Any) -> None:
        """Export the values vLLM's own logger holds in ``registry`` (prometheus_client's global
        ``REGISTRY``, where vLLM's metrics register) instead of recording them here: from now on
        nobody calls ``logger``'s methods."""
        self.source = registry

    def read(self, family: _Family) -> Iterator[Observation]:
        """The observations of ``family`` as vLLM's logger holds them in :attr:`source` (none
        when vLLM has no such family). A histogram's buckets and sum are vLLM's; it keeps no
        minimum or maximum (exported as the SDK does without them: +inf and -inf)."""
        assert self.source is not None
        observations = self._read_values(family)
        if observations is None:
            observations = self._read_samples(family)
        return iter(observations)

    def _read_values(self, family: _Family) -> Optional[list[Observation]]:
        """The observations read from the values of vLLM's prometheus_client metric itself: what
        its ``collect()`` would give, without building a sample per bucket (a third of a
        collection's cost in vLLM's API server). None where the metric is not of the shape
        read here (another prometheus_client, a gauge set to a function): read its samples."""
        registered = getattr(self.source, "_names_to_collectors", None)
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
                    out.append(Observation(child._value.get(), self._attributes(family, names, values)))
                    continue
                buckets = child._buckets
                if len(buckets) != len(family.bounds) + 1:
                    continue  # not the buckets vLLM's code gave this family here: no point rather than a wrong one
                key = (family.name, tuple(zip(names, values)))
                cell = self._read_cells.get(key)
                if cell is None:
                    cell = self._read_cells[key] = HistogramCell(family.bounds, self._attributes(family, names, values))
                cell.counts = [int(b.get()) for b in buckets]
                cell.total = child._sum.get()
                out.append(cell.observation())
            return out
        except (AttributeError, TypeError):
            return None

    def _attributes(self, family: _Family, names: tuple[str, ...], values: tuple[str, ...]) -> dict[str, str]:
        key = (family.name, values)
        attributes = self._read_attributes.get(key)
        if attributes is None:
            if len(self._read_attributes) >= _ATTRIBUTE_SETS_KEPT:
                self._read_attributes.clear()
            rename = dict(zip(family.labelnames, family.otel_labels))
            attributes = self._read_attributes[key] = {rename.get(n, n): v for n, v in zip(names, values)}
        return attributes

    def _read_samples(self, family: _Family) -> list[Observation]:
        """The observations read from the samples vLLM's registry collects for ``family``."""
        assert self.source is not None
        name = family.name
        wanted = {"counter": (f"{name}_total",), "gauge": (name,), "histogram": (f"{name}_bucket", f"{name}_sum")}
        rename = dict(zip(family.labelnames, family.otel_labels))
        out = []
        histograms: dict[tuple[tuple[str, str], ...], tuple[list[float], list[float]]] = {}
        for metric in self.source.restricted_registry(wanted[family.kind]).collect():
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
            cell = self._read_cells.get((name, key))
            if cell is None:
                cell = HistogramCell(family.bounds, {rename.get(k, k): v for k, v in key})
                self._read_cells[(name, key)] = cell
            # prometheus_client's buckets are cumulative, in bound order, +Inf last.
            cell.counts = [int(c - b) for c, b in zip(cumulative, [0.0, *cumulative[:-1]])]
            cell.total = total[0]
            out.append(cell.observation())
        return out

    def otel_labels(self, labelnames: tuple[str, ...]) -> tuple[str, ...]:
        if self.naming == "vllm":
            return labelnames
        return tuple(_SEMCONV_LABELS.get(n, n) for n in labelnames)

    def add(self, family: _Family) -> None:
        # The same name twice (vLLM re-creating an info gauge): the latest family is the one in use.
        self.families[family.name] = family

    def _build(self, vllm_config: Any, engine_indexes: list[int]) -> Any:
        from vllm.v1.metrics import loggers

        series = self

        def family_class(base: type[_Family]) -> type:
            return type(base.__name__, (base,), {"__init__": lambda s, *a, **k: base.__init__(s, series, *a, **k)})

        counter, gauge, histogram = family_class(_Counter), family_class(_Gauge), family_class(_Histogram)
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
        with _construct_lock, _no_unregister(loggers):
            return cls(vllm_config, engine_indexes)

    # -- OpenTelemetry -------------------------------------------------------------------

    def _recording(self) -> list[_Family]:
        return [f for f in self.families.values() if f.recording]

    def metric_name(self, family: _Family) -> str:
        rest = family.name.split(":", 1)[1] if ":" in family.name else family.name
        return family.name if self.naming == "vllm" else f"vllm.{rest}"

    def instrument_name(self, family: _Family) -> str:
        return self.metric_name(family).replace(":", ".")

    def views(self) -> list[View]:
        """Renames (``vllm:`` names) and histogram buckets for every family recorded here."""
        out: list[View] = []
        for f in self._recording():
            instrument, name = self.instrument_name(f), self.metric_name(f)
            kwargs: dict[str, Any] = {"instrument_name": instrument, "meter_name": SCOPE}
            if name != instrument:
                kwargs["name"] = name
            if f.kind == "histogram":
                kwargs["aggregation"] = InProcessHistogram(f.bounds)
            out.append(SeriesView(f.name, **kwargs))
        return out

    def bind(self, meter_provider: Any, available: Callable[[str], bool] = lambda _name: True) -> list[str]:
        """Export the families that ``available`` says have their Views on ``meter_provider``
        (the latest series bound to a provider is the one its instruments read). Returns the
        names of the families left out."""
        with _construct_lock:
            binding = _bindings.get(meter_provider)
            if binding is None:
                binding = _bindings[meter_provider] = _Binding(meter_provider)
            binding.series = self
            left_out = []
            for f in self._recording():
                if not available(f.name):
                    left_out.append(f.name)
                elif f.name not in binding.names:
                    binding.add(f, self.instrument_name(f))
            return left_out


class _Binding:
    """The instruments of one MeterProvider: created once per family name (the SDK ignores the
    callbacks of an instrument created again), reading the latest series bound."""

    def __init__(self, meter_provider: Any) -> None:
        self.meter: Meter = meter_provider.get_meter(SCOPE, __version__)
        # Weakly: the bindings are kept by provider, weakly, and must not keep it alive.
        self.provider = weakref.ref(meter_provider)
        self.series: Optional[VllmSeries] = None
        self.names: set[str] = set()

    def add(self, family: _Family, instrument: str) -> None:
        self.names.add(family.name)
        create = {
            "counter": self.meter.create_observable_counter,
            "gauge": self.meter.create_observable_gauge,
            "histogram": self.meter.create_observable_counter,
        }[family.kind]
        create(instrument, [self._callback(family.name)], "", family.documentation)

    def _callback(self, name: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        def callback(options: CallbackOptions) -> Iterator[Observation]:
            series = self.series
            if series is None:
                return
            family = series.families.get(name)
            if family is None or not family.recording or name in series.withheld:
                return
            if series.source is not None:
                yield from series.read(family)
                return
            # The values recorded here come from the engine steps the telemetry keeps.
            provider = self.provider()
            if provider is not None:
                drain(provider, options)
            for key, child in list(family.children.items()):
                if isinstance(child, HistogramCell):
                    yield child.observation()
                else:
                    value = child.value if child.read is None else child.read()
                    if value is not None:
                        yield Observation(value, dict(zip(family.otel_labels, key)))

        return callback


_bindings: "weakref.WeakKeyDictionary[Any, _Binding]" = weakref.WeakKeyDictionary()


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
