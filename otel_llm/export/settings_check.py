"""check_settings(): every ``OTEL_*`` / ``OTEL_LLM_*`` value the plugin reads, checked at once.

Every entry point calls it before it builds anything, so that a bad value is met in one place
and said in one line (the variable, the value, what is allowed): the ``otel-llm`` command exits
2 with that line; an engine plugin says it once as a warning and leaves its telemetry off, since
nothing may raise into the engine.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping, Optional

from otel_llm.config.settings import ENTRY_POINT_VARIABLES, TelemetryConfig, from_environment
from otel_llm.export import env_checks, otlp

# Every signal's OTLP settings are checked, used or not: an entry point may turn on a signal
# that the environment's exporters leave off (the demo sends traces when an endpoint is set).
_SIGNALS = ("metrics", "traces", "logs")


def check_settings(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """None when every setting in ``environ`` (default ``os.environ``) is valid, else one line
    naming the first bad variable, its value and what is allowed."""
    env = os.environ if environ is None else environ
    try:
        config = TelemetryConfig.from_env(env)
        for var in ENTRY_POINT_VARIABLES:
            from_environment(var, env)
        protocols = {signal: otlp.protocol(config, env, signal) for signal in _SIGNALS}
        for signal, protocol in protocols.items():
            otlp.endpoint(config, env, signal, protocol)
        env_checks.check(env, protocols)
    except ValueError as exc:
        return str(exc)
    return None


def refused(log: logging.Logger, part: str, goes_on: str) -> bool:
    """True when a setting is bad: ``part`` (e.g. "vLLM adapter") then stays off, and says so in
    one warning, with what goes on without it."""
    problem = check_settings()
    if problem is not None:
        log.warning("otel-llm %s: telemetry disabled, %s: %s", part, goes_on, problem)
    return problem is not None
