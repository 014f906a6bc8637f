"""The SDK's view of the histogram cells: ordinary histogram points, exemplars included, read at
collect time.

* each cell is exposed through an asynchronous "carrier" instrument whose callback yields one
  ``Observation`` per cell, with the cell itself in the observation's context;
* the carrier's View carries :class:`InProcessHistogram`, whose per-attribute-set aggregation
  binds to that cell and, at collect, turns its counts into a ``HistogramDataPoint`` (cumulative
  or delta, per reader) or an exponential one. Every reader on the provider (in-memory,
  Prometheus, OTLP) gets it.

This relies on SDK internals (``Aggregation._create_aggregation``, the histogram aggregation
classes, the exponential mapping), all in :mod:`otel_llm._sdk` with their contract checks; where
they do not hold, the telemetry records through the SDK's instruments instead. The same
Aggregation applied to a *synchronous* histogram behaves exactly like
``ExplicitBucketHistogramAggregation``: that is how the straightforward path shares the Views.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

from opentelemetry.context import get_value
from opentelemetry.sdk.metrics import Exemplar
from opentelemetry.sdk.metrics import Histogram as SdkHistogram
from opentelemetry.sdk.metrics.export import AggregationTemporality, ExponentialHistogramDataPoint, HistogramDataPoint
from opentelemetry.sdk.metrics.view import (
    Aggregation,
    ExplicitBucketHistogramAggregation,
    ExponentialBucketHistogramAggregation,
)
from opentelemetry.util.types import Attributes

from otel_llm._sdk import histogram_aggregations as sdk_aggregation
from otel_llm._sdk.exponential_mapping import MAX_SCALE
from otel_llm.recording.cells import (
    _CELL_KEY,
    ExponentialBuckets,
    ExponentialHistogramCell,
    HistogramCell,
    _buckets_point,
    _downscale,
)


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
        # (the provider instruments yield only cells that have observations).
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
