"""otel-llm: OpenTelemetry-native instrumentation for LLM serving engines.

Lazy on purpose: ``import otel_llm.events`` (what engines import) must not pull in the
OpenTelemetry SDK. The telemetry API is loaded on first attribute access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from otel_llm.lazy import lazy_attributes

if TYPE_CHECKING:  # the names for type checkers (re-exported); at run time __getattr__ loads them on first use
    from .config import TelemetryConfig as TelemetryConfig
    from .events import EventType as EventType
    from .events import RequestEvent as RequestEvent
    from .events import StepStats as StepStats
    from .hooks import HookBus as HookBus
    from .metric_views import views as views
    from .providers import TelemetryHandle as TelemetryHandle
    from .providers import setup_telemetry as setup_telemetry
    from .telemetry import EngineTelemetry as EngineTelemetry

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

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
