"""The provider set the vLLM plugin records into: one per process, shared by every stat logger
vLLM builds (one per engine index, or one for all): a handle a program gave
(:func:`use_handle`), else one built from the environment on first use."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs
ENTRY_POINT = "vllm"  # its tenant sources: otel_llm.config.tenants.SOURCES_BY_ENTRY_POINT

_handle_lock = threading.Lock()
_handle: Any = None  # otel_llm.export.setup.TelemetryHandle
_handle_owned = False
_answers_vllm = False  # built with the reader that answers vLLM's /metrics (replace mode)


def use_handle(handle: Any) -> None:
    """Make the vLLM plugin use providers you built (``otel_llm.setup_telemetry(...)``).

    Call before the engine starts (before ``AsyncLLM`` is built). Without it the plugin builds
    its own from the environment on first use: ``setup_telemetry(TelemetryConfig.from_env(...))``.
    """
    global _handle, _handle_owned, _answers_vllm
    with _handle_lock:
        _handle, _handle_owned, _answers_vllm = handle, False, False


def reset() -> None:
    """Forget the process-wide providers (shutting them down if the plugin built them). Tests."""
    global _handle, _handle_owned, _answers_vllm
    with _handle_lock:
        handle, owned = _handle, _handle_owned
        _handle, _handle_owned, _answers_vllm = None, False, False
    if handle is not None and owned:
        try:
            handle.shutdown()
        except Exception:  # noqa: BLE001 - shutdown must not raise into vLLM
            _log.exception("otel-llm: shutting down the telemetry failed")


def get_handle(config: Any, extra_views: Sequence[Any], extra_readers: Callable[[], Sequence[Any]] = tuple) -> Any:
    """The process's handle, built on first use with ``extra_views`` and the readers that
    ``extra_readers`` makes (called only then)."""
    global _handle, _handle_owned, _answers_vllm
    with _handle_lock:
        if _handle is None:
            readers = extra_readers()
            _handle, _handle_owned = setup(config, extra_views, readers), True
            _answers_vllm = bool(readers)
        return _handle


def setup(config: Any, extra_views: Sequence[Any], extra_readers: Sequence[Any] = ()) -> Any:
    """setup_telemetry as every entry point calls it: a Prometheus port that another process on
    this host holds leaves this process without /metrics, its OTLP metrics and traces on."""
    from otel_llm.config.tenants import SOURCES_BY_ENTRY_POINT
    from otel_llm.export.setup import setup_telemetry

    return setup_telemetry(
        config,
        extra_views=extra_views,
        extra_metric_readers=extra_readers,
        port_taken="warn",
        tenant_sources=SOURCES_BY_ENTRY_POINT[ENTRY_POINT],
        entry_point=ENTRY_POINT,
    )


def current() -> Any:
    """The handle in use (None before the first logger is built, unless use_handle gave one)."""
    return _handle


def owned() -> bool:
    """The handle in use was built here: nothing but this plugin records into its providers."""
    return _handle_owned


def answers_vllm() -> bool:
    """The handle in use was built with the reader that answers vLLM's /metrics."""
    return _answers_vllm
