"""The tracker's sink: what becomes of a request's lifecycle — metrics, its span, preemption events.

Called by the Tracker, and with a finished request's summary alone by
EngineTelemetry.record_finished (engines that hand over derived stats), under the recorder's lock.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Iterable, Optional

from opentelemetry.context import Context

from otel_llm.catalogue import drops
from otel_llm.config.tenants import NO_CAUSE
from otel_llm.core.tenants import TenantResolver
from otel_llm.core.tracker import RequestState
from otel_llm.events import CAUSE_SELF, CAUSE_UNKNOWN, RequestEvent
from otel_llm.recording.recorder import Recorder, RequestSeries
from otel_llm.summary import RequestSummary
from otel_llm.tracing.log_events import LogEvents
from otel_llm.tracing.spans import RequestSpans, cut_short_attributes

_log = logging.getLogger(__name__)
EMPTY_CONTEXT = Context()  # records with no request span must not pick up an unrelated current span
# Span contexts kept for links: of finished requests that caused preemptions, and of spans opened
# before their request finished (a cause an engine reports by summary); the oldest go beyond.
MAX_LINK_TARGETS = 16_384
LINK_ORDINAL = "llm.preemption.ordinal"  # a preemption link's attribute: the victim's preemption
TENANT = "llm.tenant"  # a request span's attribute: its tenant (with a tenant source)
LINK_CAUSE_TENANT = "llm.cause.tenant"  # a preemption link's attribute: the cause's tenant


def so_far(req: RequestState) -> dict[str, Any]:
    """The span attributes of a request cut short: what it had done."""
    return cut_short_attributes(
        req.prompt_tokens, req.generation_tokens, req.num_preemptions, req.num_caused, req.recomputed_tokens
    )


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
        tenants: Optional[TenantResolver] = None,
    ) -> None:
        self.metrics = metrics
        self.tenants = tenants
        self.tokens = metrics.tokens  # TrackerSink.tokens: the recorder's own (one call per TOKENS event)
        self.spans = spans
        self.log_events = log_events
        self._span_events = span_events
        # Exemplar of an observation with no request span: always_on keeps one without trace ids.
        self.spanless_exemplar = spanless_exemplar
        self._drops = DropLog()
        # Link targets by request id: finished causes' span contexts; spans opened ahead (reserve).
        self._finished_causes: OrderedDict[str, Any] = OrderedDict()
        self._reserved: OrderedDict[str, tuple[Any, Any, Any]] = OrderedDict()
        # Tenants of finished requests that caused preemptions (a victim can name one late).
        self._finished_tenants: OrderedDict[str, str] = OrderedDict()

    def request_arrived(self, req: RequestState, event: RequestEvent) -> None:
        attributes = {}
        req.series = self.metrics
        if self.tenants is not None:
            tenant = req.tenant = self.tenants.resolve(event.tenant_facts, event.trace_context)
            series = req.series = self.metrics.for_tenant(tenant)
            req.on_tokens = series.tokens
            attributes[TENANT] = tenant
        if self.spans is not None:
            prompt = self.spans.content(event.prompt_text)
            if prompt is not None:
                attributes["gen_ai.prompt"] = prompt
        self.start_span(req, event.trace_context, attributes)

    def request_scheduled(self, req: RequestState, ts: float, resumed: bool) -> None:
        if resumed and req.span is not None:
            self.spans.event(req.span, "resumed", ts, {"ordinal": req.num_preemptions})  # type: ignore[union-attr]  # a req.span implies self.spans

    def request_preempted(
        self, req: RequestState, event: RequestEvent, kind: str, causes: list[tuple[str, Optional[RequestState]]]
    ) -> None:
        self.metrics.preempted(event.reason, event.num_computed_tokens)
        ids = tuple(cause_id for cause_id, _ in causes)
        if req.tenant is not None:
            # One count per preemption: of several causes (a set), the first one's tenant.
            req.series.preempted_by_tenant(self._tenant_of(*causes[0]) if causes else NO_CAUSE)
        targets: list[tuple[Any, Optional[str]]] = []
        if req.span is not None and self.spans is not None:
            for cause_id, cause in causes:
                if cause_id == req.request_id:
                    continue  # its own cause: the event says so, no link to itself
                tenant = self._tenant_of(cause_id, cause) if req.tenant is not None else None
                if cause is not None:
                    if cause.span is not None:
                        targets.append((self.spans.context(cause.span), tenant))
                else:
                    targets.append((self._finished_target(cause_id, event), tenant))
        self._preemption_event(
            req.request_id,
            req.span,
            req.num_preemptions,
            event.timestamp,
            event.num_computed_tokens,
            event.reason,
            kind,
            ids,
            targets,
        )

    def _tenant_of(self, cause_id: str, cause: Optional[RequestState]) -> str:
        """The tenant of a preemption's cause: in flight, finished, or never seen (none)."""
        if cause is not None:
            return cause.tenant if cause.tenant is not None else NO_CAUSE
        return self._finished_tenants.get(cause_id, NO_CAUSE)

    def first_token(self, req: RequestState, ts: float) -> None:
        series = req.series
        series.ttft(ts - req.arrival, req.exemplar, req.ctx)
        series.prompt_tokens(req.prompt_tokens)
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
            self.spans.abandon(req.span, req.last_ts, "evicted", so_far(req))  # type: ignore[union-attr]  # a req.span implies self.spans

    def dropped(self, reason: str, event: Any) -> None:
        self.metrics.dropped(reason)
        self._drops.note(reason, event)

    def _finished_target(self, cause_id: str, event: Any) -> Any:
        """The span context of a cause no longer in flight: a finished request's, or one opened
        ahead; None (counted) for a request id never seen or long forgotten."""
        target = self._finished_causes.get(cause_id)
        if target is None:
            reserved = self._reserved.get(cause_id)
            if reserved is not None:
                target = self.spans.context(reserved[0])  # type: ignore[union-attr]  # reserved implies spans
        if target is None:
            self.dropped(drops.UNKNOWN_CAUSE, event)
        return target

    def _preemption_event(
        self,
        request_id: str,
        span: Any,
        ordinal: int,
        ts: float,
        num_computed_tokens: int,
        reason: str,
        kind: str,
        cause_ids: tuple[str, ...],
        targets: Iterable[tuple[Any, Optional[str]]],
    ) -> None:
        """The one place a preemption becomes an event: span event and/or log record, per
        config, naming its cause; and a link from the span to each cause's span that is recorded
        (a cause sampled out has no trace to go to), with the cause's tenant when known."""
        if span is not None:
            spans = self.spans
            assert spans is not None  # a span implies spans
            if self._span_events:
                attributes: dict[str, Any] = {
                    "ordinal": ordinal,
                    "num_computed_tokens": num_computed_tokens,
                    "reason": reason,
                    "cause": kind,
                }
                if cause_ids:
                    attributes["cause_request_ids"] = cause_ids
                spans.event(span, "preempted", ts, attributes)
            for target, tenant in targets:
                if target is not None and target.is_valid and target.trace_flags.sampled:
                    link = (
                        {LINK_ORDINAL: ordinal}
                        if tenant is None
                        else {LINK_ORDINAL: ordinal, LINK_CAUSE_TENANT: tenant}
                    )
                    spans.link(span, target, link)
        if self.log_events is not None:
            self.log_events.preempted(request_id, span, ordinal, ts, num_computed_tokens, reason, kind, cause_ids)

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
        if req.tenant is not None and req.num_caused:
            _bounded_put(self._finished_tenants, req.request_id, req.tenant)
        self._finish(req.span, req.exemplar, req.ctx, summary, extra, req.series)

    def _finish(
        self,
        span: Any,
        exemplar: Any,
        ctx: Any,
        summary: RequestSummary,
        extra: Optional[dict[str, Any]],
        series: Optional[RequestSeries],
    ) -> None:
        """``series``: where the request's observations go (None: the request is not counted)."""
        if series is not None:
            series.finished(summary, exemplar, ctx)
        if span is not None:
            spans = self.spans
            assert spans is not None  # a span implies spans
            if summary.num_preemptions_caused:  # a link target of the requests it preempted
                _bounded_put(self._finished_causes, summary.request_id, spans.context(span))
            spans.end(span, summary, extra)

    def summary_finished(
        self, summary: RequestSummary, carrier: Any, metrics: bool, span: bool = True, matrix: bool = True
    ) -> None:
        """A request known only by its summary: its span (from arrival to finish, with the
        preemptions the summary lists) unless ``span`` is False, and, unless ``metrics`` is
        False, its observations. With a tenant source, its tenant's series, and its preemptions
        counted in the tenant matrix at its finish (unless ``matrix`` is False: counted
        already), also when ``metrics`` is False (a request the engine's own metrics do not
        count: the matrix still sums to every preemption); such a request aborted by its client
        (``incomplete`` None) adds its output tokens to ``aborted_generation_tokens``."""
        series: Optional[RequestSeries] = self.metrics if metrics else None
        tenant = cause_tenants = None
        if self.tenants is not None:
            tenant = self.tenants.resolve(summary.tenant_facts, carrier)
            cause_tenants = self._cause_tenants(summary, tenant)
            if summary.num_preemptions_caused:
                _bounded_put(self._finished_tenants, summary.request_id, tenant)
            tenant_series = self.metrics.for_tenant(tenant)
            if matrix:
                for cause_tenant in cause_tenants:
                    tenant_series.preempted_by_tenant(cause_tenant)
            if metrics:
                series = tenant_series
            elif summary.finish_reason == "abort" and summary.incomplete is None:
                tenant_series.aborted_tokens(summary.generation_tokens)
        if not span:
            self._reserved.pop(summary.request_id, None)
            if series is not None:
                series.finished(summary, self.spanless_exemplar, EMPTY_CONTEXT)
            return
        rid = summary.request_id
        opened = self._reserved.pop(rid, None)
        if opened is None:
            opened = self._open_span(rid, summary.arrival_time, summary.max_tokens, carrier, {})
        span_, exemplar, ctx = opened
        self._summary_events(rid, span_, summary, cause_tenants)
        self._finish(span_, exemplar, ctx, summary, None if tenant is None else {TENANT: tenant}, series)

    def _cause_tenants(self, summary: RequestSummary, tenant: str) -> list[str]:
        """The tenant of each preemption's cause, in order (its first cause's when several): the
        request's own when it was its own cause; from the facts the summary carries of it, else
        by its id (a finished request), else none."""
        causes = summary.preemption_causes
        out = []
        for n in range(summary.num_preemptions):
            cause = causes[n] if n < len(causes) else None
            if cause is None or not cause.request_ids:
                out.append(NO_CAUSE)
            elif cause.kind == CAUSE_SELF:
                out.append(tenant)
            elif cause.tenant_facts is not None and self.tenants is not None:
                out.append(self.tenants.resolve(cause.tenant_facts, None))
            else:
                out.append(self._finished_tenants.get(cause.request_ids[0], NO_CAUSE))
        return out

    def _summary_events(self, rid: str, span: Any, summary: RequestSummary, cause_tenants: Optional[list[str]]) -> None:
        """The span events a request known by its summary had, in time order, as the events of a
        request followed step by step make them: each preemption (a log record too, per config), each
        resumption, the first token."""
        marks: list[tuple[float, int, int]] = [(ts, 1, n) for n, (ts, _, _) in enumerate(summary.preemptions, 1)]
        marks += [(ts, 2, n) for n, ts in enumerate(summary.resumptions, 1)]
        if summary.ttft is not None:
            marks.append((summary.arrival_time + summary.ttft, 0, 0))
        causes = summary.preemption_causes
        for ts, mark, ordinal in sorted(marks):
            if mark == 0:
                if span is not None:
                    self.spans.event(span, "first_token", ts, {})  # type: ignore[union-attr]  # a span implies self.spans
            elif mark == 2:
                if span is not None:
                    self.spans.event(span, "resumed", ts, {"ordinal": ordinal})  # type: ignore[union-attr]
            else:
                _, tokens, reason = summary.preemptions[ordinal - 1]
                cause = causes[ordinal - 1] if ordinal <= len(causes) else None
                ids = cause.request_ids if cause is not None else ()
                targets = []
                if span is not None:
                    for c in ids:
                        if c != rid:
                            tenant = None
                            if cause_tenants is not None:  # the first cause's is known; the others' by id
                                tenant = cause_tenants[ordinal - 1] if c == ids[0] else self._tenant_of(c, None)
                            targets.append((self._finished_target(c, summary), tenant))
                kind = cause.kind if cause is not None else CAUSE_UNKNOWN
                self._preemption_event(rid, span, ordinal, ts, tokens, reason, kind, ids, targets)

    def reserve_span(self, request_id: str, arrival: float, carrier: Any) -> None:
        """Open the span of a request known by its summary at its finish only, now: a request
        that finishes later can link to it (the span is used, ended, when its summary comes)."""
        if request_id in self._reserved or request_id in self._finished_causes:
            return
        _bounded_put(self._reserved, request_id, self._open_span(request_id, arrival, 0, carrier, {}))

    def forget_reserved(self) -> None:
        """At shutdown: the spans opened ahead whose request never finished are left unended."""
        self._reserved.clear()

    def internal_error(self, event: Any) -> None:
        try:
            self.metrics.dropped(drops.INTERNAL_ERROR)
            self._drops.note(drops.INTERNAL_ERROR, event, exc_info=True)
        except Exception:  # noqa: BLE001 - the last line of defence
            pass


def _bounded_put(kept: OrderedDict[str, Any], key: str, value: Any) -> None:
    kept[key] = value
    kept.move_to_end(key)
    if len(kept) > MAX_LINK_TARGETS:
        kept.popitem(last=False)
