"""Every other series of vLLM's Prometheus logger, through OpenTelemetry: :class:`VllmSeries`.

The core telemetry (:mod:`otel_llm.catalogue.metrics`) reproduces vLLM's request, token, latency and
preemption metrics with its own logic (exemplars, spans, the never-preempted bucket). vLLM
exports many more: prefix and multi-modal cache counters, prompt tokens by source, waiting
requests by reason, ``cache_config_info``, sleep state, admission rejections, estimated FLOPs
and bytes, and, when the feature is on, speculative decoding, KV connector, LoRA and KV block
metrics. Those are reproduced here *by vLLM's own code*: vLLM's ``PrometheusStatLogger`` built
on recording families of our own (:mod:`~otel_llm.integrations.vllm.series.recording_logger`), so
the families it declares are vLLM's for whatever vLLM version and settings are running.

Families that the core telemetry already exports (``vllm:`` names of :data:`otel_llm.catalogue.metrics.METRICS`)
are left to it: here they record nothing (beside vLLM's logger, the adapter has those of each step
read from vLLM's registry by :meth:`VllmSeries.read` too). The rest are OpenTelemetry observable
instruments (:mod:`~otel_llm.integrations.vllm.series.series_instruments`), renamed to vLLM's ``vllm:``
names by Views, which must exist when the MeterProvider is built:
``setup_telemetry(config, extra_views=series.views())`` (the plugin does this itself). In the
``semconv`` naming profile the names are ``vllm.<name>`` and the ``model_name``/``engine``
labels are ``gen_ai.request.model``/``llm.engine``.

Beside vLLM's own logger (``add`` mode) that code need not run twice: vLLM's logger records
every one of these series into prometheus_client's registry anyway, so after
:meth:`VllmSeries.read_from` the instruments read them there at collection time
(:mod:`~otel_llm.integrations.vllm.series.registry_reader`), and nothing here runs per engine step.
Where vLLM's logger is not built (``replace`` mode), or where the API servers share the
scheduler gauges, vLLM's code runs here, on :attr:`VllmSeries.logger`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Optional, Sequence

from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics.view import View

from otel_llm.integrations.vllm.series import series_instruments
from otel_llm.integrations.vllm.series.families import Family
from otel_llm.integrations.vllm.series.recording_logger import build_logger
from otel_llm.integrations.vllm.series.registry_reader import RegistryReader

__all__ = ["VllmSeries"]

_SEMCONV_LABELS = {"model_name": "gen_ai.request.model", "engine": "llm.engine"}
_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs


class VllmSeries:
    """vLLM's ``PrometheusStatLogger`` recording into OpenTelemetry (see the module docstring).

    ``record``, ``record_sleep_state``, ``record_admission_rejection`` and
    ``log_engine_initialized`` are vLLM's own methods; :meth:`bind` creates the instruments on
    a MeterProvider built with :meth:`views`.
    """

    def __init__(self, vllm_config: Any, engine_indexes: Sequence[int], naming: str = "vllm") -> None:
        self.naming = naming
        self.families: dict[str, Family] = {}
        # Where vLLM's own logger records these series, read at collection (read_from); None:
        # recorded here by ``logger``.
        self.reader: Optional[RegistryReader] = None
        self._failed: set[str] = set()  # logger methods whose failure was reported
        # Families recorded but not exported by this process: another process reports them.
        self.withheld: set[str] = set()
        self.logger = build_logger(self, vllm_config, list(engine_indexes))
        # The info gauge (cache_config_info) is created when the engine reports it is up, after
        # the providers exist: declared now so that its View exists, exported from vLLM's call on.
        before = set(self.families)
        self.logger.log_engine_initialized()
        for name in set(self.families) - before:
            self.families[name].children.clear()

    @property
    def source(self) -> Optional[Any]:
        """The prometheus_client registry these series are read from (None: recorded here)."""
        return self.reader.registry if self.reader is not None else None

    def run(self, method: str, *args: Any, **kwargs: Any) -> None:
        """One of vLLM's own logger methods on :attr:`logger` (none when the series are read
        from vLLM's own logger); a failure is reported once and leaves the rest untouched."""
        if self.reader is not None:
            return
        try:
            getattr(self.logger, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - vLLM's own logger code must not break the telemetry's hook
            if method not in self._failed:
                self._failed.add(method)
                _log.warning(
                    "otel-llm vLLM adapter: vLLM's PrometheusStatLogger.%s failed (%r): vLLM's series beyond "
                    "the core metrics may be incomplete (reported once)",
                    method,
                    exc,
                )

    def read_from(self, registry: Any) -> None:
        """Export the values vLLM's own logger holds in ``registry`` (prometheus_client's global
        ``REGISTRY``, where vLLM's metrics register) instead of recording them here: from now on
        nobody calls ``logger``'s methods."""
        self.reader = RegistryReader(registry)

    def read(self, family: Family) -> Iterator[Observation]:
        """The observations of ``family`` as vLLM's logger holds them in :attr:`source`
        (:meth:`RegistryReader.read <otel_llm.integrations.vllm.series.registry_reader.RegistryReader.read>`)."""
        assert self.reader is not None
        return self.reader.read(family)

    def otel_labels(self, labelnames: tuple[str, ...]) -> tuple[str, ...]:
        if self.naming == "vllm":
            return labelnames
        return tuple(_SEMCONV_LABELS.get(n, n) for n in labelnames)

    def add(self, family: Family) -> None:
        # The same name twice (vLLM re-creating an info gauge): the latest family is the one in use.
        self.families[family.name] = family

    def views(self) -> list[View]:
        """Renames (``vllm:`` names) and histogram buckets for every family recorded here."""
        return series_instruments.views(self)

    def bind(self, meter_provider: Any, available: Callable[[str], bool] = lambda _name: True) -> list[str]:
        """Export the families that ``available`` says have their Views on ``meter_provider``
        (the latest series bound to a provider is the one its instruments read). Returns the
        names of the families left out."""
        return series_instruments.bind(self, meter_provider, available)
