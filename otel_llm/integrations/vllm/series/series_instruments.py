"""The OpenTelemetry side of vLLM's series: the Views that rename the families recorded by a
:class:`~otel_llm.integrations.vllm.series.series.VllmSeries` to vLLM's ``vllm:`` names (``vllm.<name>``
in the ``semconv`` profile) and give histograms their buckets, and the observable instruments
of a MeterProvider that read those families at collection time."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics.view import View

from otel_llm.catalogue.metrics import SCOPE
from otel_llm.integrations.vllm.series.families import Family, construct_lock
from otel_llm.recording.cell_aggregation import InProcessHistogram
from otel_llm.recording.cells import HistogramCell
from otel_llm.recording.in_process import drain
from otel_llm.version import __version__

if TYPE_CHECKING:
    from otel_llm.integrations.vllm.series.series import VllmSeries

__all__ = ["SeriesView", "bind", "views"]


class SeriesView(View):
    """A View made for one vLLM family, so that a provider's Views can be checked for it."""

    def __init__(self, series_name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.series_name = series_name


def _recording(series: VllmSeries) -> list[Family]:
    return [f for f in series.families.values() if f.recording]


def metric_name(family: Family, naming: str) -> str:
    rest = family.name.split(":", 1)[1] if ":" in family.name else family.name
    return family.name if naming == "vllm" else f"vllm.{rest}"


def instrument_name(family: Family, naming: str) -> str:
    return metric_name(family, naming).replace(":", ".")


def views(series: VllmSeries) -> list[View]:
    """Renames (``vllm:`` names) and histogram buckets for every family ``series`` records."""
    out: list[View] = []
    for f in _recording(series):
        instrument, name = instrument_name(f, series.naming), metric_name(f, series.naming)
        kwargs: dict[str, Any] = {"instrument_name": instrument, "meter_name": SCOPE}
        if name != instrument:
            kwargs["name"] = name
        if f.kind == "histogram":
            kwargs["aggregation"] = InProcessHistogram(f.bounds)
        out.append(SeriesView(f.name, **kwargs))
    return out


def bind(series: VllmSeries, meter_provider: Any, available: Callable[[str], bool]) -> list[str]:
    """Export the families of ``series`` that ``available`` says have their Views on
    ``meter_provider`` (the latest series bound to a provider is the one its instruments read).
    Returns the names of the families left out."""
    with construct_lock:
        binding = _bindings.get(meter_provider)
        if binding is None:
            binding = _bindings[meter_provider] = _Binding(meter_provider)
        binding.series = series
        left_out = []
        for f in _recording(series):
            if not available(f.name):
                left_out.append(f.name)
            elif f.name not in binding.names:
                binding.add(f, instrument_name(f, series.naming))
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

    def add(self, family: Family, instrument: str) -> None:
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
