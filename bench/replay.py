"""What the per-event sections replay, and the config they replay it under."""

from __future__ import annotations

from typing import Any

from otel_llm.config.settings import DEFAULT_DEFER_STEPS, TelemetryConfig

# defer_steps as setup_telemetry sets it: the engine plugins' path.
CONFIG = TelemetryConfig(model_name="bench", spans=False, defer_steps=DEFAULT_DEFER_STEPS)


def replay(sub: Any, steps: list) -> None:
    target = getattr(sub, "telemetry", sub)  # the EngineTelemetry itself, as a hook bus would call it
    on_events, on_step = target.on_events, target.on_step
    for events, stats in steps:
        on_events(events)
        on_step(stats)
