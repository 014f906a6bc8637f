"""The request core: per-request state (tracker), what a request becomes (sink), and
:class:`~otel_llm.core.telemetry.EngineTelemetry`, the subscriber engines publish to."""
