"""Histogram cells: a histogram aggregated in-process, one cell per attribute set.

Why: ``Histogram.record()`` costs ~10 µs, mostly attribute copying and hashing, and the
inter-token latency alone is one observation per generated token. Here an observation is a
bisect and a list increment (~0.3 µs) on a :class:`HistogramCell` whose attribute set was
built once. The SDK reads the cells at collect time through
:mod:`otel_llm.recording.cell_aggregation`.

With ``exponential=True`` (OTLP's ``base2_exponential_bucket_histogram``), an
:class:`ExponentialHistogramCell` also keeps base-2 exponential buckets, bucket for bucket what
the SDK's own exponential aggregation gives for the same observations and collections (scale,
offsets, counts; tests/core/test_exponential.py); a cell keeps both, so a Prometheus reader on
the same provider can still read its explicit buckets.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left, bisect_right
from time import time_ns
from typing import Optional, Sequence

from opentelemetry.context import Context, create_key, set_value
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics.export import Buckets as BucketsPoint
from opentelemetry.util.types import Attributes

from otel_llm._sdk.exponential_mapping import MAX_SCALE, index_at_max_scale

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
        total = sum(values)
        low, high = min(values), max(values)
        first, last = bisect_left(bounds, low), bisect_left(bounds, high)
        if first == last and total == total:
            counts[first] += len(values)  # the common case: a few steps' latencies share a bucket
        elif total == total:
            # Each bucket's count from the values in order (sorted in C): a search per bucket
            # spanned, not per value.
            ordered = sorted(values)
            below = 0
            for i in range(first, last):
                upto = bisect_right(ordered, bounds[i])
                counts[i] += upto - below
                below = upto
            counts[last] += len(values) - below
        else:  # a NaN (the sum says so) has no place in the order: where a search puts it
            for value in values:
                counts[bisect_left(bounds, value)] += 1
        self.total += total
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
