"""OpenTelemetry instrumentation of Hugging Face transformers' continuous batching.

``TransformersInstrumentor().instrument()`` (or ``opentelemetry-instrument``, through the
``opentelemetry_instrumentor`` entry point ``otel_llm_transformers``) wraps the continuous-batching
internals listed in :mod:`.internals` and feeds every request's lifecycle into otel-llm's
:class:`~otel_llm.EngineTelemetry`. Importing this package imports neither transformers nor torch.
See docs/transformers.md.
"""

from __future__ import annotations

from otel_llm.integrations.transformers.instrumentor import TransformersInstrumentor

__all__ = ["TransformersInstrumentor"]
