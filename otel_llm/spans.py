"""Request spans: one ``llm_request`` span per request, span events at each preemption.

Times come from the engine's monotonic clock; one offset, taken once, converts them to the
wall clock that spans need. Span attributes are set in one call at the end (one lock
acquisition in the SDK instead of one per attribute).
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from . import __version__
from .aggregation import ExemplarIds
from .config import TelemetryConfig
from .tracker import RequestSummary

SPAN_NAME = "llm_request"
_propagator = TraceContextTextMapPropagator()


class RequestSpans:
    def __init__(self, config: TelemetryConfig, tracer_provider: Optional[TracerProvider],
                 exemplar_filter: str) -> None:
        self.config = config
        self.tracer = trace.get_tracer("otel_llm", __version__, tracer_provider=tracer_provider)
        self._exemplar_filter = exemplar_filter
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._model = config.model_name

    def wall_ns(self, monotonic_seconds: float) -> int:
        return int(monotonic_seconds * 1e9) + self._offset_ns

    def start(self, request_id: str, ts: float, carrier: Optional[Mapping[str, str]],
              attributes: Mapping[str, Any]) -> Any:
        parent = _propagator.extract(carrier) if carrier else None
        return self.tracer.start_span(
            SPAN_NAME,
            context=parent,
            kind=SpanKind.SERVER,
            start_time=self.wall_ns(ts),
            attributes={"gen_ai.request.id": request_id, "gen_ai.request.model": self._model, **attributes},
        )

    def exemplar(self, span: Any) -> tuple[Optional[ExemplarIds], Any]:
        """Exemplar ids for observations of this request, and the context to record with.

        Mirrors the SDK's exemplar filters so that in-process histograms and SDK histograms
        attach the same exemplars.
        """
        if self._exemplar_filter == "always_off":
            return None, None
        ctx = trace.set_span_in_context(span) if span is not None else None
        sc = span.get_span_context() if span is not None else None
        if sc is not None and sc.is_valid and sc.trace_flags.sampled:
            return (sc.trace_id, sc.span_id), ctx
        if self._exemplar_filter == "always_on":
            return (None, None), ctx
        return None, ctx

    def event(self, span: Any, name: str, ts: float, attributes: Mapping[str, Any]) -> None:
        span.add_event(name, attributes, timestamp=self.wall_ns(ts))

    def end(self, span: Any, summary: RequestSummary, extra: Optional[Mapping[str, Any]] = None) -> None:
        attributes: dict[str, Any] = {
            "gen_ai.usage.input_tokens": summary.prompt_tokens,
            "gen_ai.usage.output_tokens": summary.generation_tokens,
            "gen_ai.response.finish_reasons": (summary.finish_reason,),
            "llm.request.num_preemptions": summary.num_preemptions,
            "llm.request.recomputed_tokens": summary.recomputed_tokens,
            "llm.request.e2e_latency": summary.e2e,
        }
        if summary.max_tokens > 0:
            attributes["gen_ai.request.max_tokens"] = summary.max_tokens
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
        span.set_attributes(attributes)
        if summary.finish_reason == "error":
            span.set_status(Status(StatusCode.ERROR, "finish_reason=error"))
        span.end(end_time=self.wall_ns(summary.finish_time))

    def abandon(self, span: Any, ts: Optional[float], why: str) -> None:
        """End a span whose request will never finish (evicted, shutdown), marked as such."""
        span.set_attribute("llm.request.incomplete", why)
        span.set_status(Status(StatusCode.ERROR, f"request span ended by telemetry: {why}"))
        span.end(end_time=self.wall_ns(ts) if ts is not None else None)

    def content(self, text: Optional[str]) -> Optional[str]:
        if not self.config.record_content or not isinstance(text, str):
            return None
        return text[: self.config.content_max_length]
