"""The tracker's sink: what becomes of a request's lifecycle — metrics, its span, preemption events.

Called by the Tracker, and with a finished request's summary alone by
EngineTelemetry.record_finished (engines that hand over derived stats), under the recorder's lock.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from opentelemetry.context import Context

from otel_llm.catalogue import drops
from otel_llm.core.tracker import RequestState
from otel_llm.events import RequestEvent
from otel_llm.recording.recorder import Recorder
from otel_llm.summary import RequestSummary
from otel_llm.tracing.log_events import LogEvents
from otel_llm.tracing.spans import RequestSpans

_log = logging.getLogger(__name__)
EMPTY_CONTEXT = Context()  # records with no request span must not pick up an unrelated current span


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
        _log.warning(
            "otel_llm dropped an event (%s): %s%s",
            reason,
            _describe(event),
            f" (+{more} more since the last report)" if more else "",
            exc_info=exc_info,
        )


def _describe(event: Any) -> str:
    # Never the payload texts: ids and numbers only.
    if not hasattr(event, "type") and not hasattr(event, "request_id"):
        return f"a {type(event).__name__}"  # e.g. an adapter's kept engine step, or None
    kind = getattr(event, "type", None)
    return f"type={getattr(kind, 'name', kind)!r} request_id={str(getattr(event, 'request_id', '?'))[:64]!r}"


class RequestSink:
    """Implements tracker.TrackerSink."""

    def __init__(
        self,
        metrics: Recorder,
        spans: Optional[RequestSpans],
        log_events: Optional[LogEvents],
        span_events: bool,
        spanless_exemplar: Optional[tuple[None, None]],
    ) -> None:
        self.metrics = metrics
        self.tokens = metrics.tokens  # TrackerSink.tokens: the recorder's own (one call per TOKENS event)
        self.spans = spans
        self.log_events = log_events
        self._span_events = span_events
        # Exemplar of an observation with no request span: always_on keeps one without trace ids.
        self.spanless_exemplar = spanless_exemplar
        self._drops = DropLog()

    def request_arrived(self, req: RequestState, event: RequestEvent) -> None:
        attributes = {}
        if self.spans is not None:
            prompt = self.spans.content(event.prompt_text)
            if prompt is not None:
                attributes["gen_ai.prompt"] = prompt
        self.start_span(req, event.trace_context, attributes)

    def request_scheduled(self, req: RequestState, ts: float, resumed: bool) -> None:
        if resumed and req.span is not None:
            self.spans.event(req.span, "resumed", ts, {"ordinal": req.num_preemptions})  # type: ignore[union-attr]  # a req.span implies self.spans

    def request_preempted(self, req: RequestState, event: RequestEvent) -> None:
        self.metrics.preempted(event.reason, event.num_computed_tokens)
        self.preemption_event(req, req.num_preemptions, event.timestamp, event.num_computed_tokens, event.reason)

    def first_token(self, req: RequestState, ts: float) -> None:
        self.metrics.ttft(ts - req.arrival, req.exemplar, req.ctx)
        self.metrics.prompt_tokens(req.prompt_tokens)
        if req.span is not None:
            self.spans.event(req.span, "first_token", ts, {})  # type: ignore[union-attr]  # a req.span implies self.spans

    def request_finished(self, req: RequestState, summary: RequestSummary, event: RequestEvent) -> None:
        extra = None
        if self.spans is not None:
            output = self.spans.content(event.output_text)
            if output is not None:
                extra = {"gen_ai.completion": output}
        self.finish(req, summary, extra)

    def request_evicted(self, req: RequestState) -> None:
        self.dropped(drops.EVICTED, req)
        if req.span is not None:
            self.spans.abandon(req.span, req.last_ts, "evicted")  # type: ignore[union-attr]  # a req.span implies self.spans

    def dropped(self, reason: str, event: Any) -> None:
        self.metrics.dropped(reason)
        self._drops.note(reason, event)

    def preemption_event(
        self, req: RequestState, ordinal: int, ts: float, num_computed_tokens: int, reason: str
    ) -> None:
        self._preemption_event(req.request_id, req.span, ordinal, ts, num_computed_tokens, reason)

    def _preemption_event(
        self, request_id: str, span: Any, ordinal: int, ts: float, num_computed_tokens: int, reason: str
    ) -> None:
        """The one place a preemption becomes an event: span event and/or log record, per config."""
        if span is not None and self._span_events:
            self.spans.event(  # type: ignore[union-attr]  # a span implies self.spans
                span,
                "preempted",
                ts,
                {
                    "ordinal": ordinal,
                    "num_computed_tokens": num_computed_tokens,
                    "reason": reason,
                },
            )
        if self.log_events is not None:
            self.log_events.preempted(request_id, span, ordinal, ts, num_computed_tokens, reason)

    def start_span(self, req: RequestState, carrier: Any, attributes: dict[str, Any]) -> None:
        req.span, req.exemplar, req.ctx = self._open_span(
            req.request_id, req.arrival, req.max_tokens, carrier, attributes
        )

    def _open_span(
        self, request_id: str, arrival: float, max_tokens: int, carrier: Any, attributes: dict[str, Any]
    ) -> tuple[Any, Any, Any]:
        """(span, exemplar ids, context) of a new request span; no span when spans are off."""
        if self.spans is None:
            return None, self.spanless_exemplar, EMPTY_CONTEXT
        if max_tokens > 0:
            attributes["gen_ai.request.max_tokens"] = max_tokens
        span = self.spans.start(request_id, arrival, carrier, attributes)
        exemplar, ctx = self.spans.exemplar(span)
        return span, exemplar, ctx

    def finish(self, req: RequestState, summary: RequestSummary, extra: Optional[dict[str, Any]]) -> None:
        self._finish(req.span, req.exemplar, req.ctx, summary, extra, True)

    def _finish(
        self,
        span: Any,
        exemplar: Any,
        ctx: Any,
        summary: RequestSummary,
        extra: Optional[dict[str, Any]],
        metrics: bool,
    ) -> None:
        if metrics:
            self.metrics.finished(summary, exemplar, ctx)
        if span is not None:
            self.spans.end(span, summary, extra)  # type: ignore[union-attr]  # a span implies self.spans

    def summary_finished(self, summary: RequestSummary, carrier: Any, metrics: bool, span: bool = True) -> None:
        """A request known only by its summary: its span (from arrival to finish, with the
        preemptions the summary lists) unless ``span`` is False, and, unless ``metrics`` is
        False, its observations."""
        if not span:
            if metrics:
                self.metrics.finished(summary, self.spanless_exemplar, EMPTY_CONTEXT)
            return
        span, exemplar, ctx = self._open_span(summary.request_id, summary.arrival_time, summary.max_tokens, carrier, {})
        for ordinal, (ts, tokens, reason) in enumerate(summary.preemptions, 1):
            self._preemption_event(summary.request_id, span, ordinal, ts, tokens, reason)
        self._finish(span, exemplar, ctx, summary, None, metrics)

    def internal_error(self, event: Any) -> None:
        try:
            self.metrics.dropped(drops.INTERNAL_ERROR)
            self._drops.note(drops.INTERNAL_ERROR, event, exc_info=True)
        except Exception:  # noqa: BLE001 - the last line of defence
            pass
