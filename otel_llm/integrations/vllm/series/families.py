"""The metric families vLLM's logger code builds when it records here: the part of
prometheus_client's Counter/Gauge/Histogram API that vLLM's loggers use, onto plain Python values
and histogram cells (:class:`~otel_llm.recording.cells.HistogramCell`) that the instruments read
at collection.

A family whose ``vllm:`` name the core telemetry already exports (:data:`CORE_NAMES`) records
nothing: its series are the core telemetry's.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable, Optional, Protocol, Sequence

from otel_llm.catalogue.metrics import METRICS
from otel_llm.recording.cells import HistogramCell

__all__ = [
    "CORE_NAMES",
    "CounterFamily",
    "Family",
    "FamilyOwner",
    "GaugeFamily",
    "HistogramFamily",
    "Value",
    "construct_lock",
]

CORE_NAMES = frozenset(m.vllm for m in METRICS)
# Held while vLLM's logger is built on these families, and while families are bound to a
# provider's instruments.
construct_lock = threading.Lock()


class FamilyOwner(Protocol):
    """What a family is created for: its labels' names in the export, and the families kept."""

    def otel_labels(self, labelnames: tuple[str, ...]) -> tuple[str, ...]: ...

    def add(self, family: Family) -> None: ...


class Family:
    """The part of prometheus_client's Counter/Gauge/Histogram API that vLLM's loggers use."""

    kind = ""

    def __init__(
        self,
        series: FamilyOwner,
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


class Value:
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


class CounterFamily(Family):
    kind = "counter"

    def _new_child(self, key: tuple[str, ...]) -> Value:
        return Value()


class GaugeFamily(Family):
    kind = "gauge"

    def _new_child(self, key: tuple[str, ...]) -> Value:
        return Value()


class HistogramFamily(Family):
    kind = "histogram"

    def _new_child(self, key: tuple[str, ...]) -> HistogramCell:
        return HistogramCell(self.bounds, dict(zip(self.otel_labels, key)))
