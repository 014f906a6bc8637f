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

With ``exponential=True`` (OTLP's ``base2_exponential_bucket_histogram``), an
:class:`ExponentialHistogramCell` also keeps base-2 exponential buckets, and the View's
aggregation exports them as exponential histogram points, bucket for bucket what the SDK's own
exponential aggregation gives for the same observations and collections (scale, offsets,
counts; tests/core/test_exponential.py); a cell keeps both, so a Prometheus reader on the same
provider can still read its explicit buckets.

This relies on SDK internals (``Aggregation._create_aggregation``, the histogram aggregation
classes, the exponential mapping), all in :mod:`otel_llm._sdk` with their contract checks; where
they do not hold, the telemetry records through the SDK's instruments instead. The same
Aggregation applied to a *synchronous* histogram behaves exactly like
``ExplicitBucketHistogramAggregation``: that is how the straightforward path shares the Views.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from time import time_ns
from typing import Any, Callable, Optional, Sequence

from opentelemetry.context import Context, create_key, get_value, set_value
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import Exemplar
from opentelemetry.sdk.metrics import Histogram as SdkHistogram
from opentelemetry.sdk.metrics.export import AggregationTemporality, ExponentialHistogramDataPoint, HistogramDataPoint
from opentelemetry.sdk.metrics.export import Buckets as BucketsPoint
from opentelemetry.sdk.metrics.view import (
    Aggregation,
    ExplicitBucketHistogramAggregation,
    ExponentialBucketHistogramAggregation,
)
from opentelemetry.util.types import Attributes

from ._sdk import aggregation as sdk_aggregation
from ._sdk.exponential_mapping import MAX_SCALE, index_at_max_scale

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
        self.total: float = 0  # stays an int while every observation is one, as the SDK's sum
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


# The SDK's exponential histogram default (OTel spec): 160 buckets per sign, from scale MAX_SCALE (20).
MAX_SIZE = 160


class ExponentialBuckets:
    """Base-2 exponential buckets as the SDK's aggregation keeps them: a value goes to its index
    at the current scale (the SDK's own mapping at scale 20, shifted: exact, since the mapping's
    scale factor is a power of two), and the scale drops just enough to keep each sign's indices
    within MAX_SIZE buckets. ``state`` is replaced whole on a rescale, so a reader's snapshot is
    never torn between scale and counts."""

    __slots__ = ("state", "zero")

    def __init__(self) -> None:
        self.state: tuple[int, dict[int, int], dict[int, int]] = (MAX_SCALE, {}, {})  # scale, positive, negative
        self.zero = 0

    def add(self, index: int, negative: bool) -> None:
        """``index``: the value's index at MAX_SCALE."""
        scale, positive, negative_buckets = self.state
        buckets = negative_buckets if negative else positive
        i = index >> (MAX_SCALE - scale)
        count = buckets.get(i)
        if count is not None:
            buckets[i] = count + 1
            return
        if buckets:
            low, high = min(buckets), max(buckets)
            low, high = min(low, i), max(high, i)
            change = 0
            while (high >> change) - (low >> change) >= MAX_SIZE:
                change += 1
            if change:
                scale -= change
                positive, negative_buckets = _downscale(positive, change), _downscale(negative_buckets, change)
                self.state = (scale, positive, negative_buckets)
                buckets = negative_buckets if negative else positive
                i = index >> (MAX_SCALE - scale)
        buckets[i] = buckets.get(i, 0) + 1


def _downscale(buckets: dict[int, int], change: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for i, n in buckets.items():
        out[i >> change] = out.get(i >> change, 0) + n
    return out


def _buckets_point(buckets: dict[int, int]) -> BucketsPoint:
    if not buckets:
        return BucketsPoint(offset=0, bucket_counts=[])
    low, high = min(buckets), max(buckets)
    return BucketsPoint(offset=low, bucket_counts=[buckets.get(i, 0) for i in range(low, high + 1)])


class ExponentialHistogramCell(HistogramCell):
    """A HistogramCell that also keeps exponential buckets: for all time (cumulative readers) and
    per delta reader for its current interval (``intervals``, reset at each of its collects)."""

    __slots__ = ("exponential", "intervals", "lock")

    def __init__(self, bounds: Sequence[float], attributes: Attributes) -> None:
        super().__init__(bounds, attributes)
        self.exponential = ExponentialBuckets()
        self.intervals: list[ExponentialBuckets] = []
        self.lock = threading.Lock()  # a leaf lock: between this writer and delta readers' resets

    def observe(self, value: float, exemplar: Optional[ExemplarIds] = None) -> None:
        HistogramCell.observe(self, value, exemplar)
        if value > 0:  # the common case inline: a positive value into a bucket that exists
            index, negative = index_at_max_scale(value), False
            scale, positive, _ = self.exponential.state
            i = index >> (MAX_SCALE - scale)
            count = positive.get(i)
            if count is not None:
                positive[i] = count + 1
            else:
                self.exponential.add(index, False)
        else:
            index, negative = (index_at_max_scale(-value), True) if value < 0 else (0, False)
            _add(self.exponential, value, index, negative)
        if self.intervals:
            with self.lock:
                for buckets in self.intervals:
                    _add(buckets, value, index, negative)

    def observe_many(self, values: Sequence[float]) -> None:
        for value in values:
            self.observe(value)


def _add(buckets: ExponentialBuckets, value: float, index: int, negative: bool) -> None:
    if value == 0:
        buckets.zero += 1
    else:
        buckets.add(index, negative)


class InProcessHistogram(Aggregation):
    """Explicit-bucket (or exponential) histogram: in-process cells for carrier instruments,
    the SDK's own aggregation otherwise."""

    def __init__(self, boundaries: Sequence[float], exponential: bool = False) -> None:
        self._boundaries = tuple(boundaries)
        self.exponential = exponential
        self._standard = (
            ExponentialBucketHistogramAggregation()
            if exponential
            else ExplicitBucketHistogramAggregation(boundaries=self._boundaries)
        )

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
        if self.exponential:
            return _ExponentialCellAggregation(attributes, start_time_unix_nano, reservoir_factory)
        return _CellAggregation(attributes, start_time_unix_nano, reservoir_factory, self._boundaries)


def _bind(aggregation: Any, measurement: Any) -> None:
    """Called with the carrier's observation just before collect: bind to its cell."""
    if aggregation._cell is None:
        cell = get_value(_CELL_KEY, measurement.context)
        if isinstance(cell, HistogramCell):
            aggregation._cell = cell


def _new_exemplars(aggregation: Any, cell: HistogramCell, seq: int) -> list[Exemplar]:
    """Exemplars offered since this reader's last collect: one per explicit bucket, the latest (like
    the SDK's aligned reservoir); exponential points carry the same ones."""
    last = aggregation._last_seq
    aggregation._last_seq = seq
    if seq == last:
        return []
    return [
        Exemplar({}, value, at, span_id, trace_id)
        for value, at, trace_id, span_id, n in (e for e in cell.exemplars if e is not None)
        if n > last
    ]


class _CellAggregation(sdk_aggregation.ExplicitBucketHistogramAggregation):
    """Per reader and attribute set: reads the bound :class:`HistogramCell` at collect time.

    Subclassing the SDK's explicit-bucket aggregation makes the metric reader storage wrap
    the points as a ``Histogram`` for every exporter.
    """

    def __init__(
        self,
        attributes: Attributes,
        start_time_unix_nano: int,
        reservoir_factory: Callable[..., Any],
        boundaries: tuple[float, ...],
    ) -> None:
        super().__init__(
            attributes,
            AggregationTemporality.CUMULATIVE,
            start_time_unix_nano,
            reservoir_factory(sdk_aggregation.ExplicitBucketHistogramAggregation),
            boundaries,
        )
        self._cell: Optional[HistogramCell] = None
        self._last_counts: Optional[list[int]] = None  # at the previous collect (delta)
        self._last_sum: float = 0
        self._last_seq = 0
        self._window: Optional[list[float]] = None
        self._collected_at = start_time_unix_nano

    def aggregate(self, measurement: Any, should_sample_exemplar: bool = True) -> None:
        _bind(self, measurement)

    def collect(
        self, collection_aggregation_temporality: AggregationTemporality, collection_start_nano: int
    ) -> Optional[HistogramDataPoint]:
        cell = self._cell
        if cell is None:
            return None
        counts = list(cell.counts)  # one C-level copy: consistent under the GIL
        total, cmin, cmax, seq = cell.total, cell.min, cell.max, cell.seq
        exemplars = _new_exemplars(self, cell, seq)
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

    def _point(
        self, exemplars: list[Exemplar], start: int, now: int, counts: list[int], total: float, vmin: float, vmax: float
    ) -> HistogramDataPoint:
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


class _ExponentialCellAggregation(sdk_aggregation.ExponentialBucketHistogramAggregation):
    """Per reader and attribute set: reads the bound :class:`ExponentialHistogramCell` at collect
    time, as exponential histogram points equal to the SDK's for a synchronous histogram:

    * cumulative: the cell's all-time buckets; like the SDK, an interval with nothing but zeros
      caps this reader's scale at 0 from then on (the SDK reports scale 0 for it and merges);
    * delta: this reader's interval buckets, new at each collect (the SDK starts a new
      aggregation per delta interval); an interval of zeros only has scale 0.

    Subclassing the SDK's exponential aggregation makes the metric reader storage wrap the
    points as an ``ExponentialHistogram`` for every exporter.
    """

    def __init__(
        self, attributes: Attributes, start_time_unix_nano: int, reservoir_factory: Callable[..., Any]
    ) -> None:
        super().__init__(
            attributes,
            reservoir_factory(sdk_aggregation.ExponentialBucketHistogramAggregation),
            AggregationTemporality.CUMULATIVE,
            start_time_unix_nano,
        )
        self._cell: Optional[HistogramCell] = None
        self._last_seq = 0
        self._last_count = 0
        self._last_zero = 0
        self._max_scale = MAX_SCALE  # cumulative: lowered to 0 by an interval of zeros only
        self._interval: Optional[ExponentialBuckets] = None  # delta
        self._last_sum: float = 0
        self._collected_at = start_time_unix_nano

    def aggregate(self, measurement: Any, should_sample_exemplar: bool = True) -> None:
        _bind(self, measurement)

    def collect(
        self, collection_aggregation_temporality: AggregationTemporality, collection_start_nano: int
    ) -> Optional[ExponentialHistogramDataPoint]:
        cell = self._cell
        if not isinstance(cell, ExponentialHistogramCell):
            return None
        exemplars = _new_exemplars(self, cell, cell.seq)
        total, cmin, cmax = cell.total, cell.min, cell.max
        if collection_aggregation_temporality is AggregationTemporality.DELTA:
            with cell.lock:
                if self._interval is None:  # first delta collect: the interval so far is the whole life
                    buckets = cell.exponential
                    window = [math.inf, -math.inf]
                    cell.windows.append(window)
                    self._window, window_min, window_max = window, cmin, cmax
                else:
                    buckets = self._interval
                    window_min, window_max = self._window
                    self._window[0], self._window[1] = math.inf, -math.inf
                self._interval = ExponentialBuckets()
                cell.intervals = [b for b in cell.intervals if b is not buckets] + [self._interval]
                scale, positive, negative = buckets.state
                zero = buckets.zero
                positive, negative = dict(positive), dict(negative)
            start, point_sum = self._collected_at, total - self._last_sum
            self._last_sum, self._collected_at = total, collection_start_nano
            count = zero + sum(positive.values()) + sum(negative.values())
            if not count:
                return None
            if count == zero:
                scale = 0
            return self._point(
                exemplars,
                start,
                collection_start_nano,
                count,
                point_sum,
                scale,
                zero,
                positive,
                negative,
                window_min,
                window_max,
            )
        buckets = cell.exponential
        scale, positive, negative = buckets.state
        zero = buckets.zero
        positive, negative = dict(positive), dict(negative)
        count = zero + sum(positive.values()) + sum(negative.values())
        if count > self._last_count and count - self._last_count == zero - self._last_zero:
            self._max_scale = min(self._max_scale, 0)  # the SDK's scale of an interval of zeros only
        self._last_count, self._last_zero = count, zero
        if scale > self._max_scale:
            change = scale - self._max_scale
            scale, positive, negative = self._max_scale, _downscale(positive, change), _downscale(negative, change)
        return self._point(
            exemplars,
            self._start_time_unix_nano,
            collection_start_nano,
            count,
            total,
            scale,
            zero,
            positive,
            negative,
            cmin,
            cmax,
        )

    def _point(
        self,
        exemplars: list[Exemplar],
        start: int,
        now: int,
        count: int,
        total: float,
        scale: int,
        zero: int,
        positive: dict[int, int],
        negative: dict[int, int],
        vmin: float,
        vmax: float,
    ) -> ExponentialHistogramDataPoint:
        return ExponentialHistogramDataPoint(
            attributes=self._attributes,
            exemplars=exemplars,
            start_time_unix_nano=start,
            time_unix_nano=now,
            count=count,
            sum=total,
            scale=scale,
            zero_count=zero,
            positive=_buckets_point(positive),
            negative=_buckets_point(negative),
            flags=0,
            min=vmin,
            max=vmax,
        )
