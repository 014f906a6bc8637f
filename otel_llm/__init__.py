"""otel-llm: OpenTelemetry-native instrumentation for LLM serving engines.

Lazy on purpose: ``import otel_llm.events`` (what engines import) must not pull in the
OpenTelemetry SDK. The telemetry API is loaded on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "EventType": "otel_llm.events",
    "RequestEvent": "otel_llm.events",
    "StepStats": "otel_llm.events",
    "HookBus": "otel_llm.hooks",
    "TelemetryConfig": "otel_llm.config",
    "EngineTelemetry": "otel_llm.telemetry",
    "views": "otel_llm.metric_views",
    "setup_telemetry": "otel_llm.providers",
    "TelemetryHandle": "otel_llm.providers",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'otel_llm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
