"""The provider set the vLLM plugin records into: one per process, shared by every stat logger
vLLM builds (one per engine index, or one for all): a handle a program gave
(:func:`use_handle`), else one built from the environment on first use."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any, Sequence

_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs

_handle_lock = threading.Lock()
_handle: Any = None  # otel_llm.export.setup.TelemetryHandle
_handle_owned = False


def use_handle(handle: Any) -> None:
    """Make the vLLM plugin use providers you built (``otel_llm.setup_telemetry(...)``).

    Call before the engine starts (before ``AsyncLLM`` is built). Without it the plugin builds
    its own from the environment on first use: ``setup_telemetry(TelemetryConfig.from_env(...))``.
    """
    global _handle, _handle_owned
    with _handle_lock:
        _handle, _handle_owned = handle, False


def reset() -> None:
    """Forget the process-wide providers (shutting them down if the plugin built them). Tests."""
    global _handle, _handle_owned
    with _handle_lock:
        handle, owned = _handle, _handle_owned
        _handle, _handle_owned = None, False
    if handle is not None and owned:
        try:
            handle.shutdown()
        except Exception:  # noqa: BLE001 - shutdown must not raise into vLLM
            _log.exception("otel-llm: shutting down the telemetry failed")


def get_handle(config: Any, extra_views: Sequence[Any]) -> Any:
    global _handle, _handle_owned
    with _handle_lock:
        if _handle is None:
            _handle, _handle_owned = setup(config, extra_views), True
        return _handle


def setup(config: Any, extra_views: Sequence[Any]) -> Any:
    """setup_telemetry; when the Prometheus port is taken (another process on this host has
    it), the rest without /metrics here: OTLP and traces keep working."""
    from otel_llm import setup_telemetry

    try:
        return setup_telemetry(config, extra_views=extra_views)
    except OSError as exc:
        exporters = config.with_env_defaults(os.environ).metrics_exporters or ()
        others = tuple(e for e in exporters if e != "prometheus") or ("none",)
        _log.warning(
            "otel-llm: no /metrics endpoint in this process (%s; OTEL_LLM_PROMETHEUS_PORTS=N gives each "
            "process on a host a port of its own); metrics exporters %s and traces go on",
            exc,
            ",".join(others),
        )
        return setup_telemetry(dataclasses.replace(config, metrics_exporters=others), extra_views=extra_views)


def current() -> Any:
    """The handle in use (None before the first logger is built, unless use_handle gave one)."""
    return _handle
