"""Replace mode (the default; ``OTEL_LLM_VLLM_METRICS=add`` turns it off): otel-llm as vLLM's
metrics layer.

vLLM's ``StatLoggerManager`` builds its own ``PrometheusStatLogger`` unless one of the custom
stat loggers already is one (``isinstance``). In replace mode the plugin's class derives from
it without running its constructor, so vLLM builds none and nothing records twice; the
plugin's metrics are then answered at vLLM's own ``/metrics`` route, which serves
prometheus_client's global ``REGISTRY``: :class:`VllmFacingReader` registers there a
collector of the plugin's MeterProvider with vLLM's HELP text per family. Content negotiation
(text, OpenMetrics) and the route itself stay vLLM's.

It is the default because it is the cheaper mode: vLLM's own logger is not built, so nothing is
recorded twice (in add mode, with a tenant source, every token's latencies would be).

Where the plugin cannot stand in for vLLM's logger, :func:`obstacle` says why, and the plugin
runs as in ``add`` mode (vLLM's own logger built by the plugin, one line at start: a warning
when replace mode was asked for by name, else an info line): a vLLM
whose ``StatLoggerManager`` does not decide on its own logger that way (checked by structure,
:func:`structure_obstacle`), several API servers (vLLM then serves the sum of every
process's files through ``PROMETHEUS_MULTIPROC_DIR``, which this does not write), the
``semconv`` naming profile (not vLLM's names), providers given with ``use_handle`` (the reader
must be on the MeterProvider when it is built), or vLLM's series beyond the core unavailable.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Mapping, Optional

from prometheus_client import CollectorRegistry
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.samples import Sample

from otel_llm._sdk import prometheus_exporter as sdk_prometheus
from otel_llm.config.settings import from_environment
from otel_llm.export.prometheus import ExemplarPrometheusMetricReader

_log = logging.getLogger(__name__)

ENV = "OTEL_LLM_VLLM_METRICS"
MODES = ("add", "replace")


def mode(environ: Mapping[str, str] = os.environ) -> str:
    """``replace`` (default) or ``add``; another value raises ValueError naming the variable."""
    return from_environment(ENV, environ) or "replace"


def requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Replace mode in effect, by default or by name (a bad value is reported where the plugin starts)."""
    try:
        return mode(environ) == "replace"
    except ValueError:
        return False


def named(environ: Mapping[str, str] = os.environ) -> bool:
    """Replace mode asked for by name, not by default: where it cannot run, that is a failure to report."""
    return from_environment(ENV, environ) == "replace"


def structure_obstacle() -> Optional[str]:
    """Why this vLLM's StatLoggerManager may not be relied on to leave its own logger out, or None.
    The rule relied on: its constructor sets a local ``custom_prometheus_logger`` when a custom
    stat logger ``isinstance`` of ``PrometheusStatLogger``, and builds its own only otherwise."""
    try:
        from vllm.v1.metrics.loggers import StatLoggerManager
    except Exception as exc:  # noqa: BLE001 - any import failure: nothing to replace
        return f"vLLM's StatLoggerManager is not importable ({exc!r})"
    code = getattr(StatLoggerManager.__init__, "__code__", None)
    if (
        code is None
        or "custom_prometheus_logger" not in code.co_varnames
        or not {"isinstance", "PrometheusStatLogger"} <= set(code.co_names)
    ):
        return (
            "vLLM's StatLoggerManager.__init__ does not leave its PrometheusStatLogger out for a custom one "
            "(no local custom_prometheus_logger set by isinstance)"
        )
    return None


def obstacle(
    vllm_config: Any, naming: str, handle_given: bool, environ: Mapping[str, str] = os.environ
) -> Optional[str]:
    """Why the plugin cannot stand in for vLLM's own logger here, or None."""
    count = getattr(getattr(vllm_config, "parallel_config", None), "_api_process_count", 1)
    if environ.get("PROMETHEUS_MULTIPROC_DIR") or (isinstance(count, int) and count > 1):
        return "with several API servers vLLM's /metrics sums every process's files, which the plugin does not write"
    if naming != "vllm":
        return f"OTEL_LLM_NAMING={naming} does not give vLLM's metric names"
    if handle_given:
        return "the providers were built before (use_handle) without a reader for vLLM's /metrics"
    return structure_obstacle()


class _VllmFamilies:
    """The reader's collector as vLLM's registry sees it: vLLM's families only (the plugin's
    others go out over OTLP and on its own endpoint), with vLLM's HELP text and, as
    prometheus_client's own counters and histograms have, a ``_created`` series per labelled
    series (unless prometheus_client's created series are disabled); one collection at a time
    (the upstream collector hands data over through a deque); never an exception into the scrape
    (vLLM's route would answer 500): what exists is served."""

    def __init__(self, inner: Any, documentation: Mapping[str, str]) -> None:
        self._inner = inner
        self._documentation = dict(documentation)
        self._created = time.time()
        self._lock = threading.Lock()
        self._failed = False

    def describe(self) -> list[Any]:
        return []  # registered before its MeterProvider exists: no collection to learn names from

    def collect(self) -> list[Any]:
        try:
            with self._lock:
                families = [f for f in self._inner.collect() if f.name in self._documentation]
        except Exception:  # noqa: BLE001 - a scrape during start-up or shutdown gets what exists
            if not self._failed:
                self._failed = True
                _log.exception("otel-llm vLLM adapter: collecting for vLLM's /metrics failed (reported once)")
            return []
        created = getattr(prometheus_metrics, "_use_created", True)
        for family in families:
            family.documentation = self._documentation[family.name]
            if created and family.type in ("counter", "histogram"):
                labelled = {tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")) for s in family.samples}
                family.samples += [Sample(f"{family.name}_created", dict(k), self._created) for k in sorted(labelled)]
        return families


class VllmFacingReader(ExemplarPrometheusMetricReader):
    """A MetricReader that ``registry`` (prometheus_client's global REGISTRY: vLLM's /metrics)
    collects, with vLLM's HELP text per family (``documentation``: family name -> text); out of
    the registry again at shutdown."""

    def __init__(self, registry: CollectorRegistry, documentation: Mapping[str, str]) -> None:
        # The reader's own collector goes into a registry nobody serves; vLLM's serves ours.
        super().__init__(CollectorRegistry(auto_describe=False), disable_target_info=True)
        self._facing = _VllmFamilies(sdk_prometheus.collector(self), documentation)
        self._vllm_registry = registry
        registry.register(self._facing)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        try:
            self._vllm_registry.unregister(self._facing)
        except KeyError:
            pass  # already out
        super().shutdown(timeout_millis=timeout_millis, **kwargs)


def report_fallback(reason: str, environ: Mapping[str, str] = os.environ) -> None:
    """One line at start: a warning where replace mode was asked for by name, else (the default) an info line."""
    if named(environ):
        _log.warning("otel-llm vLLM adapter: %s=replace runs as add: %s", ENV, reason)
    else:
        _log.info("otel-llm vLLM adapter: vLLM's own Prometheus logger serves its /metrics (add mode): %s", reason)
