"""EngineTelemetry: the hook-bus subscriber that ties the tracker, the metrics and the spans.

Guarantees: nothing raises into the engine (bad events are dropped and counted by reason,
internal failures too); state is bounded (the tracker's caps, at most ``defer_steps`` kept
batches); batches are applied in order under one lock, so several publishing threads keep
exact totals.

Event batches, credits of causes ahead of their preemption's event
(:meth:`EngineTelemetry.credit_causes`) and the engine steps an adapter hands over
(:meth:`EngineTelemetry.keep_step`) are kept in one queue and applied together, in order, every
``defer_steps`` engine steps (16 through setup_telemetry; a hand-built EngineTelemetry applies each
at once unless set): between two steps the model's work evicts the CPU caches, and the
telemetry's code and data then cost several times more than when warm (engine_stub: ~3 us per
TOKENS event cold, 0.5 us warm). Of the StepStats that only set gauges, the last one waits with
them. A reader's collection (the provider instruments' callbacks), an idle engine step, flush() and
shutdown() apply what is pending first, so no reader ever sees a partial picture.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from typing import Any, Iterable, Mapping, Optional, Protocol, Sequence, Union

from opentelemetry import metrics as metrics_api

from otel_llm import _sdk
from otel_llm.catalogue import drops
from otel_llm.config.settings import TelemetryConfig
from otel_llm.core import tenants
from otel_llm.core import tracker as t
from otel_llm.core.sink import EMPTY_CONTEXT, RequestSink, so_far
from otel_llm.core.tracker import Tracker
from otel_llm.events import RequestEvent, StepStats
from otel_llm.recording.in_process import InProcessRecorder
from otel_llm.recording.recorder import Recorder
from otel_llm.recording.sdk import SdkRecorder
from otel_llm.recording.views import provider_has_views
from otel_llm.summary import SHUTDOWN, RequestSummary
from otel_llm.tracing.log_events import LogEvents
from otel_llm.tracing.spans import request_spans

_log = logging.getLogger(__name__)
_warned_providers: set[int] = set()

# An engine step as an adapter keeps it (its engine's own stats, e.g. vLLM's), opaque here.
KeptStep = Any
# One tenant's per-iteration values: (tenant, ttfts, itls, prompt_tokens, generation_tokens).
TenantIteration = tuple[str, Sequence[float], Sequence[float], int, int]


class _Credit:
    """Causes credited ahead of their victim's event (:meth:`EngineTelemetry.credit_causes`),
    kept in order with the event batches."""

    __slots__ = ("victim", "ordinal", "causes")

    def __init__(self, victim: str, ordinal: int, causes: Sequence[str]) -> None:
        self.victim = victim
        self.ordinal = ordinal
        self.causes = causes


class StepTranslator(Protocol):
    """Turns the engine steps an adapter keeps (:meth:`EngineTelemetry.keep_step`) into records,
    through the telemetry's own methods (``record_iteration``, ``record_finished``, ``on_step``):
    called with every step kept in a row, oldest first, so that they are translated together."""

    def __call__(self, telemetry: "EngineTelemetry", steps: Sequence[KeptStep]) -> None: ...


METRIC_PATHS = ("auto", "in_process", "sdk")
SPAN_PATHS = ("auto", "tracer")


def _recorder(meter_provider: Any, config: TelemetryConfig, metric_path: str) -> Recorder:
    if metric_path not in METRIC_PATHS:
        raise ValueError(f"metric_path: {metric_path!r} is not one of {METRIC_PATHS}")
    in_process = metric_path == "in_process"
    if metric_path == "auto":
        if not _sdk.in_process_metrics(config.exponential):
            return SdkRecorder(meter_provider, config)  # _sdk's start-up warning says why
        in_process = provider_has_views(meter_provider, config)
        if not in_process and id(meter_provider) not in _warned_providers:
            _warned_providers.add(id(meter_provider))
            _log.warning(
                "otel_llm: this MeterProvider was built without otel_llm.views(config): metric names "
                "and buckets are the SDK's defaults and every observation goes through the SDK. "
                "Build it with MeterProvider(views=otel_llm.views(config), ...)."
            )
    return (InProcessRecorder if in_process else SdkRecorder)(meter_provider, config)


class EngineTelemetry:
    """Subscribe to an engine's hook bus: ``engine.hooks.subscribe(EngineTelemetry(config))``.

    The engine-facing API: ``on_events``/``on_step`` (the hook bus), ``flush``, ``shutdown``;
    ``record_finished``/``record_iteration`` for adapters whose engine hands over derived stats
    (vLLM); ``count_dropped`` for losses found elsewhere (the export path).

    ``metric_path``: "auto" (default) aggregates in process when the MeterProvider was built with
    :func:`otel_llm.views`, else takes the SDK path with one warning; "in_process" or "sdk"
    chooses (tests and benchmarks compare both). ``span_path``: "auto" (default) assembles spans
    (spans.AssembledSpans) when the TracerProvider is the SDK's; "tracer" goes through the Tracer
    API. ``logger_provider``: where preemptions go as log-based events when
    ``config.preemption_events`` is "log" or "both" (None: the global LoggerProvider).
    ``metrics``, ``spans`` and ``tracker`` are the parts it is made of, for tests to look into;
    ``exemplar_filter`` is the filter in effect (always_on, always_off or trace_based).
    ``tenant_sources``: the tenant sources (``otel_llm.config.tenants.KINDS``) the engine hands
    over per request (``RequestEvent.tenant_facts``), named ``entry_point`` in the warning that
    refuses another (None: any); ``config`` is then the config in effect, without the tenant.
    """

    def __init__(
        self,
        config: Optional[TelemetryConfig] = None,
        *,
        meter_provider: Any = None,
        tracer_provider: Any = None,
        logger_provider: Any = None,
        metric_path: str = "auto",
        span_path: str = "auto",
        tenant_sources: Optional[Sequence[str]] = None,
        entry_point: str = "this engine",
    ) -> None:
        if span_path not in SPAN_PATHS:
            raise ValueError(f"span_path: {span_path!r} is not one of {SPAN_PATHS}")
        # A tenant source the engine cannot hand over is refused here, once, with a warning.
        self.config = config = tenants.reachable(config or TelemetryConfig(), tenant_sources, entry_point)
        self.metrics: Recorder = _recorder(meter_provider or metrics_api.get_meter_provider(), config, metric_path)
        self.exemplar_filter = exemplar_filter = (
            config.exemplar_filter or os.environ.get("OTEL_METRICS_EXEMPLAR_FILTER", "") or "trace_based"
        ).lower()
        self.spans = (
            request_spans(config, tracer_provider, exemplar_filter, span_path == "auto") if config.spans else None
        )
        self.log_events = LogEvents(logger_provider, self.spans) if config.log_events else None
        self._sink = RequestSink(
            self.metrics,
            self.spans,
            self.log_events,
            config.preemption_events != "log",
            (None, None) if exemplar_filter == "always_on" else None,
            tenants.resolver(config),
        )
        self.tracker = Tracker(self._sink, config.max_inflight_requests)
        # Event batches (tuples), credits of causes, an adapter's kept engine steps, in the order they came.
        self._pending: deque[Union[tuple[RequestEvent, ...], _Credit, KeptStep]] = deque()
        self._translate: Optional[StepTranslator] = None
        # The last StepStats that only sets gauges, kept for the pending work (on_step); a deque
        # of one: a step replaces the one kept, and the one taken out, atomically for any thread.
        self._latest_step: deque[StepStats] = deque(maxlen=1)
        # Deferred only where every collection applies the pending work first (the instruments'
        # drain); the SDK path records as it goes.
        instruments = self.metrics.instruments if isinstance(self.metrics, InProcessRecorder) else None
        self._defer_steps = (config.defer_steps or 1) if instruments is not None else 1
        if instruments is not None and self._defer_steps > 1:
            instruments.pending.add(self)
        self._closed = False

    # -- the hook bus interface ----------------------------------------------------------

    def on_events(self, events: Sequence[RequestEvent]) -> None:
        try:
            pending = self._pending
            pending.append(tuple(events))  # a copy: the engine may reuse its list
            if len(pending) >= self._defer_steps:
                self.apply_pending()
        except Exception:  # noqa: BLE001 - e.g. events not iterable
            self._sink.internal_error(events)

    def apply_pending(self) -> None:
        """Apply the event batches, credits and engine steps kept so far
        (``TelemetryConfig.defer_steps``), in order, then the last gauges-only StepStats; the
        steps kept in a row go to the step translator in one call."""
        handle = self.tracker.handle
        pending = self._pending
        with self.metrics.lock:
            while pending:
                batch = pending.popleft()
                if type(batch) is _Credit:
                    self._credit(batch)
                    continue
                if type(batch) is not tuple:
                    steps = [batch]
                    while pending and type(pending[0]) not in (tuple, _Credit):
                        steps.append(pending.popleft())
                    self._translate_steps(steps)
                    continue
                for event in batch:
                    try:
                        handle(event)
                    except (TypeError, AttributeError, ValueError):
                        self._sink.dropped(drops.INVALID_VALUE, event)
                    except Exception:  # noqa: BLE001 - never into the engine
                        self._sink.internal_error(event)
            if self._latest_step:
                self.metrics.step(self._latest_step.pop())

    def flush(self) -> None:
        """Apply pending events now (readers and shutdown do it themselves)."""
        try:
            self.apply_pending()
        except Exception:  # noqa: BLE001 - never into the engine
            self._sink.internal_error(None)

    def on_step(self, stats: StepStats) -> None:
        try:
            if not _valid_step(stats):
                with self.metrics.lock:
                    self._sink.dropped(drops.INVALID_VALUE, stats)
                return
            if self._defer_steps > 1 and stats.num_batched_tokens is None:
                # Gauges only (no iteration's tokens to observe): a reader sees the last values set,
                # so the step waits with the pending work, replaced by the next such step.
                self._latest_step.append(stats)
            else:
                with self.metrics.lock:
                    self._latest_step.clear()
                    self.metrics.step(stats)
            if (self._pending or self._latest_step) and stats.num_running == 0 and stats.num_waiting == 0:
                self.apply_pending()  # the engine went idle: nothing left to slow down
        except Exception:  # noqa: BLE001 - never into the engine
            self._sink.internal_error(stats)

    # -- for adapters whose engine hands over derived stats (vLLM) -----------------------

    def translate_steps_with(self, translator: StepTranslator) -> None:
        """The translator of the engine steps an adapter keeps (:meth:`keep_step`)."""
        self._translate = translator

    def keep_step(self, step: KeptStep, idle: bool = False) -> None:
        """Keep one engine step as the adapter got it, to be translated (by the translator given
        to :meth:`translate_steps_with`) in order with the event batches, every
        ``defer_steps`` steps, at collection, flush and shutdown; ``idle``: the engine went
        idle, apply everything now."""
        try:
            pending = self._pending
            pending.append(step)
            if idle or len(pending) >= self._defer_steps:
                self.apply_pending()
        except Exception:  # noqa: BLE001 - never into the engine
            self._sink.internal_error(None)

    def _translate_steps(self, steps: list[KeptStep]) -> None:
        try:
            if self._translate is None:
                raise RuntimeError("engine steps kept with no step translator")
            self._translate(self, steps)
        except Exception:  # noqa: BLE001 - never into the engine
            # Every step of the batch is lost: one report, each counted.
            self._sink.internal_error(steps[0])
            self._sink.metrics.dropped(drops.INTERNAL_ERROR, len(steps) - 1)

    def record_finished(
        self,
        summary: RequestSummary,
        trace_context: Optional[Any] = None,
        metrics: bool = True,
        span: bool = True,
        matrix: bool = True,
    ) -> None:
        """Per-request histograms, ``request_success`` and one span, from a finished request;
        ``trace_context``: the caller's W3C carrier (``traceparent``), parent of the span;
        ``metrics=False``: the span, and with a tenant source the tenant matrix and aborted
        tokens, only (a request the engine's own metrics do not count); ``span=False``: the
        metrics only (a request whose span was already ended); ``matrix=False``: its preemptions
        are not counted in the tenant matrix (they were, at its span)."""
        try:
            with self.metrics.lock:
                self._sink.summary_finished(summary, trace_context, metrics, span, matrix)
        except Exception:  # noqa: BLE001 - never into the engine
            self._sink.internal_error(summary)

    def reserve_span(self, request_id: str, arrival_time: float, trace_context: Optional[Any] = None) -> None:
        """Decide now the span of a request that ``record_finished`` will report at its finish:
        another request's span can then link to it before it finishes (the cause of a
        preemption). ``arrival_time``: engine monotonic seconds, the span's start."""
        try:
            with self.metrics.lock:
                self._sink.reserve_span(request_id, arrival_time, trace_context)
        except Exception:  # noqa: BLE001 - never into the engine
            self._sink.internal_error(None)

    def record_iteration(
        self,
        *,
        ttfts: Iterable[float] = (),
        itls: Iterable[float] = (),
        prompt_tokens: int = 0,
        generation_tokens: int = 0,
        num_preemptions: int = 0,
        preemption_reason: str = "kv_cache_full",
    ) -> None:
        """Per-iteration observations that are not tied to a request span."""
        try:
            with self.metrics.lock:
                m = self.metrics
                exemplar = self._sink.spanless_exemplar
                m.latencies(tuple(ttfts), tuple(itls), exemplar, EMPTY_CONTEXT)
                m.prompt_tokens(prompt_tokens)
                m.tokens(generation_tokens, None, exemplar, EMPTY_CONTEXT)
                for _ in range(num_preemptions):
                    m.preempted(preemption_reason, 0)
        except Exception:  # noqa: BLE001 - never into the engine
            self._sink.internal_error(None)

    def record_iteration_by_tenant(self, parts: Iterable[TenantIteration]) -> None:
        """Per-iteration latencies and token counts of several tenants (:meth:`tenant_of`), as
        ``(tenant, ttfts, itls, prompt_tokens, generation_tokens)``, the sequences not reused by
        the caller; one call for several engine steps."""
        try:
            with self.metrics.lock:
                m = self.metrics
                exemplar = self._sink.spanless_exemplar
                for tenant, ttfts, itls, prompt_tokens, generation_tokens in parts:
                    series = m.for_tenant(tenant)
                    series.latencies(ttfts, itls, exemplar, EMPTY_CONTEXT)
                    series.prompt_tokens(prompt_tokens)
                    series.tokens(generation_tokens, None, exemplar, EMPTY_CONTEXT)
        except Exception:  # noqa: BLE001 - never into the engine
            self._sink.internal_error(None)

    def tenant_of(self, facts: Optional[Mapping[str, Any]]) -> Optional[str]:
        """The tenant label of a request whose engine hands over ``facts``
        (``RequestEvent.tenant_facts``); None without a tenant source. Under the lock that
        applies events (the resolver counts the distinct tenants)."""
        resolver = self._sink.tenants
        if resolver is None:
            return None
        with self.metrics.lock:
            return resolver.resolve(facts, None)

    def credit_causes(self, victim: str, ordinal: int, cause_ids: Sequence[str]) -> None:
        """Credit the causes of ``victim``'s ``ordinal``-th preemption, whose event (naming
        them) comes later (:meth:`.Tracker.credit_causes`): kept in order with the event batches,
        applied after those that came before it (a preemption is no reason to apply them early)."""
        try:
            pending = self._pending
            pending.append(_Credit(victim, ordinal, tuple(cause_ids)))
            if len(pending) >= self._defer_steps:
                self.apply_pending()
        except Exception:  # noqa: BLE001 - never into the engine
            self._sink.internal_error(None)

    def _credit(self, credit: _Credit) -> None:
        try:
            self.tracker.credit_causes(credit.victim, credit.ordinal, credit.causes)
        except Exception:  # noqa: BLE001 - never into the engine
            self._sink.internal_error(None)

    def count_dropped(self, reason: str, n: int = 1) -> None:
        """Count ``n`` items lost for ``reason`` on ``otel_llm.dropped_events`` (e.g. by the export
        path). Safe from any thread that does not already hold the recorder's lock."""
        with self.metrics.lock:
            self.metrics.dropped(reason, n)

    def shutdown(self) -> int:
        """Apply pending events, end the spans of requests still in flight (marked incomplete),
        and return how many requests were in flight: counted as they are ended, under the lock
        that applies events, so a request another thread finishes meanwhile is either finished
        or counted here, never both. Requests that arrive later get no span (the providers are
        shut down with it: each span would be dropped, with a warning line per span from SDK
        1.28's batch processor). Idempotent: 0 after the first call."""
        self.flush()
        with self.metrics.lock:
            if self._closed:
                return 0
            self._closed = True
            in_flight = self.end_in_flight(SHUTDOWN)
            self._sink.forget_reserved()
            self._sink.spans = None
            return in_flight

    def end_in_flight(self, why: str) -> int:
        """End the spans of the requests in flight, marked incomplete ``why`` (``shutdown``,
        ``engine_dead``), and forget them; how many there were. The telemetry goes on."""
        try:
            self.apply_pending()
            with self.metrics.lock:
                in_flight = self.tracker.drain()
                for req in in_flight:
                    if req.span is not None:
                        self.spans.abandon(req.span, None, why, so_far(req))  # type: ignore[union-attr]  # a req.span implies self.spans
                return len(in_flight)
        except Exception:  # noqa: BLE001 - never into the engine
            self._sink.internal_error(None)
            return 0


def _valid_step(stats: StepStats) -> bool:
    try:
        return (
            t.is_count(stats.num_running)
            and t.is_count(stats.num_waiting)
            and (stats.num_batched_tokens is None or t.is_count(stats.num_batched_tokens))
            and 0.0 <= stats.kv_cache_usage <= 1.0
        )
    except (TypeError, AttributeError):
        return False
