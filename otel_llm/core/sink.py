"""The tracker's sink: what becomes of a request's lifecycle — metrics, its span, preemption events.

Called by the Tracker (and by EngineTelemetry.record_finished) under the recorder's lock.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from opentelemetry.context import Context

from otel_llm.core import tracker as t
from otel_llm.core.tracker import RequestState, RequestSummary
from otel_llm.events import RequestEvent
from otel_llm.recording.recorder import Recorder
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
        self.dropped(t.EVICTED, req)
        if req.span is not None:
            self.spans.abandon(req.span, req.last_ts, "evicted")  # type: ignore[union-attr]  # a req.span implies self.spans

    def dropped(self, reason: str, event: Any) -> None:
        self.metrics.dropped(reason)
        self._drops.note(reason, event)

    def preemption_event(
        self, req: RequestState, ordinal: int, ts: float, num_computed_tokens: int, reason: str
    ) -> None:
        """The one place a preemption becomes an event: span event and/or log record, per config."""
        if req.span is not None and self._span_events:
            self.spans.event(  # type: ignore[union-attr]  # a req.span implies self.spans
                req.span,
                "preempted",
                ts,
                {
                    "ordinal": ordinal,
                    "num_computed_tokens": num_computed_tokens,
                    "reason": reason,
                },
            )
        if self.log_events is not None:
            self.log_events.preempted(req.request_id, req.span, ordinal, ts, num_computed_tokens, reason)

    def start_span(self, req: RequestState, carrier: Any, attributes: dict[str, Any]) -> None:
        if self.spans is None:
            req.exemplar, req.ctx = self.spanless_exemplar, EMPTY_CONTEXT
            return
        if req.max_tokens > 0:
            attributes["gen_ai.request.max_tokens"] = req.max_tokens
        req.span = self.spans.start(req.request_id, req.arrival, carrier, attributes)
        req.exemplar, req.ctx = self.spans.exemplar(req.span)

    def finish(
        self, req: RequestState, summary: RequestSummary, extra: Optional[dict[str, Any]], metrics: bool = True
    ) -> None:
        if metrics:
            self.metrics.finished(
                summary.histogram_values(), summary.finish_reason, summary.num_preemptions, req.exemplar, req.ctx
            )
        if req.span is not None:
            self.spans.end(req.span, summary, extra)  # type: ignore[union-attr]  # a req.span implies self.spans

    def internal_error(self, event: Any) -> None:
        try:
            self.metrics.dropped(t.INTERNAL_ERROR)
            self._drops.note(t.INTERNAL_ERROR, event, exc_info=True)
        except Exception:  # noqa: BLE001 - the last line of defence
            pass
