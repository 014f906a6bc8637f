"""otel-llm: OpenTelemetry-native instrumentation for LLM serving engines.

Lazy on purpose: ``import otel_llm.events`` (what engines import) must not pull in the
OpenTelemetry SDK. The telemetry API is loaded on first attribute access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from otel_llm.lazy import lazy_attributes
from otel_llm.version import __version__ as __version__

if TYPE_CHECKING:  # the names for type checkers (re-exported); at run time __getattr__ loads them on first use
    from otel_llm.config.settings import TelemetryConfig as TelemetryConfig
    from otel_llm.core.telemetry import EngineTelemetry as EngineTelemetry
    from otel_llm.events import EventType as EventType
    from otel_llm.events import RequestEvent as RequestEvent
    from otel_llm.events import StepStats as StepStats
    from otel_llm.export.handle import TelemetryHandle as TelemetryHandle
    from otel_llm.export.setup import setup_telemetry as setup_telemetry
    from otel_llm.hooks import HookBus as HookBus
    from otel_llm.recording.views import views as views


_LAZY = {
    "EventType": "otel_llm.events",
    "RequestEvent": "otel_llm.events",
    "StepStats": "otel_llm.events",
    "HookBus": "otel_llm.hooks",
    "TelemetryConfig": "otel_llm.config.settings",
    "EngineTelemetry": "otel_llm.core.telemetry",
    "views": "otel_llm.recording.views",
    "setup_telemetry": "otel_llm.export.setup",
    "TelemetryHandle": "otel_llm.export.handle",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
