"""engine_stub plugin: registered as entry point ``otel`` in group ``engine_stub.plugins``.

engine_stub calls ``register(engine)`` at start-up, so installing otel-llm instruments the engine
with no code change; the telemetry is configured from the environment (``OTEL_*``,
``OTEL_LLM_*``). Code that wants its own settings calls ``register`` itself with a config.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from otel_llm.config.settings import TelemetryConfig
from otel_llm.config.tenants import SOURCES_BY_ENTRY_POINT
from otel_llm.export.handle import TelemetryHandle
from otel_llm.export.settings_check import refused
from otel_llm.export.setup import setup_telemetry

_log = logging.getLogger(__name__)

MODEL_NAME = "engine_stub-tiny"  # the model_name label unless OTEL_LLM_MODEL_NAME says otherwise
PROVIDER_NAME = "engine_stub"  # gen_ai.provider.name unless OTEL_LLM_PROVIDER_NAME says otherwise
ENTRY_POINT = "engine_stub"  # its tenant sources: otel_llm.config.tenants.SOURCES_BY_ENTRY_POINT


def register(engine: Any, config: Optional[TelemetryConfig] = None, **setup_kwargs: Any) -> TelemetryHandle:
    """Build the telemetry and subscribe it to ``engine.hooks``.

    The handle is kept as ``engine.telemetry_handle``: ``engine.telemetry_handle.shutdown()``
    flushes and stops exporters and the Prometheus endpoint. ``setup_kwargs`` go to
    :func:`otel_llm.setup_telemetry` (e.g. ``extra_metric_readers``). A Prometheus port that
    another process holds leaves this process without /metrics (one warning line), its OTLP
    metrics and traces on, as every entry point does. Configured from the environment, a bad
    setting leaves the telemetry off with one warning naming it, and the engine runs.
    """
    if config is None:
        if refused(_log, "engine_stub plugin", "the engine runs on"):
            # No-op providers and no subscription: the engine's hook bus stays empty.
            handle = setup_telemetry(TelemetryConfig(model_name=MODEL_NAME, sdk_disabled=True), environ={})
            engine.telemetry_handle = handle
            return handle
        # The provider name tells engine_stub apart in a fleet of engines.
        config = TelemetryConfig.from_env(defaults={"model_name": MODEL_NAME, "provider_name": PROVIDER_NAME})
    sources = {"entry_point": ENTRY_POINT, "tenant_sources": SOURCES_BY_ENTRY_POINT[ENTRY_POINT]}
    handle = setup_telemetry(config, **{"port_taken": "warn", **sources, **setup_kwargs})
    engine.hooks.subscribe(handle.telemetry)
    engine.telemetry_handle = handle
    return handle
