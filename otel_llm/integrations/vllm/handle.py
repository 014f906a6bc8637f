"""The provider set the vLLM plugin records into: one per process, shared by every stat logger
vLLM builds (one per engine index, or one for all): a handle a program gave
(:func:`use_handle`), else one built from the environment on first use."""

from __future__ import annotations

import logging
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
    """setup_telemetry as every entry point calls it: a Prometheus port that another process on
    this host holds leaves this process without /metrics, its OTLP metrics and traces on."""
    from otel_llm.export.setup import setup_telemetry

    return setup_telemetry(config, extra_views=extra_views, port_taken="warn")


def current() -> Any:
    """The handle in use (None before the first logger is built, unless use_handle gave one)."""
    return _handle
