"""The OpenTelemetry SDK's private names that otel_llm relies on, all of them, one small module
per thing wrapped. Each module has a contract check, ``check()``, that verifies on the installed
SDK that its names exist with the shape relied on (signatures, attributes) and raises
:class:`ContractError` naming what did not hold.

Where a contract does not hold, the telemetry takes the public path for that part: slower, same
numbers. :func:`holds` answers per contract; the first call checks them all and logs one
warning naming every contract that did not hold and what the telemetry does instead.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Optional, Sequence

_log = logging.getLogger("otel_llm")


class ContractError(Exception):
    """A private SDK name is missing, or no longer has the shape otel_llm relies on."""


def require(condition: Any, what: str) -> None:
    """Raise ContractError(``what``) unless ``condition``: ``what`` says what should hold."""
    if not condition:
        raise ContractError(what)


def require_parameters(func: Optional[Callable[..., Any]], expected: Sequence[str], what: str) -> None:
    """``func``'s parameters, ``self`` aside, start with ``expected`` (in order)."""
    require(callable(func), f"{what} exists")
    params = [p for p in inspect.signature(func).parameters if p != "self"]  # type: ignore[arg-type]  # callable() was required just above
    require(
        params[: len(expected)] == list(expected),
        f"{what} takes ({', '.join(expected)}, ...); found ({', '.join(params)})",
    )


# Contract name -> (module of this package, its check function, what the telemetry does when the
# contract does not hold).
CONTRACTS: dict[str, tuple[str, str, str]] = {
    "aggregation": (
        "histogram_aggregations",
        "check",
        "metrics are recorded through the SDK's instruments (one record() or add() per observation)",
    ),
    "exponential_mapping": (
        "exponential_mapping",
        "check",
        "with exponential histograms, metrics are recorded through the SDK's instruments",
    ),
    "views": (
        "provider_views",
        "check",
        "a MeterProvider's Views cannot be read: metrics are recorded through the SDK's "
        "instruments; the OTLP reader cannot have Views of its own",
    ),
    "tracer": ("tracer", "check", "request spans go through the Tracer API (live spans)"),
    "batch_processor": (
        "batch_processor",
        "check",
        "spans and log records that a batch processor drops (queue "
        "full, after shutdown) are not counted on otel_llm.dropped_events",
    ),
    "metric_exporter": ("metric_exporter", "check", "OTLP metric exports are neither counted nor backed off"),
    "otlp_exporters": ("otlp_exporters", "check", "OTLP metrics are encoded by the SDK's encoder"),
    "prometheus": (
        "prometheus_exporter",
        "check",
        "the Prometheus endpoint renders through the exporter's own collector: "
        "no exemplars, le as the exporter writes it",
    ),
    "prometheus_collector": ("prometheus_exporter", "check_collector", "no Prometheus endpoint"),
    "log_events": ("logs", "check", "no preemption log events (the span events stay)"),
}

_lock = threading.Lock()
_unmet: Optional[dict[str, str]] = None


def unmet() -> dict[str, str]:
    """Contract name -> what did not hold, for every contract that does not hold on the installed
    SDK. Checked once per process; the first call logs one warning if any does not hold."""
    global _unmet
    with _lock:
        if _unmet is None:
            found: dict[str, str] = {}
            for name, (module, function, _) in CONTRACTS.items():
                try:
                    getattr(importlib.import_module(f"{__name__}.{module}"), function)()
                except Exception as exc:  # noqa: BLE001 - any failure means the contract does not hold
                    found[name] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ContractError) else str(exc)
            _unmet = found
            if found:
                _log.warning(
                    "otel_llm: the installed OpenTelemetry SDK (%s) does not meet what otel_llm's fast "
                    "paths rely on; the public paths are used instead:\n%s",
                    sdk_versions(),
                    "\n".join(f"- {name}: {what} -> {CONTRACTS[name][2]}" for name, what in found.items()),
                )
        return _unmet


def holds(name: str) -> bool:
    return name not in unmet()


def in_process_metrics(exponential: bool) -> bool:
    """Whether the in-process aggregation can be used: its contracts hold (with exponential
    histograms, that of the exponential mapping too)."""
    return holds("aggregation") and holds("views") and (not exponential or holds("exponential_mapping"))


def sdk_versions() -> str:
    found = []
    for dist in ("opentelemetry-sdk", "opentelemetry-exporter-prometheus"):
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            found.append(f"{dist} not installed")
    return ", ".join(found)
