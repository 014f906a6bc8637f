"""EngineTelemetry: the hook-bus subscriber that ties the tracker, the metrics and the spans.

Guarantees: nothing raises into the engine (bad events are dropped and counted by reason,
internal failures too); state is bounded (the tracker's caps, at most ``defer_steps`` kept
batches); batches are applied in order under one lock, so several publishing threads keep
exact totals.

Event batches are kept and applied together every ``defer_steps`` engine steps (16 through
setup_telemetry; a hand-built EngineTelemetry applies each at once unless set): between two
steps the model's work evicts the CPU caches, and the telemetry's code and data then cost
several times more than when warm (engine_stub: ~3 us per TOKENS event cold, 0.5 us warm). A
reader's collection (the metric hub's callbacks), an idle engine step, flush() and shutdown()
apply what is pending first, so no reader ever sees a partial picture.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Iterable, Optional, Sequence

from opentelemetry import metrics as metrics_api
from opentelemetry.context import Context

from . import tracker as t
from .config import TelemetryConfig
from .events import RequestEvent, StepStats
from .metrics import FastMetrics, Recorder, SdkMetrics, provider_has_views
from .spans import LogEvents, request_spans
from .tracker import RequestState, RequestSummary, Tracker

_log = logging.getLogger(__name__)
_EMPTY_CONTEXT = Context()  # records with no request span must not pick up an unrelated current span
_warned_providers: set[int] = set()
_instances: "weakref.WeakSet[EngineTelemetry]" = weakref.WeakSet()


def _new_locks_after_fork() -> None:
    """In a forked child, a lock that another thread of the parent held stays held forever
    (that thread does not exist in the child): give every telemetry a fresh lock, one per lock
    shared before (the engines of one MeterProvider share their recorder hub's lock)."""
    fresh: dict[int, threading.Lock] = {}
    for telemetry in list(_instances):
        old = telemetry._lock
        new = fresh.setdefault(id(old), threading.Lock())
        telemetry._lock = new
        for owner in (telemetry.metrics, getattr(telemetry.metrics, "hub", None)):
            if getattr(owner, "lock", None) is old:
                owner.lock = new  # type: ignore[union-attr]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_locks_after_fork)


class DropLog:
    """Logs dropped events at most once per reason per interval, with the count in between."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def note(self, reason: str, event: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval_s:
            self._since[reason] = self._since.get(reason, 0) + 1
            return
        more = self._since.pop(reason, 0)
        self._last[reason] = now
        _log.warning("otel_llm dropped an event (%s): %s%s", reason, _describe(event),
                     f" (+{more} more since the last report)" if more else "", exc_info=exc_info)


def _describe(event: Any) -> str:
    # Never the payload texts: ids and numbers only.
    kind = getattr(event, "type", None)
    return f"type={getattr(kind, 'name', kind)!r} request_id={str(getattr(event, 'request_id', '?'))[:64]!r}"


class EngineTelemetry:
    """Subscribe to an engine's hook bus: ``engine.hooks.subscribe(EngineTelemetry(config))``.

    ``fast_path``: None (default) uses the in-process aggregation when the MeterProvider was
    built with :func:`otel_llm.views`, else the straightforward SDK path with one warning, and
    assembled spans (spans.AssembledSpans) when the TracerProvider is the SDK's; True/False
    forces the metric path, False also the Tracer API spans (tests and benchmarks compare both).
    ``logger_provider``: where preemptions go as log-based events when
    ``config.preemption_events`` is "log" or "both" (None: the global LoggerProvider).
    """

    def __init__(self, config: Optional[TelemetryConfig] = None, *, meter_provider: Any = None,
                 tracer_provider: Any = None, logger_provider: Any = None,
                 fast_path: Optional[bool] = None) -> None:
        self.config = config = config or TelemetryConfig()
        meter_provider = meter_provider or metrics_api.get_meter_provider()
        assembled_spans = fast_path is not False
        if fast_path is None:
            fast_path = provider_has_views(meter_provider, config)
            if not fast_path and id(meter_provider) not in _warned_providers:
                _warned_providers.add(id(meter_provider))
                _log.warning("otel_llm: this MeterProvider was built without otel_llm.views(config): metric names "
                             "and buckets are the SDK's defaults and every observation goes through the SDK. "
                             "Build it with MeterProvider(views=otel_llm.views(config), ...).")
        self.metrics: Recorder = (FastMetrics if fast_path else SdkMetrics)(meter_provider, config)
        self.tokens = self.metrics.tokens  # TrackerSink.tokens: the recorder's own (one call per TOKENS event)
        self._lock: threading.Lock = self.metrics.lock  # type: ignore[attr-defined]
        exemplar_filter = (config.exemplar_filter or os.environ.get("OTEL_METRICS_EXEMPLAR_FILTER", "")
                           or "trace_based").lower()
        # Exemplar of an observation with no request span: always_on keeps one without trace ids.
        self._spanless_exemplar = (None, None) if exemplar_filter == "always_on" else None
        self.spans = (request_spans(config, tracer_provider, exemplar_filter, assembled_spans)
                      if config.spans else None)
        self._span_events = config.preemption_events != "log"
        self.log_events = LogEvents(logger_provider, self.spans) if config.log_events else None
        self.tracker = Tracker(self, config.max_inflight_requests)
        self._pending: deque[tuple[RequestEvent, ...]] = deque()
        # Deferred only where every collection applies the pending batches first (the hub's
        # callbacks); the SDK path records as it goes.
        hub = getattr(self.metrics, "hub", None)
        self._defer_steps = (config.defer_steps or 1) if hub is not None else 1
        if self._defer_steps > 1:
            hub.deferring.add(self)  # type: ignore[union-attr]
        self._drops = DropLog()
        self._closed = False
        _instances.add(self)

    # -- the hook bus interface ----------------------------------------------------------

    def on_events(self, events: Sequence[RequestEvent]) -> None:
        try:
            pending = self._pending
            pending.append(tuple(events))  # a copy: the engine may reuse its list
            if len(pending) >= self._defer_steps:
                self.apply_pending()
        except Exception:  # noqa: BLE001 - e.g. events not iterable
            self._internal_error(events)

    def apply_pending(self) -> None:
        """Apply the event batches kept so far (``TelemetryConfig.defer_steps``), in order."""
        handle = self.tracker.handle
        pending = self._pending
        with self._lock:
            while pending:
                for event in pending.popleft():
                    try:
                        handle(event)
                    except (TypeError, AttributeError, ValueError):
                        self.dropped(t.INVALID_VALUE, event)
                    except Exception:  # noqa: BLE001 - never into the engine
                        self._internal_error(event)

    def flush(self) -> None:
        """Apply pending events now (readers and shutdown do it themselves)."""
        try:
            self.apply_pending()
        except Exception:  # noqa: BLE001
            self._internal_error(None)

    def on_step(self, stats: StepStats) -> None:
        try:
            with self._lock:
                valid = _valid_step(stats)
                if valid:
                    self.metrics.step(stats)
                else:
                    self.dropped(t.INVALID_VALUE, stats)
            if valid and self._pending and stats.num_running == 0 and stats.num_waiting == 0:
                self.apply_pending()  # the engine went idle: nothing left to slow down
        except Exception:  # noqa: BLE001
            self._internal_error(stats)

    # -- for adapters whose engine hands over derived stats (vLLM) -----------------------

    def record_finished(self, summary: RequestSummary, trace_context: Optional[Any] = None,
                        metrics: bool = True) -> None:
        """Per-request histograms, ``request_success`` and one span, from a finished request;
        ``trace_context``: the caller's W3C carrier (``traceparent``), parent of the span;
        ``metrics=False``: the span only (a request the engine's own metrics do not count)."""
        try:
            with self._lock:
                req = RequestState(summary.request_id, summary.arrival_time, summary.prompt_tokens,
                                   summary.max_tokens, summary.cached_tokens)
                self._start_span(req, trace_context, {})
                for ordinal, (ts, tokens, reason) in enumerate(summary.preemptions, 1):
                    self._preemption_event(req, ordinal, ts, tokens, reason)
                self._finish(req, summary, None, metrics)
        except Exception:  # noqa: BLE001
            self._internal_error(summary)

    def record_iteration(self, *, ttfts: Iterable[float] = (), itls: Iterable[float] = (), prompt_tokens: int = 0,
                         generation_tokens: int = 0, num_preemptions: int = 0,
                         preemption_reason: str = "kv_cache_full") -> None:
        """Per-iteration observations that are not tied to a request span."""
        try:
            with self._lock:
                m = self.metrics
                exemplar = self._spanless_exemplar
                m.latencies(tuple(ttfts), tuple(itls), exemplar, _EMPTY_CONTEXT)
                m.prompt_tokens(prompt_tokens)
                m.tokens(generation_tokens, None, exemplar, _EMPTY_CONTEXT)
                for _ in range(num_preemptions):
                    m.preempted(preemption_reason, 0)
        except Exception:  # noqa: BLE001
            self._internal_error(None)

    def shutdown(self) -> None:
        """Apply pending events, end the spans of requests still in flight (marked incomplete).
        Idempotent."""
        self.flush()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for req in self.tracker.drain():
                if req.span is not None:
                    self.spans.abandon(req.span, None, "shutdown")  # type: ignore[union-attr]

    # -- TrackerSink ---------------------------------------------------------------------

    def request_arrived(self, req: RequestState, event: RequestEvent) -> None:
        attributes = {}
        if self.spans is not None:
            prompt = self.spans.content(event.prompt_text)
            if prompt is not None:
                attributes["gen_ai.prompt"] = prompt
        self._start_span(req, event.trace_context, attributes)

    def request_scheduled(self, req: RequestState, ts: float, resumed: bool) -> None:
        if resumed and req.span is not None:
            self.spans.event(req.span, "resumed", ts, {"ordinal": req.num_preemptions})  # type: ignore[union-attr]

    def request_preempted(self, req: RequestState, event: RequestEvent) -> None:
        self.metrics.preempted(event.reason, event.num_computed_tokens)
        self._preemption_event(req, req.num_preemptions, event.timestamp, event.num_computed_tokens, event.reason)

    def first_token(self, req: RequestState, ts: float) -> None:
        self.metrics.ttft(ts - req.arrival, req.exemplar, req.ctx)
        self.metrics.prompt_tokens(req.prompt_tokens)
        if req.span is not None:
            self.spans.event(req.span, "first_token", ts, {})  # type: ignore[union-attr]

    def request_finished(self, req: RequestState, summary: RequestSummary, event: RequestEvent) -> None:
        extra = None
        if self.spans is not None:
            output = self.spans.content(event.output_text)
            if output is not None:
                extra = {"gen_ai.completion": output}
        self._finish(req, summary, extra)

    def request_evicted(self, req: RequestState) -> None:
        self.dropped(t.EVICTED, req)
        if req.span is not None:
            self.spans.abandon(req.span, req.last_ts, "evicted")  # type: ignore[union-attr]

    def dropped(self, reason: str, event: Any) -> None:
        self.metrics.dropped(reason)
        self._drops.note(reason, event)

    # -- internals -----------------------------------------------------------------------

    def _preemption_event(self, req: RequestState, ordinal: int, ts: float, num_computed_tokens: int,
                          reason: str) -> None:
        """The one place a preemption becomes an event: span event and/or log record, per config."""
        if req.span is not None and self._span_events:
            self.spans.event(req.span, "preempted", ts, {  # type: ignore[union-attr]
                "ordinal": ordinal, "num_computed_tokens": num_computed_tokens, "reason": reason})
        if self.log_events is not None:
            self.log_events.preempted(req.request_id, req.span, ordinal, ts, num_computed_tokens, reason)

    def _start_span(self, req: RequestState, carrier: Any, attributes: dict[str, Any]) -> None:
        if self.spans is None:
            req.exemplar, req.ctx = self._spanless_exemplar, _EMPTY_CONTEXT
            return
        if req.max_tokens > 0:
            attributes["gen_ai.request.max_tokens"] = req.max_tokens
        req.span = self.spans.start(req.request_id, req.arrival, carrier, attributes)
        req.exemplar, req.ctx = self.spans.exemplar(req.span)

    def _finish(self, req: RequestState, summary: RequestSummary, extra: Optional[dict[str, Any]],
                metrics: bool = True) -> None:
        if metrics:
            self.metrics.finished(summary.histogram_values(), summary.finish_reason, summary.num_preemptions,
                                  req.exemplar, req.ctx)
        if req.span is not None:
            self.spans.end(req.span, summary, extra)  # type: ignore[union-attr]

    def _internal_error(self, event: Any) -> None:
        try:
            self.metrics.dropped(t.INTERNAL_ERROR)
            self._drops.note(t.INTERNAL_ERROR, event, exc_info=True)
        except Exception:  # noqa: BLE001 - the last line of defence
            pass


def _valid_step(stats: StepStats) -> bool:
    try:
        return (t.is_count(stats.num_running) and t.is_count(stats.num_waiting)
                and (stats.num_batched_tokens is None or t.is_count(stats.num_batched_tokens))
                and 0.0 <= stats.kv_cache_usage <= 1.0)
    except (TypeError, AttributeError):
        return False
