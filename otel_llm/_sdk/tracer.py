"""What spans.AssembledSpans reads from the SDK's Tracer to build spans as its start_span and
Span.end would: span limits, instrumentation scope, enabled flag; and how a bounded attribute
mapping is frozen at the end."""

from __future__ import annotations

from typing import Any, Optional

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import SpanLimits, Tracer, TracerProvider
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, TraceFlags

from otel_llm._sdk import require

# Trace flag for a trace id known to be random (W3C Trace Context level 2); SDKs before 1.42 set none.
_RANDOM_TRACE_ID: int = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)


def span_limits(tracer: Tracer) -> SpanLimits:
    return tracer._span_limits


def instrumentation_scope(tracer: Tracer) -> InstrumentationScope:
    return tracer._instrumentation_scope


def is_enabled(tracer: Tracer) -> bool:
    """False when a tracer configurator disabled this tracer; SDKs before 1.40 have none."""
    enabled = getattr(tracer, "_is_enabled", None)
    return enabled() if enabled is not None else True


def random_trace_id_flag(tracer: Tracer, parent: Optional[SpanContext]) -> int:
    """The flag start_span adds for a random trace id (0 where the SDK has no such flag)."""
    if not _RANDOM_TRACE_ID:
        return 0
    random = parent.trace_flags.random_trace_id if parent is not None else tracer.id_generator.is_trace_id_random()
    return _RANDOM_TRACE_ID if random else 0


def freeze(attributes: BoundedAttributes) -> None:
    """As Span.end does with a span's attributes."""
    attributes._immutable = True


def check() -> None:
    tracer: Any = TracerProvider().get_tracer("otel_llm.contract")
    require(isinstance(tracer, Tracer), "TracerProvider.get_tracer returns an SDK Tracer")
    require(isinstance(getattr(tracer, "_span_limits", None), SpanLimits), "Tracer._span_limits is a SpanLimits")
    require(
        isinstance(getattr(tracer, "_instrumentation_scope", None), InstrumentationScope),
        "Tracer._instrumentation_scope is an InstrumentationScope",
    )
    enabled = getattr(tracer, "_is_enabled", None)
    require(enabled is None or enabled() is True, "Tracer._is_enabled() is a bool, or absent (no tracer configurator)")
    if _RANDOM_TRACE_ID:
        require(
            callable(getattr(tracer.id_generator, "is_trace_id_random", None)),
            "IdGenerator.is_trace_id_random exists where TraceFlags.RANDOM_TRACE_ID does",
        )
    attributes = BoundedAttributes(4, {"a": 1}, immutable=False)
    require(getattr(attributes, "_immutable", None) is False, "BoundedAttributes._immutable")
    freeze(attributes)
    try:
        attributes["b"] = 2
        frozen = False
    except TypeError:
        frozen = True
    require(frozen, "BoundedAttributes._immutable = True makes it refuse writes")
