"""Histograms aggregated in-process, read by the OpenTelemetry SDK at collect time.

Why: ``Histogram.record()`` costs ~10 µs, mostly attribute copying and hashing, and the
inter-token latency alone is one observation per generated token. Here an observation is a
bisect and a list increment (~0.3 µs) on a :class:`HistogramCell` whose attribute set was
built once. The SDK sees ordinary explicit-bucket histogram points, exemplars included:

* each cell is exposed through an asynchronous "carrier" instrument whose callback yields one
  ``Observation`` per cell, with the cell itself in the observation's context;
* the carrier's View carries :class:`InProcessHistogram`, whose per-attribute-set aggregation
  binds to that cell and, at collect, turns its counts into a ``HistogramDataPoint`` (cumulative
  or delta, per reader). Every reader on the provider (in-memory, Prometheus, OTLP) gets it.

This relies on SDK internals (``_Aggregation``, ``_ExplicitBucketHistogramAggregation``), so
pyproject pins ``opentelemetry-sdk`` to 1.45.x and ``tests/test_sdk_contract.py`` holds the
contract. The same Aggregation applied to a *synchronous* histogram behaves exactly like
``ExplicitBucketHistogramAggregation``: that is how the straightforward path shares the Views.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from time import time_ns
from typing import Any, Callable, Optional, Sequence

from opentelemetry.context import Context, create_key, get_value, set_value
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import Histogram as SdkHistogram
from opentelemetry.sdk.metrics._internal.aggregation import (
    AggregationTemporality,
    _ExplicitBucketHistogramAggregation,
)
from opentelemetry.sdk.metrics._internal.exemplar import Exemplar
from opentelemetry.sdk.metrics._internal.point import HistogramDataPoint
from opentelemetry.sdk.metrics.view import Aggregation, ExplicitBucketHistogramAggregation
from opentelemetry.util.types import Attributes

_CELL_KEY = create_key("otel_llm.histogram_cell")

# An exemplar as stored by a cell: (value, time_unix_nano, trace_id, span_id, sequence number).
_StoredExemplar = tuple[float, int, Optional[int], Optional[int], int]
ExemplarIds = tuple[Optional[int], Optional[int]]  # (trace_id, span_id); (None, None) = no trace


class HistogramCell:
    """One histogram series (one attribute set), updated on the engine's hot path.

    Writers are serialised by the telemetry's lock. Readers (collect) take lock-free snapshots:
    ``count`` is derived from the bucket counts, so a collected point is never torn between
    them; ``sum`` may lag by the observation being written, and catches up at the next collect.
    """

    __slots__ = ("bounds", "counts", "total", "min", "max", "exemplars", "seq", "windows", "attributes")

    def __init__(self, bounds: Sequence[float], attributes: Attributes) -> None:
        self.bounds = tuple(bounds)
        self.attributes = attributes
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.exemplars: list[Optional[_StoredExemplar]] = [None] * len(self.counts)
        self.seq = 0
        self.windows: list[list[float]] = []  # [min, max] of each delta reader's current interval

    def observe(self, value: float, exemplar: Optional[ExemplarIds] = None) -> None:
        i = bisect_left(self.bounds, value)
        self.counts[i] += 1
        self.total += value
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value
        for window in self.windows:
            if value < window[0]:
                window[0] = value
            if value > window[1]:
                window[1] = value
        if exemplar is not None:
            self.seq += 1
            self.exemplars[i] = (value, time_ns(), exemplar[0], exemplar[1], self.seq)

    def observe_many(self, values: Sequence[float]) -> None:
        """Observe each value (no exemplars): one call for an engine step's many observations."""
        if not values:
            return
        counts, bounds = self.counts, self.bounds
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        self.total += sum(values)
        low, high = min(values), max(values)
        if low < self.min:
            self.min = low
        if high > self.max:
            self.max = high
        for window in self.windows:
            if low < window[0]:
                window[0] = low
            if high > window[1]:
                window[1] = high

    def observation(self) -> Observation:
        """What the carrier instrument's callback yields for this cell."""
        return Observation(0, self.attributes, context=set_value(_CELL_KEY, self, Context()))


class InProcessHistogram(Aggregation):
    """Explicit-bucket histogram: in-process cells for carrier instruments, the SDK's own otherwise."""

    def __init__(self, boundaries: Sequence[float]) -> None:
        self._boundaries = tuple(boundaries)
        self._standard = ExplicitBucketHistogramAggregation(boundaries=self._boundaries)

    @property
    def boundaries(self) -> tuple[float, ...]:
        return self._boundaries

    def _create_aggregation(
        self,
        instrument: Any,
        attributes: Attributes,
        reservoir_factory: Callable[..., Any],
        start_time_unix_nano: int,
    ) -> Any:
        if isinstance(instrument, SdkHistogram):
            return self._standard._create_aggregation(instrument, attributes, reservoir_factory, start_time_unix_nano)
        return _CellAggregation(attributes, start_time_unix_nano, reservoir_factory, self._boundaries)


class _CellAggregation(_ExplicitBucketHistogramAggregation):
    """Per reader and attribute set: reads the bound :class:`HistogramCell` at collect time.

    Subclassing the SDK's explicit-bucket aggregation makes the metric reader storage wrap
    the points as a ``Histogram`` for every exporter.
    """

    def __init__(self, attributes: Attributes, start_time_unix_nano: int, reservoir_factory: Callable[..., Any],
                 boundaries: tuple[float, ...]) -> None:
        super().__init__(attributes, AggregationTemporality.CUMULATIVE, start_time_unix_nano,
                         reservoir_factory(_ExplicitBucketHistogramAggregation), boundaries)
        self._cell: Optional[HistogramCell] = None
        self._last_counts: Optional[list[int]] = None  # at the previous collect (delta)
        self._last_sum = 0.0
        self._last_seq = 0
        self._window: Optional[list[float]] = None
        self._collected_at = start_time_unix_nano

    def aggregate(self, measurement: Any, should_sample_exemplar: bool = True) -> None:
        # Called with the carrier's observation just before collect: bind to its cell.
        if self._cell is None:
            cell = get_value(_CELL_KEY, measurement.context)
            if isinstance(cell, HistogramCell):
                self._cell = cell

    def collect(self, collection_aggregation_temporality: AggregationTemporality,
                collection_start_nano: int) -> Optional[HistogramDataPoint]:
        cell = self._cell
        if cell is None:
            return None
        counts = list(cell.counts)  # one C-level copy: consistent under the GIL
        total, cmin, cmax, seq = cell.total, cell.min, cell.max, cell.seq
        exemplars = self._new_exemplars(cell, seq)
        if collection_aggregation_temporality is AggregationTemporality.DELTA:
            if self._window is None:  # first delta collect: the interval so far is the whole life
                self._window = [math.inf, -math.inf]
                cell.windows.append(self._window)
                window_min, window_max = cmin, cmax
            else:
                window_min, window_max = self._window
                self._window[0], self._window[1] = math.inf, -math.inf
            previous = self._last_counts or [0] * len(counts)
            delta = [now - before for now, before in zip(counts, previous)]
            start = self._collected_at
            point_sum = total - self._last_sum
            self._last_counts, self._last_sum, self._collected_at = counts, total, collection_start_nano
            if not any(delta):
                return None
            return self._point(exemplars, start, collection_start_nano, delta, point_sum, window_min, window_max)
        # A series with no observation yet is exported at zero, as prometheus_client does
        # (the metric hub yields only cells that have observations).
        return self._point(exemplars, self._start_time_unix_nano, collection_start_nano, counts, total, cmin, cmax)

    def _new_exemplars(self, cell: HistogramCell, seq: int) -> list[Exemplar]:
        """Exemplars offered since this reader's last collect: one per bucket, the latest (like the SDK's)."""
        last = self._last_seq
        self._last_seq = seq
        if seq == last:
            return []
        return [
            Exemplar({}, value, at, span_id, trace_id)
            for value, at, trace_id, span_id, n in (e for e in cell.exemplars if e is not None)
            if n > last
        ]

    def _point(self, exemplars: list[Exemplar], start: int, now: int, counts: list[int], total: float,
               vmin: float, vmax: float) -> HistogramDataPoint:
        return HistogramDataPoint(
            attributes=self._attributes,
            exemplars=exemplars,
            start_time_unix_nano=start,
            time_unix_nano=now,
            count=sum(counts),
            sum=total,
            bucket_counts=tuple(counts),
            explicit_bounds=self._boundaries,
            min=vmin,
            max=vmax,
        )
