"""Helpers for testing an engine's telemetry."""
