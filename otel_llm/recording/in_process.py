"""The fast path: plain-Python accumulation on the engine's thread, read by the SDK at collect time.

One hub per MeterProvider owns the instruments, the histogram cells and the lock of every
engine recording into that provider.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation

from otel_llm import __version__
from otel_llm.catalogue.metrics import BY_KEY, METRICS, SCOPE, base_attributes, error_attributes, label_key
from otel_llm.config.labels import LabelLimiter
from otel_llm.config.settings import TelemetryConfig
from otel_llm.core.tracker import DROP_REASONS
from otel_llm.events import StepStats
from otel_llm.recording.cells import ExemplarIds, ExponentialHistogramCell, HistogramCell
from otel_llm.recording.recorder import Recorder

_log = logging.getLogger(__name__)

# Per-request histograms recorded at finish, by metric key (request_num_preemptions apart: an int).
_REQUEST_HISTOGRAMS = (
    "e2e_request_latency_seconds",
    "request_time_per_output_token_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_preempted_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_max_tokens",
)


class _Hub:
    """The instruments of one MeterProvider: created once, read from every engine's recorder.

    The SDK returns an already registered asynchronous instrument without its new callbacks,
    so engines sharing a provider (data-parallel ranks, tests) share one hub whose callbacks
    read them all.
    """

    def __init__(self, meter: Meter, config: TelemetryConfig) -> None:
        self.naming = config.naming
        # Serialises writers (engines). Collection never takes it, so recording into the SDK
        # while holding it cannot deadlock with a reader's collect.
        self.lock = threading.Lock()
        self.recorders: "weakref.WeakSet[FastMetrics]" = weakref.WeakSet()
        self.cells: dict[tuple[str, tuple], HistogramCell] = {}
        # Cells exported from their creation, at zero until observed (show_zero_series).
        self.shown: set[int] = set()
        # Telemetries that keep event batches (TelemetryConfig.defer_steps): applied at collection.
        self.deferring: "weakref.WeakSet[Any]" = weakref.WeakSet()
        for m in METRICS:
            name = m.instrument_name(self.naming)
            if m.kind == "counter":
                meter.create_observable_counter(name, [self._counter_callback(m.key)], m.unit, m.meaning)
            elif m.kind == "gauge":
                meter.create_observable_gauge(name, [self._gauge_callback(m.key)], m.unit, m.meaning)
            else:
                meter.create_observable_counter(name, [self._histogram_callback(m.key)], m.unit, m.meaning)

    def cell(
        self, key: str, bounds: tuple[float, ...], attributes: dict[str, str], exponential: bool = False
    ) -> HistogramCell:
        ident = (key, tuple(sorted(attributes.items())))
        cell = self.cells.get(ident)
        if cell is None:
            cell = self.cells[ident] = (ExponentialHistogramCell if exponential else HistogramCell)(bounds, attributes)
        return cell

    def before_collect(self) -> None:
        """Run by every callback (the SDK runs them before it reads any instrument): pending event
        batches applied. Never raises into the SDK's collection."""
        for telemetry in list(self.deferring):
            try:
                telemetry.apply_pending()
            except Exception:  # noqa: BLE001 - never into the SDK's collection
                _log.warning("otel_llm: applying pending events at collection failed", exc_info=True)

    def _counter_callback(self, key: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        def callback(_: CallbackOptions) -> Iterator[Observation]:
            self.before_collect()
            totals: dict[tuple, tuple[dict[str, str], int]] = {}
            for recorder in list(self.recorders):
                for attrs, value in recorder.counter_values(key):
                    ident = tuple(sorted(attrs.items()))
                    previous = totals.get(ident)
                    totals[ident] = (attrs, value + (previous[1] if previous else 0))
            for attrs, value in totals.values():
                yield Observation(value, attrs)

        return callback

    def _gauge_callback(self, key: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        def callback(_: CallbackOptions) -> Iterator[Observation]:
            self.before_collect()
            for recorder in list(self.recorders):
                value = recorder.gauges.get(key)
                if value is not None:
                    yield Observation(value, recorder.attributes)

        return callback

    def _histogram_callback(self, key: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        def callback(_: CallbackOptions) -> Iterator[Observation]:
            self.before_collect()
            for (cell_key, _attrs), cell in list(self.cells.items()):
                if cell_key == key and (any(cell.counts) or id(cell) in self.shown):
                    yield cell.observation()

        return callback


_hubs: "weakref.WeakKeyDictionary[Any, _Hub]" = weakref.WeakKeyDictionary()
_hubs_lock = threading.Lock()


def _new_locks_after_fork() -> None:
    """In a forked child, a lock that another thread of the parent held stays held forever
    (that thread does not exist in the child)."""
    global _hubs_lock
    _hubs_lock = threading.Lock()
    for hub in list(_hubs.values()):
        hub.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_locks_after_fork)


def _hub_for(meter_provider: MeterProvider, config: TelemetryConfig) -> _Hub:
    with _hubs_lock:
        hub = _hubs.get(meter_provider)
        if hub is None:
            hub = _hubs[meter_provider] = _Hub(meter_provider.get_meter(SCOPE, __version__), config)
        elif hub.naming != config.naming:
            raise ValueError(
                f"naming: {config.naming!r} differs from {hub.naming!r}, already used on this MeterProvider; "
                "one naming profile per provider"
            )
        return hub


class FastMetrics(Recorder):
    """Plain-Python accumulation on the hot path; the SDK reads it at collect time."""

    def __init__(self, meter_provider: MeterProvider, config: TelemetryConfig) -> None:
        self.hub = _hub_for(meter_provider, config)
        self.config = config
        self.attributes = base_attributes(config)
        self._reason_key = label_key(config, "reason")
        self._finish_key = label_key(config, "finished_reason")
        self._limit_reason = LabelLimiter(config.max_label_values)
        self._limit_finish = LabelLimiter(config.max_label_values)
        self.gauges: dict[str, float] = {}
        self.n_preemptions = 0
        self.n_recomputed = 0
        self.n_prompt = 0
        self.n_generation = 0
        self.by_reason: dict[str, int] = {}
        self.by_finish: dict[str, int] = {}
        # Every reason exported from the start at 0: Prometheus' increase() misses a counter
        # series whose first sample is already 1.
        self.drops: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        cell = self._cell
        self.h_ttft = cell("time_to_first_token_seconds")
        self.h_itl = cell("inter_token_latency_seconds")
        self.h_iteration = cell("iteration_tokens_total")
        self.request_cells = {k: cell(k) for k in _REQUEST_HISTOGRAMS}
        errors = error_attributes(config)
        # The same cells for a failed request, except error.type where the conventions ask for it.
        self.error_cells = (
            {k: cell(k, errors) if BY_KEY[k].error_type else c for k, c in self.request_cells.items()}
            if errors
            else self.request_cells
        )
        self.h_preemptions = cell("request_num_preemptions")
        self.hub.recorders.add(self)

    @property
    def lock(self) -> threading.Lock:  # the hub's: engines of one provider share its cells
        return self.hub.lock

    def _cell(self, key: str, attributes: Optional[dict[str, str]] = None) -> HistogramCell:
        m = BY_KEY[key]
        return self.hub.cell(key, m.boundaries(self.config), attributes or self.attributes, m.exponential(self.config))

    def counter_values(self, key: str) -> Iterable[tuple[dict[str, str], int]]:
        if key == "num_preemptions":
            return [(self.attributes, self.n_preemptions)]
        if key == "num_recomputed_tokens":
            return [(self.attributes, self.n_recomputed)]
        if key == "prompt_tokens":
            return [(self.attributes, self.n_prompt)]
        if key == "generation_tokens":
            return [(self.attributes, self.n_generation)]
        labelled = {
            "num_preemptions_by_reason": (self.by_reason, self._reason_key),
            "request_success": (self.by_finish, self._finish_key),
            "dropped_events": (self.drops, "reason"),
        }[key]
        values, label = labelled
        return [({**self.attributes, label: v}, n) for v, n in list(values.items())]

    def preempted(self, reason: str, num_computed_tokens: int) -> None:
        self.n_preemptions += 1
        self.n_recomputed += num_computed_tokens
        reason = self._limit_reason(reason)
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1

    def prompt_tokens(self, n: int) -> None:
        self.n_prompt += n

    def ttft(self, seconds: float, exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.h_ttft.observe(seconds, exemplar)

    def tokens(self, n: int, itl: Optional[float], exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.n_generation += n
        if itl is not None:
            self.h_itl.observe(itl, exemplar)

    def finished(
        self,
        values: dict[str, float],
        finish_reason: str,
        num_preemptions: int,
        exemplar: Optional[ExemplarIds],
        ctx: Any,
    ) -> None:
        reason = self._limit_finish(finish_reason)
        self.by_finish[reason] = self.by_finish.get(reason, 0) + 1
        cells = self.error_cells if finish_reason == "error" else self.request_cells
        for key, value in values.items():
            cells[key].observe(value, exemplar)
        self.h_preemptions.observe(num_preemptions, exemplar)

    def step(self, stats: StepStats) -> None:
        gauges = self.gauges
        gauges["num_requests_running"] = stats.num_running
        gauges["num_requests_waiting"] = stats.num_waiting
        gauges["kv_cache_usage_perc"] = stats.kv_cache_usage
        if stats.num_batched_tokens is not None:
            self.h_iteration.observe(stats.num_batched_tokens)

    def dropped(self, reason: str, n: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + n

    def latencies(
        self, ttfts: Sequence[float], itls: Sequence[float], exemplar: Optional[ExemplarIds], ctx: Any
    ) -> None:
        if exemplar is None:
            self.h_ttft.observe_many(ttfts)
            self.h_itl.observe_many(itls)
            return
        for value in ttfts:
            self.h_ttft.observe(value, exemplar)
        for value in itls:
            self.h_itl.observe(value, exemplar)

    def show_zero_series(self, finish_reasons: Iterable[str], histograms: Iterable[str]) -> None:
        for reason in finish_reasons:
            reason = self._limit_finish(reason)
            self.by_finish.setdefault(reason, 0)
        for key in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            self.gauges.setdefault(key, 0)
        self.hub.shown.update(id(self._cell(key)) for key in histograms)
