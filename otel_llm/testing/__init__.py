"""Helpers for testing an engine's telemetry: an EngineTelemetry on in-memory providers built
with otel_llm's Views (:func:`in_memory_telemetry`), readers for its metrics, spans and
preemption events, synthetic request events (:func:`lifecycle`); ``otel_llm.testing.plugin``,
the pytest plugin (fixtures); ``otel_llm.testing.cost``, what the telemetry costs an engine.
See docs/testing.md.

Lazy like ``otel_llm``: the pytest plugin imports this package at every pytest start-up, and
must not pull in the OpenTelemetry SDK there. A name is loaded on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from otel_llm.lazy import lazy_attributes

if TYPE_CHECKING:
    from otel_llm.testing.in_memory import InMemoryTelemetry, in_memory_telemetry
    from otel_llm.testing.read import (
        Histogram,
        MetricsSnapshot,
        Preemption,
        collect_metrics,
        log_preemptions,
        span_preemptions,
        spans_by_request,
    )
    from otel_llm.testing.synthetic import lifecycle

_LAZY = {
    "InMemoryTelemetry": "otel_llm.testing.in_memory",
    "in_memory_telemetry": "otel_llm.testing.in_memory",
    "Histogram": "otel_llm.testing.read",
    "MetricsSnapshot": "otel_llm.testing.read",
    "Preemption": "otel_llm.testing.read",
    "collect_metrics": "otel_llm.testing.read",
    "log_preemptions": "otel_llm.testing.read",
    "span_preemptions": "otel_llm.testing.read",
    "spans_by_request": "otel_llm.testing.read",
    "lifecycle": "otel_llm.testing.synthetic",
}

__all__ = [
    "Histogram",
    "InMemoryTelemetry",
    "MetricsSnapshot",
    "Preemption",
    "collect_metrics",
    "in_memory_telemetry",
    "lifecycle",
    "log_preemptions",
    "span_preemptions",
    "spans_by_request",
]

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
