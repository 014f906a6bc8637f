"""Configuration: :class:`TelemetryConfig` (settings), bucket boundaries, label bounds."""

from otel_llm.config.settings import TelemetryConfig

__all__ = ["TelemetryConfig"]
