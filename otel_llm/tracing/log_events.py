"""Preemptions as log-based events (OTEP 4430): one log record per preemption, beside or instead
of the request span's ``preempted`` span events."""

from __future__ import annotations

import time
from typing import Any, Optional

from opentelemetry import _logs, trace
from opentelemetry.context import Context

from otel_llm import _sdk
from otel_llm.tracing.spans import RequestSpans
from otel_llm.version import __version__

PREEMPTED_EVENT = "llm.request.preempted"  # event_name of a preemption's log record


class LogEvents:
    """Preemptions as log-based events (OTEP 4430): one log record per preemption, emitted with
    ``event_name`` through the Logs API, at the preemption's own time, carrying the request span's
    trace and span ids (when the request has a span). Not subject to a span's event limit: every
    preemption is emitted; the LoggerProvider's batch processor bounds what waits for export.
    """

    def __init__(self, logger_provider: Any, spans: Optional[RequestSpans]) -> None:
        self.logger = _logs.get_logger("otel_llm", __version__, logger_provider=logger_provider)
        # An SDK whose Logs API has no event_name emits nothing here (_sdk's start-up warning says so).
        self.supported = _sdk.holds("log_events")
        self._spans = spans
        offset_ns = time.time_ns() - time.monotonic_ns()
        # The spans' clock when there are spans: a log record and its span event share a timestamp.
        self.wall_ns = spans.wall_ns if spans is not None else (lambda ts: int(ts * 1e9) + offset_ns)

    def preempted(
        self,
        request_id: str,
        span: Any,
        ordinal: int,
        ts: float,
        num_computed_tokens: int,
        reason: str,
        cause: str,
        cause_ids: tuple[str, ...],
    ) -> None:
        if not self.supported:
            return
        context = (
            trace.set_span_in_context(self._spans._api_span(span), Context())
            if span is not None and self._spans is not None
            else Context()
        )
        attributes: dict[str, Any] = {
            "gen_ai.request.id": request_id,
            "llm.preemption.ordinal": ordinal,
            "llm.preemption.num_computed_tokens": num_computed_tokens,
            "llm.preemption.reason": reason,
            "llm.preemption.cause": cause,
        }
        if cause_ids:
            attributes["llm.preemption.cause_request_ids"] = cause_ids
        self.logger.emit(
            timestamp=self.wall_ns(ts),
            context=context,
            event_name=PREEMPTED_EVENT,
            attributes=attributes,
        )
