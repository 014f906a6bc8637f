"""The straightforward path: one SDK call per observation (see otel_llm.recording.recorder)."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Iterable, Optional, Sequence

from opentelemetry.metrics import MeterProvider

from otel_llm.catalogue.drops import DROP_REASONS
from otel_llm.catalogue.metrics import (
    BY_KEY,
    METRICS,
    PER_TENANT,
    SCOPE,
    STEP_GAUGES,
    STEP_HISTOGRAMS,
    base_attributes,
    error_attributes,
    finish_values,
    label_key,
    preemptions_by_cause,
)
from otel_llm.config.labels import LabelLimiter
from otel_llm.config.settings import TelemetryConfig
from otel_llm.events import StepStats
from otel_llm.recording.cells import ExemplarIds
from otel_llm.recording.recorder import GaugeSource
from otel_llm.summary import RequestSummary
from otel_llm.version import __version__

_instances: "weakref.WeakSet[SdkRecorder]" = weakref.WeakSet()


def _new_locks_after_fork() -> None:
    for recorder in list(_instances):  # a child must not inherit a lock held by a parent's thread
        recorder._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_locks_after_fork)


def _each_latency(
    series: "SdkRecorder | SdkTenantSeries",
    ttfts: Sequence[float],
    itls: Sequence[float],
    exemplar: Optional[ExemplarIds],
    ctx: Any,
) -> None:
    """``latencies`` as one ``ttft`` / ``tokens`` record each: the SDK's instruments take one value
    at a time."""
    for value in ttfts:
        series.ttft(value, exemplar, ctx)
    for value in itls:
        series.tokens(0, value, exemplar, ctx)


class SdkRecorder:
    """One SDK ``record``/``add``/``set`` per observation, attributes passed on every call."""

    takes_gauge_source = False  # its gauges are synchronous: set at each step

    def __init__(self, meter_provider: MeterProvider, config: TelemetryConfig) -> None:
        meter = meter_provider.get_meter(SCOPE, __version__)
        self._lock = threading.RLock()
        _instances.add(self)
        self.config = config
        self.attributes = base_attributes(config)
        self._error_attributes = error_attributes(config)
        self._reason_key = label_key(config, "reason")
        self._cause_key = label_key(config, "cause")
        self._finish_key = label_key(config, "finished_reason")
        self._drop_key = label_key(config, "drop_reason")
        self._tenant_key = label_key(config, "tenant")
        self._cause_tenant_key = label_key(config, "cause_tenant")
        self._limit_reason = LabelLimiter(config.max_label_values)
        self._limit_finish = LabelLimiter(config.max_label_values)
        self._limit_cause = LabelLimiter(config.max_label_values)
        self.i: dict[str, Any] = {}
        for m in METRICS:
            name = m.instrument_name(config.naming)
            if m.kind == "counter":
                self.i[m.key] = meter.create_counter(name, m.unit, m.meaning)
            elif m.kind == "gauge":
                self.i[m.key] = meter.create_gauge(name, m.unit, m.meaning)
            else:
                self.i[m.key] = meter.create_histogram(name, m.unit, m.meaning)
        for reason in DROP_REASONS:
            self.i["dropped_events"].add(0, {**self.attributes, self._drop_key: reason})

    @property
    def lock(self) -> "threading.RLock":
        return self._lock

    def preempted(self, reason: str, num_computed_tokens: int) -> None:
        i, attrs = self.i, self.attributes
        i["num_preemptions"].add(1, attrs)
        i["num_preemptions_by_reason"].add(1, {**attrs, self._reason_key: self._limit_reason(reason)})
        i["num_recomputed_tokens"].add(num_computed_tokens, attrs)

    def prompt_tokens(self, n: int) -> None:
        self.i["prompt_tokens"].add(n, self.attributes)

    def ttft(self, seconds: float, exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.i["time_to_first_token_seconds"].record(seconds, self.attributes, context=ctx)

    def tokens(self, n: int, itl: Optional[float], exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.i["generation_tokens"].add(n, self.attributes)
        if itl is not None:
            self.i["inter_token_latency_seconds"].record(itl, self.attributes, context=ctx)

    def latencies(
        self, ttfts: Sequence[float], itls: Sequence[float], exemplar: Optional[ExemplarIds], ctx: Any
    ) -> None:
        _each_latency(self, ttfts, itls, exemplar, ctx)

    def finished(self, summary: RequestSummary, exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.finished_as(summary, ctx, self.attributes, self._error_attributes)

    def finished_as(
        self, summary: RequestSummary, ctx: Any, own: dict[str, str], own_errors: Optional[dict[str, str]]
    ) -> None:
        """A finished request's observations, the per-tenant metrics' under ``own`` (and
        ``own_errors`` for a failed request's): the recorder's attributes or a tenant's."""
        i, attrs = self.i, self.attributes
        i["request_success"].add(1, {**own, self._finish_key: self._limit_finish(summary.finish_reason)})
        if summary.finish_reason == "abort" and self.config.tenant is not None:
            i["aborted_generation_tokens"].add(summary.generation_tokens, own)
        errors = own_errors if summary.finish_reason == "error" else None
        for key, value in finish_values(summary):
            mine = key in PER_TENANT
            i[key].record(
                value,
                errors if errors and BY_KEY[key].error_type else own if mine else attrs,
                context=ctx,
            )
        for kind, n in preemptions_by_cause(summary):
            i["num_preemptions_by_cause"].add(n, {**attrs, self._cause_key: self._limit_cause(kind)})

    def for_tenant(self, tenant: str) -> "SdkTenantSeries":
        return SdkTenantSeries(self, tenant)

    def step(self, stats: StepStats) -> None:
        i, attrs = self.i, self.attributes
        for key, field in STEP_GAUGES:
            i[key].set(getattr(stats, field), attrs)
        for key, field in STEP_HISTOGRAMS:
            value = getattr(stats, field)
            if value is not None:
                i[key].record(value, attrs)

    def dropped(self, reason: str, n: int = 1) -> None:
        self.i["dropped_events"].add(n, {**self.attributes, self._drop_key: reason})

    def show_zero_series(self, finish_reasons: Iterable[str], histograms: Iterable[str]) -> None:
        # An SDK histogram has no point before its first record: only the counter's series.
        for reason in finish_reasons:
            self.i["request_success"].add(0, {**self.attributes, self._finish_key: self._limit_finish(reason)})

    def set_gauge_source(self, source: GaugeSource) -> None:
        raise NotImplementedError("the SDK recorder's gauges are set at each step (takes_gauge_source is False)")


class SdkTenantSeries:
    """One tenant's request-scoped observations on the SDK path: the per-tenant metrics
    (``MetricDef.per_tenant``) with the tenant label, the others as the recorder's."""

    def __init__(self, recorder: SdkRecorder, tenant: str) -> None:
        self.recorder = recorder
        self.attributes = {**recorder.attributes, recorder._tenant_key: tenant}
        errors = recorder._error_attributes
        self._error_attributes = {**errors, recorder._tenant_key: tenant} if errors else None

    def prompt_tokens(self, n: int) -> None:
        self.recorder.i["prompt_tokens"].add(n, self.attributes)

    def ttft(self, seconds: float, exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.recorder.i["time_to_first_token_seconds"].record(seconds, self.attributes, context=ctx)

    def tokens(self, n: int, itl: Optional[float], exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        i = self.recorder.i
        i["generation_tokens"].add(n, self.attributes)
        if itl is not None:
            i["inter_token_latency_seconds"].record(itl, self.attributes, context=ctx)

    def latencies(
        self, ttfts: Sequence[float], itls: Sequence[float], exemplar: Optional[ExemplarIds], ctx: Any
    ) -> None:
        _each_latency(self, ttfts, itls, exemplar, ctx)

    def finished(self, summary: RequestSummary, exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.recorder.finished_as(summary, ctx, self.attributes, self._error_attributes)

    def preempted_by_tenant(self, cause_tenant: str) -> None:
        self.recorder.i["num_preemptions_by_tenant"].add(
            1, {**self.attributes, self.recorder._cause_tenant_key: cause_tenant}
        )

    def aborted_tokens(self, n: int) -> None:
        self.recorder.i["aborted_generation_tokens"].add(n, self.attributes)
