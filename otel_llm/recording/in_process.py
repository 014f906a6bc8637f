"""The fast path: plain-Python accumulation on the engine's thread, read by the SDK at collect time.

One set of instruments per MeterProvider (:class:`ProviderInstruments`) owns the observable
instruments, the histogram cells and the lock of every engine recording into that provider.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation

from otel_llm.catalogue.drops import DROP_REASONS
from otel_llm.catalogue.metrics import (
    BY_KEY,
    FINISH_OBSERVATIONS,
    METRICS,
    PER_TENANT,
    SCOPE,
    STEP_GAUGES,
    STEP_HISTOGRAMS,
    TENANT_ONLY,
    base_attributes,
    error_attributes,
    label_key,
    preemptions_by_cause,
)
from otel_llm.config.labels import LabelLimiter
from otel_llm.config.settings import TelemetryConfig
from otel_llm.events import StepStats
from otel_llm.recording.cells import ExemplarIds, ExponentialHistogramCell, HistogramCell
from otel_llm.recording.recorder import GaugeSource, PendingWork
from otel_llm.summary import RequestSummary
from otel_llm.version import __version__

_log = logging.getLogger(__name__)


class ProviderInstruments:
    """The instruments of one MeterProvider: created once, read from every engine's recorder.

    The SDK returns an already registered asynchronous instrument without its new callbacks,
    so engines sharing a provider (data-parallel ranks, tests) share one ProviderInstruments whose callbacks
    read them all.
    """

    def __init__(self, meter: Meter, config: TelemetryConfig) -> None:
        self.naming = config.naming
        # Serialises writers (engines), and the pending work a collection applies first.
        # Reentrant: an adapter's kept engine steps record through the telemetry's own
        # methods, which take it, while the pending work is applied under it.
        self.lock = threading.RLock()
        # Held for the provider's life, as the SDK holds its own aggregations: a counter of a
        # telemetry that was shut down and let go keeps its total in the exports that follow
        # (the provider's final one included), never falling back.
        self.recorders: "set[InProcessRecorder]" = set()
        self.cells: dict[tuple[str, tuple], HistogramCell] = {}
        # Cells exported from their creation, at zero until observed (show_zero_series).
        self.shown: set[int] = set()
        # Telemetries that keep work to apply in batches (TelemetryConfig.defer_steps).
        self.pending: "weakref.WeakSet[PendingWork]" = weakref.WeakSet()
        # Metrics (by key) exported from another source at collection, not from the recorders.
        self.elsewhere: dict[str, Callable[[], Iterable[Observation]]] = {}
        self._collecting: Optional[CallbackOptions] = None  # the collection whose callbacks run
        own = {"counter": self._counter_values, "gauge": self._gauge_values, "histogram": self._histogram_values}
        for m in METRICS:
            create = meter.create_observable_gauge if m.kind == "gauge" else meter.create_observable_counter
            create(m.instrument_name(self.naming), [self._callback(m.key, own[m.kind])], m.unit, m.meaning)

    def cell(
        self, key: str, bounds: tuple[float, ...], attributes: dict[str, str], exponential: bool = False
    ) -> HistogramCell:
        ident = (key, tuple(sorted(attributes.items())))
        cell = self.cells.get(ident)
        if cell is None:
            cell = self.cells[ident] = (ExponentialHistogramCell if exponential else HistogramCell)(bounds, attributes)
        return cell

    def drain(self, options: CallbackOptions) -> None:
        """Run by every callback that reads what is recorded into this provider (the SDK runs
        a collection's callbacks before it reads any instrument): the pending work applied,
        once per collection. The SDK gives a collection's callbacks one CallbackOptions, unless
        its deadline is near (a flush's): then each its own, and each drains. Never raises into
        the SDK's collection."""
        if options is self._collecting:
            return
        self._collecting = options
        for work in list(self.pending):
            try:
                work.apply_pending()
            except Exception:  # noqa: BLE001 - never into the SDK's collection
                _log.warning("otel_llm: applying pending events at collection failed", exc_info=True)

    def _callback(
        self, key: str, own: Callable[[str], Iterator[Observation]]
    ) -> Callable[[CallbackOptions], Iterator[Observation]]:
        """The instrument's callback: ``key``'s observations from its source elsewhere if it has
        one, else ``own``'s (what the recorders hold)."""

        def callback(options: CallbackOptions) -> Iterator[Observation]:
            self.drain(options)
            source = self.elsewhere.get(key)
            yield from source() if source is not None else own(key)

        return callback

    def _counter_values(self, key: str) -> Iterator[Observation]:
        totals: dict[tuple, tuple[dict[str, str], int]] = {}
        for recorder in list(self.recorders):
            for attrs, value in recorder.counter_values(key):
                ident = tuple(sorted(attrs.items()))
                previous = totals.get(ident)
                totals[ident] = (attrs, value + (previous[1] if previous else 0))
        for attrs, value in totals.values():
            yield Observation(value, attrs)

    def _gauge_values(self, key: str) -> Iterator[Observation]:
        for recorder in list(self.recorders):
            value = recorder.gauge_value(key)
            if value is not None:
                yield Observation(value, recorder.attributes)

    def _histogram_values(self, key: str) -> Iterator[Observation]:
        for (cell_key, _attrs), cell in list(self.cells.items()):
            if cell_key == key and (any(cell.counts) or id(cell) in self.shown):
                yield cell.observation()


_by_provider: "weakref.WeakKeyDictionary[Any, ProviderInstruments]" = weakref.WeakKeyDictionary()
_instruments_lock = threading.Lock()


def _new_locks_after_fork() -> None:
    """In a forked child, a lock that another thread of the parent held stays held forever
    (that thread does not exist in the child)."""
    global _instruments_lock
    _instruments_lock = threading.Lock()
    for instruments in list(_by_provider.values()):
        instruments.lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_locks_after_fork)


def drain(meter_provider: MeterProvider, options: CallbackOptions) -> None:
    """For instruments of others on ``meter_provider`` that read what the telemetry records:
    its pending work applied first, as for the telemetry's own (:meth:`ProviderInstruments.drain`)."""
    instruments = _by_provider.get(meter_provider)
    if instruments is not None:
        instruments.drain(options)


def _instruments_for(meter_provider: MeterProvider, config: TelemetryConfig) -> ProviderInstruments:
    with _instruments_lock:
        instruments = _by_provider.get(meter_provider)
        if instruments is None:
            instruments = _by_provider[meter_provider] = ProviderInstruments(
                meter_provider.get_meter(SCOPE, __version__), config
            )
        elif instruments.naming != config.naming:
            raise ValueError(
                f"naming: {config.naming!r} differs from {instruments.naming!r}, already used on this MeterProvider; "
                "one naming profile per provider"
            )
        return instruments


# Counted per request (RequestSeries), under a tenant label when a tenant source is set.
_REQUEST_COUNTERS = ("prompt_tokens", "generation_tokens", "aborted_generation_tokens")


class _RequestObservations:
    """A request's observations (:class:`~otel_llm.recording.recorder.RequestSeries`), into the
    counts and cells of ``self``: the recorder's own, or one tenant's (:class:`InProcessTenantSeries`)."""

    counts: dict[str, int]
    by_finish: dict[str, int]
    by_cause: dict[str, int]
    h_ttft: HistogramCell
    h_itl: HistogramCell
    finish_cells: list[tuple[HistogramCell, str, Optional[str]]]
    error_finish_cells: list[tuple[HistogramCell, str, Optional[str]]]
    _limit_finish: LabelLimiter
    _limit_cause: LabelLimiter

    def prompt_tokens(self, n: int) -> None:
        self.counts["prompt_tokens"] += n

    def ttft(self, seconds: float, exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.h_ttft.observe(seconds, exemplar)

    def tokens(self, n: int, itl: Optional[float], exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.counts["generation_tokens"] += n
        if itl is not None:
            self.h_itl.observe(itl, exemplar)

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

    def finished(self, summary: RequestSummary, exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        finish_reason = summary.finish_reason
        reason = self._limit_finish(finish_reason)
        self.by_finish[reason] = self.by_finish.get(reason, 0) + 1
        if finish_reason == "abort":
            self.counts["aborted_generation_tokens"] += summary.generation_tokens
        if summary.num_preemptions:
            by_cause = self.by_cause
            for kind, n in preemptions_by_cause(summary):
                kind = self._limit_cause(kind)
                by_cause[kind] = by_cause.get(kind, 0) + n
        for cell, field, observed_if in self.error_finish_cells if finish_reason == "error" else self.finish_cells:
            if observed_if is not None and not getattr(summary, observed_if):
                continue
            value = getattr(summary, field)
            if value is not None:
                cell.observe(value, exemplar)


class InProcessTenantSeries(_RequestObservations):
    """One tenant's request-scoped series: the recorder's cells and counts for the metrics
    that are per tenant (``MetricDef.per_tenant``) under ``attributes`` (the recorder's and the
    tenant label), its own for the others (shared with every tenant)."""

    def __init__(self, recorder: "InProcessRecorder", tenant: str) -> None:
        self.tenant = tenant
        self.attributes = attributes = {**recorder.attributes, recorder.tenant_key: tenant}
        self.counts = dict.fromkeys(_REQUEST_COUNTERS, 0)
        self.by_finish = {}
        self.by_cause = recorder.by_cause
        self.by_cause_tenant: dict[str, int] = {}  # num_preemptions_by_tenant, by cause_tenant
        self._limit_finish = recorder._limit_finish
        self._limit_cause = recorder._limit_cause
        self._finish_key = recorder._label_keys["request_success"]
        self._cause_tenant_key = recorder._label_keys["num_preemptions_by_tenant"]
        cell = recorder._cell
        self.h_ttft = cell("time_to_first_token_seconds", attributes)
        self.h_itl = cell("inter_token_latency_seconds", attributes)
        self.finish_cells = [
            (cell(key, attributes) if key in PER_TENANT else c, field, observed_if)
            for (c, field, observed_if), (key, _, _) in zip(recorder.finish_cells, FINISH_OBSERVATIONS)
        ]
        errors = error_attributes(recorder.config)
        self.error_finish_cells = (
            [
                (cell(key, {**errors, recorder.tenant_key: tenant}) if BY_KEY[key].error_type else c, field, oi)
                for (c, field, oi), (key, _, _) in zip(self.finish_cells, FINISH_OBSERVATIONS)
            ]
            if errors
            else self.finish_cells
        )

    def preempted_by_tenant(self, cause_tenant: str) -> None:
        self.by_cause_tenant[cause_tenant] = self.by_cause_tenant.get(cause_tenant, 0) + 1

    def aborted_tokens(self, n: int) -> None:
        self.counts["aborted_generation_tokens"] += n

    def counter_values(self, key: str) -> list[tuple[dict[str, str], int]]:
        if key in self.counts:
            return [(self.attributes, self.counts[key])]
        if key == "request_success":
            return [({**self.attributes, self._finish_key: v}, n) for v, n in list(self.by_finish.items())]
        if key == "num_preemptions_by_tenant":
            return [({**self.attributes, self._cause_tenant_key: v}, n) for v, n in list(self.by_cause_tenant.items())]
        return []


class InProcessRecorder(_RequestObservations):
    """Plain-Python accumulation on the hot path; the SDK reads it at collect time."""

    takes_gauge_source = True

    def __init__(self, meter_provider: MeterProvider, config: TelemetryConfig) -> None:
        self.instruments = _instruments_for(meter_provider, config)
        self.config = config
        self.attributes = base_attributes(config)
        self._limit_reason = LabelLimiter(config.max_label_values)
        self._limit_finish = LabelLimiter(config.max_label_values)
        self._limit_cause = LabelLimiter(config.max_label_values)
        self.gauges: dict[str, float] = {}
        self._gauge_source: Optional[GaugeSource] = None
        # Counters by metric key: unlabelled ones are an int, labelled ones an int per label value.
        self.counts: dict[str, int] = {m.key: 0 for m in METRICS if m.kind == "counter" and m.label is None}
        self.labelled: dict[str, dict[str, int]] = {m.key: {} for m in METRICS if m.kind == "counter" and m.label}
        self._label_keys = {key: label_key(config, BY_KEY[key].label or "") for key in self.labelled}
        self.tenant_key = label_key(config, "tenant")
        # With a tenant source: each tenant's series (bounded by the tenant resolver's cap).
        self.tenants: dict[str, InProcessTenantSeries] = {}
        self._per_tenant = config.tenant is not None
        self.by_reason = self.labelled["num_preemptions_by_reason"]
        self.by_finish = self.labelled["request_success"]
        self.by_cause = self.labelled["num_preemptions_by_cause"]
        # Every reason exported from the start at 0: Prometheus' increase() misses a counter
        # series whose first sample is already 1.
        self.drops = self.labelled["dropped_events"]
        self.drops.update(dict.fromkeys(DROP_REASONS, 0))
        cell = self._cell
        self.h_ttft = cell("time_to_first_token_seconds")
        self.h_itl = cell("inter_token_latency_seconds")
        self.step_cells = [(cell(key), field) for key, field in STEP_HISTOGRAMS]
        # (cell, RequestSummary field, field that must be non-zero) per finish observation.
        self.finish_cells = [(cell(key), field, observed_if) for key, field, observed_if in FINISH_OBSERVATIONS]
        errors = error_attributes(config)
        # The same cells for a failed request, except error.type where the conventions ask for it.
        self.error_finish_cells = (
            [
                (cell(key, errors) if BY_KEY[key].error_type else c, field, observed_if)
                for (c, field, observed_if), (key, _, _) in zip(self.finish_cells, FINISH_OBSERVATIONS)
            ]
            if errors
            else self.finish_cells
        )
        self.instruments.recorders.add(self)

    @property
    def lock(self) -> "threading.RLock":  # the provider's: engines of one provider share its cells
        return self.instruments.lock

    def _cell(self, key: str, attributes: Optional[dict[str, str]] = None) -> HistogramCell:
        m = BY_KEY[key]
        return self.instruments.cell(
            key, m.boundaries(self.config), attributes or self.attributes, m.exponential(self.config)
        )

    def counter_values(self, key: str) -> Iterable[tuple[dict[str, str], int]]:
        count = self.counts.get(key)
        if count is not None:
            own = [(self.attributes, count)]
        else:
            label = self._label_keys[key]
            own = [({**self.attributes, label: v}, n) for v, n in list(self.labelled[key].items())]
        if not self._per_tenant:
            return [] if key in TENANT_ONLY else own
        if key not in PER_TENANT:
            return own
        # With a tenant source, a request's counts are its tenant's: the recorder's own series
        # appear only for what no request carried (an engine's per-step totals), and at zero
        # until a tenant has any (an engine that served none shows vLLM's zeros).
        tenants = list(self.tenants.values())
        values = [(attrs, n) for attrs, n in own if n or not tenants]
        for series in tenants:
            values.extend(series.counter_values(key))
        return values

    def for_tenant(self, tenant: str) -> InProcessTenantSeries:
        series = self.tenants.get(tenant)
        if series is None:
            series = self.tenants[tenant] = InProcessTenantSeries(self, tenant)
        return series

    def gauge_value(self, key: str) -> Optional[float]:
        source = self._gauge_source
        return self.gauges.get(key) if source is None else source(key)

    def set_gauge_source(self, source: GaugeSource) -> None:
        self._gauge_source = source

    def read_elsewhere(self, sources: Mapping[str, Callable[[], Iterable[Observation]]]) -> None:
        """Export the metrics ``sources`` names (by key) from their source at collection, for
        every recorder of this MeterProvider, which are no longer read for them; the metrics
        named before and not now are read from the recorders again."""
        self.instruments.elsewhere = dict(sources)

    def preempted(self, reason: str, num_computed_tokens: int) -> None:
        counts = self.counts
        counts["num_preemptions"] += 1
        counts["num_recomputed_tokens"] += num_computed_tokens
        reason = self._limit_reason(reason)
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1

    def step(self, stats: StepStats) -> None:
        gauges = self.gauges
        for key, field in STEP_GAUGES:
            gauges[key] = getattr(stats, field)
        for cell, field in self.step_cells:
            value = getattr(stats, field)
            if value is not None:
                cell.observe(value)

    def dropped(self, reason: str, n: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + n

    def show_zero_series(self, finish_reasons: Iterable[str], histograms: Iterable[str]) -> None:
        for reason in finish_reasons:
            reason = self._limit_finish(reason)
            self.by_finish.setdefault(reason, 0)
        for key, _ in STEP_GAUGES:
            self.gauges.setdefault(key, 0)
        self.instruments.shown.update(id(self._cell(key)) for key in histograms)
