"""Request spans: one ``llm_request`` span per request, span events at each preemption (the
same preemptions as log-based events: :mod:`otel_llm.tracing.log_events`).

Two ways to make them, with the same output (tests/core/test_spans_equivalence.py):

* :class:`RequestSpans` goes through the Tracer API: a live span from arrival to finish, an
  ``add_event`` per event. Works with any TracerProvider.
* :class:`AssembledSpans`, used with the SDK's TracerProvider: the span context (ids, sampling)
  is decided at arrival as the SDK's Tracer would, events are kept as plain records, and the
  finished span is built once at the end and handed to the provider's span processors
  (``on_end``). The live span costs ~40 us per request through the SDK (per-call attribute
  cleaning, a lock per event, start/end processor calls), ~100 us on the cold caches of an
  engine step; the assembled one ~8 us.

Times come from the engine's monotonic clock; one offset, taken once, converts them to the
wall clock that spans need.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Mapping, Optional

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TracerProvider,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_llm import _sdk
from otel_llm._sdk import tracer as sdk_tracer
from otel_llm.catalogue.metrics import ERROR_TYPE, GEN_AI_OPERATION
from otel_llm.config.settings import TelemetryConfig
from otel_llm.recording.cells import ExemplarIds
from otel_llm.summary import RequestSummary
from otel_llm.version import __version__

SPAN_KINDS = {"server": SpanKind.SERVER, "internal": SpanKind.INTERNAL}


_propagator = TraceContextTextMapPropagator()


_UNSET = Status(StatusCode.UNSET)


# Attributes a request span gets after its start: the end ones (error.type included), the
# completion, the incomplete mark.
_MAX_LATER_ATTRIBUTES = 19
# A span attribute with the links the span's limit dropped (OTLP's dropped_links_count says it too,
# where the back end shows it).
LINKS_DROPPED = "llm.request.preemption_links_dropped"


def request_spans(
    config: TelemetryConfig, tracer_provider: Optional[TracerProvider], exemplar_filter: str, assembled: bool = True
) -> "RequestSpans":
    """Assembled spans when the provider is the SDK's (and ``assembled``), else the Tracer API path."""
    tracer = trace.get_tracer("otel_llm", __version__, tracer_provider=tracer_provider)
    if assembled and isinstance(tracer, SdkTracer) and _sdk.holds("tracer"):
        return AssembledSpans(config, tracer, exemplar_filter)
    return RequestSpans(config, tracer, exemplar_filter)


def cut_short_attributes(
    prompt_tokens: int, generation_tokens: int, num_preemptions: int, num_caused: int, recomputed_tokens: int
) -> dict[str, Any]:
    """What a span cut short (its request evicted, shut down, its engine dead) says of it so far."""
    return {
        "gen_ai.usage.input_tokens": prompt_tokens,
        "gen_ai.usage.output_tokens": generation_tokens,
        "llm.request.num_preemptions": num_preemptions,
        "llm.request.num_preemptions_caused": num_caused,
        "llm.request.recomputed_tokens": recomputed_tokens,
    }


class RequestSpans:
    def __init__(self, config: TelemetryConfig, tracer: trace.Tracer, exemplar_filter: str) -> None:
        self.config = config
        self.tracer = tracer
        self._exemplar_filter = exemplar_filter
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._model = config.model_name
        self._provider = config.provider_name
        self.name, self.kind = config.span_name, SPAN_KINDS[config.span_kind]

    def wall_ns(self, monotonic_seconds: float) -> int:
        return int(monotonic_seconds * 1e9) + self._offset_ns

    def _start_attributes(self, request_id: str, attributes: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "gen_ai.request.id": request_id,
            "gen_ai.operation.name": GEN_AI_OPERATION,
            "gen_ai.provider.name": self._provider,
            "gen_ai.request.model": self._model,
            **attributes,
        }

    def start(
        self, request_id: str, ts: float, carrier: Optional[Mapping[str, str]], attributes: Mapping[str, Any]
    ) -> Any:
        parent = _propagator.extract(carrier) if carrier else None
        return self.tracer.start_span(
            self.name,
            context=parent,
            kind=self.kind,
            start_time=self.wall_ns(ts),
            attributes=self._start_attributes(request_id, attributes),
        )

    def _api_span(self, span: Any) -> trace.Span:
        return span

    def exemplar(self, span: Any) -> tuple[Optional[ExemplarIds], Any]:
        """Exemplar ids for observations of this request, and the context to record with.

        Mirrors the SDK's exemplar filters so that in-process histograms and SDK histograms
        attach the same exemplars.
        """
        if self._exemplar_filter == "always_off":
            return None, None
        api_span = self._api_span(span)
        sc = api_span.get_span_context()
        ctx = trace.set_span_in_context(api_span)
        if sc.is_valid and sc.trace_flags.sampled:
            return (sc.trace_id, sc.span_id), ctx
        if self._exemplar_filter == "always_on":
            return (None, None), ctx
        return None, ctx

    def event(self, span: Any, name: str, ts: float, attributes: Mapping[str, Any]) -> None:
        span.add_event(name, attributes, timestamp=self.wall_ns(ts))

    def context(self, span: Any) -> SpanContext:
        """The span's context, a link's target."""
        return self._api_span(span).get_span_context()

    def link(self, span: Any, target: SpanContext, attributes: Mapping[str, Any]) -> None:
        span.add_link(target, attributes)

    @staticmethod
    def _end_attributes(summary: RequestSummary, extra: Optional[Mapping[str, Any]]) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "gen_ai.usage.input_tokens": summary.prompt_tokens,
            "gen_ai.usage.output_tokens": summary.generation_tokens,
            "gen_ai.response.finish_reasons": (summary.finish_reason,),
            "llm.request.num_preemptions": summary.num_preemptions,
            "llm.request.num_preemptions_caused": summary.num_preemptions_caused,
            "llm.request.recomputed_tokens": summary.recomputed_tokens,
            "llm.request.e2e_latency": summary.e2e,
        }
        if summary.max_tokens > 0:
            attributes["gen_ai.request.max_tokens"] = summary.max_tokens
        if summary.finish_reason == "error":
            attributes["error.type"] = ERROR_TYPE
        if summary.error_type is not None:
            attributes["error.type"] = summary.error_type
        if summary.incomplete is not None:
            attributes["llm.request.incomplete"] = summary.incomplete
        for name, value in (
            ("llm.request.queue_time", summary.queue_time),
            ("llm.request.time_to_first_token", summary.ttft),
            ("llm.request.prefill_time", summary.prefill_time),
            ("llm.request.decode_time", summary.decode_time),
            ("llm.request.inference_time", summary.inference_time),
            ("llm.request.time_per_output_token", summary.time_per_output_token),
            ("llm.request.preempted_time", summary.preempted_time),
        ):
            if value is not None:
                attributes[name] = value
        if extra:
            attributes.update(extra)
        return attributes

    @staticmethod
    def _end_status(summary: RequestSummary) -> Status:
        if summary.incomplete is not None:
            return Status(StatusCode.ERROR, f"request cut short: {summary.incomplete}")
        return Status(StatusCode.ERROR, "finish_reason=error") if summary.finish_reason == "error" else _UNSET

    @staticmethod
    def _abandon_status(why: str) -> Status:
        return Status(StatusCode.ERROR, f"request span ended by telemetry: {why}")

    def end(self, span: Any, summary: RequestSummary, extra: Optional[Mapping[str, Any]] = None) -> None:
        # Attributes set in one call (one lock acquisition in the SDK instead of one per attribute).
        attributes = self._end_attributes(summary, extra)
        dropped = getattr(span, "dropped_links", 0)
        if dropped:
            attributes[LINKS_DROPPED] = dropped
        span.set_attributes(attributes)
        status = self._end_status(summary)
        if status is not _UNSET:
            span.set_status(status)
        span.end(end_time=self.wall_ns(summary.finish_time))

    def abandon(self, span: Any, ts: Optional[float], why: str, attributes: Optional[Mapping[str, Any]] = None) -> None:
        """End a span whose request will never finish (evicted, shutdown), marked as such, with
        ``attributes`` (what is known of it so far)."""
        if attributes:
            span.set_attributes(attributes)
        span.set_attribute("llm.request.incomplete", why)
        span.set_status(self._abandon_status(why))
        span.end(end_time=self.wall_ns(ts) if ts is not None else None)

    def content(self, text: Optional[str]) -> Optional[str]:
        if not self.config.record_content or not isinstance(text, str):
            return None
        return text[: self.config.content_max_length]


class _OpenSpan:
    """An assembled span until it ends. ``events`` is None when the span is not recorded."""

    __slots__ = ("api", "parent", "start_ns", "attributes", "events", "links")

    def __init__(
        self,
        api: trace.Span,
        parent: Optional[SpanContext],
        start_ns: int,
        attributes: Any,
        events: Optional[BoundedList[Event]],
    ) -> None:
        self.api = api  # a NonRecordingSpan with this span's context: what a record() context carries
        self.parent = parent
        self.start_ns = start_ns
        self.attributes = attributes
        self.events = events
        self.links: Optional[BoundedList[trace.Link]] = None  # made at the first link


class AssembledSpans(RequestSpans):
    """Spans of the SDK's TracerProvider, built once at the end (see the module docstring).

    What the SDK's Tracer and Span would do is done here in the same order: parent from the
    carrier (else the current context), trace id from the parent or the id generator, the
    sampler's decision, then the span id; span limits applied (the SDK's attribute cleaning
    only where a limit could change something: a value length limit, or more attributes than
    the limit allows; plain dicts otherwise, which is most of the saving).
    The provider's processors get ``on_end`` with an ordinary ReadableSpan; they are not called
    at the start (nor ``_on_ending``): a processor that mutates live spans sees none.
    """

    def __init__(self, config: TelemetryConfig, tracer: SdkTracer, exemplar_filter: str) -> None:
        super().__init__(config, tracer, exemplar_filter)
        self.tracer: SdkTracer = tracer
        limits = sdk_tracer.span_limits(tracer)
        self._max_events = limits.max_events
        self._max_links = limits.max_links
        self._max_link_attributes = limits.max_link_attributes
        self._max_attributes = limits.max_span_attributes  # None: no limit (SpanLimits.UNSET)
        self._max_event_attributes = limits.max_event_attributes
        # The counts above which an attribute limit could bite: never, where there is none.
        self._attributes_over = self._max_attributes if self._max_attributes is not None else sys.maxsize
        self._event_attributes_over = (
            self._max_event_attributes if self._max_event_attributes is not None else sys.maxsize
        )
        self._span_value_len = limits.max_span_attribute_length
        self._event_value_len = limits.max_attribute_length

    def _api_span(self, span: _OpenSpan) -> trace.Span:
        return span.api

    def start(
        self, request_id: str, ts: float, carrier: Optional[Mapping[str, str]], attributes: Mapping[str, Any]
    ) -> _OpenSpan:
        tracer = self.tracer
        context = _propagator.extract(carrier) if carrier else None
        parent: Optional[SpanContext] = trace.get_current_span(context).get_span_context()
        if not sdk_tracer.is_enabled(tracer):
            return _OpenSpan(NonRecordingSpan(parent or INVALID_SPAN_CONTEXT), None, 0, None, None)
        ids = tracer.id_generator
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = ids.generate_trace_id()
        else:
            trace_id = parent.trace_id
        attributes = self._start_attributes(request_id, attributes)
        sampling = tracer.sampler.should_sample(context, trace_id, self.name, self.kind, attributes, None)
        flags = TraceFlags.SAMPLED if sampling.decision.is_sampled() else TraceFlags.DEFAULT
        flags |= sdk_tracer.random_trace_id_flag(tracer, parent)
        span_context = SpanContext(
            trace_id,
            ids.generate_span_id(),
            is_remote=False,
            trace_flags=TraceFlags(flags),
            trace_state=sampling.trace_state,
        )
        api = NonRecordingSpan(span_context)
        if not sampling.decision.is_recording():
            return _OpenSpan(api, parent, 0, None, None)
        attributes = dict(sampling.attributes or {})
        if self._span_value_len is not None or len(attributes) + _MAX_LATER_ATTRIBUTES > self._attributes_over:
            # A limit could bite: the SDK's own bounded mapping, set in the same order as a live span's.
            attributes = BoundedAttributes(
                self._max_attributes, attributes, immutable=False, max_value_len=self._span_value_len
            )
        return _OpenSpan(api, parent, self.wall_ns(ts), attributes, BoundedList(self._max_events))

    def event(self, span: _OpenSpan, name: str, ts: float, attributes: Mapping[str, Any]) -> None:
        if span.events is None:
            return
        if self._event_value_len is not None or len(attributes) > self._event_attributes_over:
            attributes = BoundedAttributes(
                self._max_event_attributes, attributes, immutable=True, max_value_len=self._event_value_len
            )
        span.events.append(Event(name, attributes, self.wall_ns(ts)))

    def link(self, span: _OpenSpan, target: SpanContext, attributes: Mapping[str, Any]) -> None:
        if span.events is None:
            return
        links = span.links
        if links is None:
            links = span.links = BoundedList(self._max_links)
        # As Span.add_link: the attributes bounded, immutable.
        bounded = BoundedAttributes(
            self._max_link_attributes, attributes, immutable=True, max_value_len=self._event_value_len
        )
        links.append(trace.Link(target, bounded))

    def _emit(self, span: _OpenSpan, events: BoundedList[Event], status: Status, end_ns: int) -> None:
        tracer = self.tracer
        if isinstance(span.attributes, BoundedAttributes):
            sdk_tracer.freeze(span.attributes)
        tracer.span_processor.on_end(
            ReadableSpan(
                self.name,
                span.api.get_span_context(),
                span.parent,
                tracer.resource,
                span.attributes,
                events,
                span.links if span.links is not None else (),
                self.kind,
                tracer.instrumentation_info,
                status,
                span.start_ns,
                end_ns,
                sdk_tracer.instrumentation_scope(tracer),
            )
        )

    def end(self, span: _OpenSpan, summary: RequestSummary, extra: Optional[Mapping[str, Any]] = None) -> None:
        events = span.events
        if events is None:
            return
        span.attributes.update(self._end_attributes(summary, extra))
        if span.links is not None and span.links.dropped:
            span.attributes[LINKS_DROPPED] = span.links.dropped
        self._emit(span, events, self._end_status(summary), self.wall_ns(summary.finish_time))

    def abandon(
        self, span: _OpenSpan, ts: Optional[float], why: str, attributes: Optional[Mapping[str, Any]] = None
    ) -> None:
        events = span.events
        if events is None:
            return
        if attributes:
            span.attributes.update(attributes)
        span.attributes["llm.request.incomplete"] = why
        self._emit(span, events, self._abandon_status(why), self.wall_ns(ts) if ts is not None else time.time_ns())
