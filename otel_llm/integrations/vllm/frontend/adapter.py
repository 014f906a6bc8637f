"""The vLLM adapter: vLLM's ``SchedulerStats`` and ``IterationStats``, per engine step, handed to
the core telemetry (one :class:`~otel_llm.core.telemetry.EngineTelemetry` per engine index),
and vLLM's own series beyond the core (:mod:`otel_llm.integrations.vllm.series.series`).

What it records and how is decided once, at start (:mod:`.plan`); each engine step is then kept
as a :class:`~otel_llm.integrations.vllm.frontend.step_translator.VllmStep` by that engine's telemetry and
translated with the steps kept beside it (:mod:`.translate`). Independent of vLLM's base
classes, so it is testable without vLLM; :mod:`otel_llm.integrations.vllm.frontend.stat_logger` is the
shell vLLM loads.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import sys
import threading
import time
from typing import Any, Iterable, Optional

from otel_llm.catalogue import drops
from otel_llm.catalogue.metrics import METRICS
from otel_llm.config import tenants
from otel_llm.core.telemetry import EngineTelemetry
from otel_llm.integrations.vllm.frontend import attribution, tenant_steps, traces
from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook
from otel_llm.integrations.vllm.frontend.step_translator import StepTranslator, VllmStep
from otel_llm.integrations.vllm.plan import make_plan, read_step_series
from otel_llm.integrations.vllm.translation.enums import FINISH_REASONS
from otel_llm.integrations.vllm.translation.fields import FieldReader

_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs

MAX_ENGINES = 1024  # engine indexes tracked by one logger (elastic EP may add some at run time)


class Keeping(enum.Enum):
    """Which engine steps the telemetry keeps to translate together.

    Between two engine steps the server's other work evicts the CPU caches, and the translation
    costs two to three times more cold (a finished request's summary, metrics and span on vLLM's
    event loop: 86 us one by one, 50 us together); each step's share of the calls is smaller
    too. Kept steps are applied at the latest when the engine goes idle, at the next collection
    or flush, or at vLLM's periodic ``log()``.
    """

    EVERY_STEP = "every step"
    # Beside vLLM's logger, which records the per-step core series: only the finished requests
    # are left to translate, a few steps in a hundred.
    FINISHED_ONLY = "the steps with finished requests"
    # The same with a tenant source: vLLM's per-step latencies and tokens have no tenant; each
    # step's are taken by tenant (:mod:`.tenant_steps`), and of a step without finished
    # requests only those are kept (its IterationStats where they could not be taken).
    ITERATIONS = "the steps with finished requests, and every step's values by tenant"
    # With several API servers: at once, other API servers read the published scheduler gauges.
    NONE = "none"


class VllmAdapter:
    """The translation, independent of vLLM's base classes (so it is testable without vLLM)."""

    def __init__(
        self,
        vllm_config: Any,
        engine_indexes: Iterable[int],
        *,
        handle: Any = None,
        replace: bool = False,
        beside_vllm_logger: bool = False,
    ) -> None:
        """``beside_vllm_logger``: vLLM's own PrometheusStatLogger records in this process (vLLM's
        StatLoggerManager builds it beside every plugin that is not one): unless replacing it,
        vLLM's series beyond the core are read from it rather than recorded again."""
        self.reader = FieldReader()
        self.vllm_config = vllm_config
        engine_indexes = list(engine_indexes)
        self.plan = plan = make_plan(vllm_config, engine_indexes, self.reader, handle, replace)
        self.handle, self.config, self.series = plan.handle, plan.config, plan.series
        self.model_name = plan.config.model_name
        # Created at start at zero as vLLM creates its series: the histograms vLLM has too.
        families = self.series.families if self.series is not None else {}
        self._zero_histograms = [m.key for m in METRICS if m.kind == "histogram" and m.vllm in families]
        self.telemetry: dict[int, EngineTelemetry] = {}
        self._translators: dict[int, StepTranslator] = {}
        for idx in engine_indexes:
            self._new_telemetry(idx)
        if self.series is not None:
            self._bind_series()
        self.gauges = _shared_gauges(vllm_config, self.series, self.telemetry)
        if self.series is not None and beside_vllm_logger and not plan.replacing and self.gauges is None:
            # vLLM's logger has recorded these series into prometheus_client's registry: read
            # there at collection rather than recorded again each step. Shared scheduler gauges
            # (several API servers) publish the series' own values each step.
            from prometheus_client import REGISTRY

            self.series.read_from(REGISTRY)
        # Read from vLLM's logger at collection, those series are translated at no step.
        self.steps_read = read_step_series(plan, self.telemetry.values())
        # With a tenant source, the per-step latencies and tokens are recorded here, by tenant.
        source = self.config.tenant_source
        self.keeping = (
            Keeping.NONE
            if self.gauges is not None
            else Keeping.EVERY_STEP
            if not self.steps_read
            else Keeping.ITERATIONS
            if source is not None
            else Keeping.FINISHED_ONLY
        )
        self.deep_hook = vllm_deep_hook.enabled() and vllm_deep_hook.install()
        # Only a source that differs by request needs each value taken by request (the model is
        # every request's under this frontend); without, a step's values are one tenant's.
        self.tenant_values: Optional[tenant_steps.Tenants] = None
        self._take_every = max(1, min(t.config.defer_steps or 1 for t in self.telemetry.values()))
        if source is not None and source.kind != "model" and self.deep_hook:
            first = self.telemetry[min(self.telemetry)]  # its resolver names every engine's tenants
            self.tenant_values = vllm_deep_hook.take_tenant_values(
                lambda facts: first.tenant_of(facts) or tenants.UNSET
            )
        if self.deep_hook:
            vllm_deep_hook.listen(self.stopped)
            attribution.start()
        for idx in self.telemetry:
            self._translate_with(idx)

    @property
    def replacing(self) -> bool:
        """This logger answers vLLM's /metrics in place of vLLM's own logger (replace mode)."""
        return self.plan.replacing

    def _bind_series(self) -> None:
        from otel_llm.integrations.vllm.series.series_instruments import SeriesView

        provider = self.handle.meter_provider
        if provider is None:  # OTEL_SDK_DISABLED
            self.series = None
            return
        have = {v.series_name for v in getattr(self.handle, "extra_views", ()) if isinstance(v, SeriesView)}
        left_out = self.series.bind(provider, have.__contains__)
        if left_out:
            _log.warning(
                "otel-llm vLLM adapter: %d of vLLM's series are not exported, their Views are not on the "
                "MeterProvider (build it with setup_telemetry(config, extra_views=VllmSeries(vllm_config, "
                "engine_indexes).views())): %s",
                len(left_out),
                ", ".join(sorted(left_out)),
            )

    def _new_telemetry(self, idx: int) -> Optional[EngineTelemetry]:
        if len(self.telemetry) >= MAX_ENGINES:
            self.reader.warn_once("engine_idx", str(idx), f"beyond {MAX_ENGINES} engines: not recorded")
            return None
        handle, engine = self.handle, str(idx)
        default = getattr(handle, "telemetry", None)
        cfg = getattr(default, "config", None)
        if (
            default is not None
            and cfg is not None
            and cfg.model_name == self.model_name
            and cfg.engine == engine
            and cfg.span_name == self.config.span_name
            and default not in self.telemetry.values()
        ):
            tel = default  # setup_telemetry's own EngineTelemetry, when its settings fit
        elif hasattr(handle, "new_telemetry"):
            tel = handle.new_telemetry(
                model_name=self.model_name,
                engine=engine,
                span_name=self.config.span_name,
                span_kind=self.config.span_kind,
            )
        else:
            tel = EngineTelemetry(
                dataclasses.replace(self.config, engine=engine),
                meter_provider=handle.meter_provider,
                tracer_provider=handle.tracer_provider,
            )
        tel.metrics.show_zero_series(_finish_reasons(), self._zero_histograms)
        self.telemetry[idx] = tel
        return tel

    def _translate_with(self, idx: int) -> None:
        translator = StepTranslator(
            idx,
            self.reader,
            series=self.series,
            steps_read=self.steps_read,
            gauges=self.gauges,
            deep_hook=self.deep_hook,
            tenants=self.telemetry[idx].config.tenant is not None,
        )
        self._translators[idx] = translator
        self.telemetry[idx].translate_steps_with(translator)

    def _engine(self, idx: int) -> Optional[EngineTelemetry]:
        """The telemetry of an engine index first seen at run time."""
        tel = self._new_telemetry(idx)
        if tel is not None:
            self._translate_with(idx)
        return tel

    # -- record ---------------------------------------------------------------------

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int, mm_cache_stats: Any = None) -> None:
        idx = engine_idx if isinstance(engine_idx, int) else 0
        tel = self.telemetry.get(idx) or self._engine(idx)  # each step: the lookup inline
        if tel is None or (scheduler_stats is None and iteration_stats is None):
            if self.series is not None:
                self.series.run(
                    "record", scheduler_stats, iteration_stats, mm_cache_stats=mm_cache_stats, engine_idx=idx
                )
            return
        if self.deep_hook and (traces.ended or traces.lost[0]):
            self.record_ended()
        keeping = self.keeping
        finished = getattr(iteration_stats, "finished_requests", None)
        if keeping is Keeping.FINISHED_ONLY and not finished:
            return
        values = self._take_tenant_values(iteration_stats, bool(finished))
        if keeping is Keeping.ITERATIONS:
            if iteration_stats is None:
                return
            if not finished:
                if values is None:
                    tel.keep_step(iteration_stats)
                elif values:
                    tel.keep_step(values)
                return
        step = VllmStep(scheduler_stats, iteration_stats, mm_cache_stats, time.time() - time.monotonic(), values)
        idle = keeping is Keeping.NONE or (
            scheduler_stats is not None
            and getattr(scheduler_stats, "num_running_reqs", None) == 0
            and getattr(scheduler_stats, "num_waiting_reqs", None) == 0
        )
        tel.keep_step(step, idle)

    def _take_tenant_values(self, iteration_stats: Any, finished: bool) -> Optional[list]:
        """With tenant values (:mod:`.tenant_steps`), on vLLM's event loop, which adds to them:
        what is taken at this step (an empty list: nothing, yet), or None where this step's
        values are its IterationStats' (no tenant values, or they do not account for the step).
        One engine: taken every ``defer_steps`` steps and at each step with finished requests,
        several steps at once; several: at each step, to go to its own engine. Never from
        another thread: a collection there applies what was taken."""
        tenant_values = self.tenant_values
        if tenant_values is None or iteration_stats is None:
            return None
        try:
            tenant_values.expected_ttfts += len(iteration_stats.time_to_first_tokens_iter)
            tenant_values.expected_itls += len(iteration_stats.inter_token_latencies_iter)
        except (AttributeError, TypeError):  # not vLLM's lists: the wrapper took nothing either
            return None
        several = len(self.telemetry) > 1
        tenant_values.steps += 1
        if not several and tenant_values.steps < self._take_every and not finished:
            return tenant_steps.NOTHING
        return self._take(tenant_values, one_step=several)

    def _take(self, tenant_values: tenant_steps.Tenants, one_step: bool) -> Optional[list]:
        """The values taken; where they do not account for vLLM's counts, said once, and None
        if they are ``one_step``'s (that step's are then its IterationStats', unattributed)."""
        taken, accounted = tenant_values.take()
        if accounted:
            return taken
        message = tenant_steps.UNATTRIBUTED if one_step else tenant_steps.UNACCOUNTED
        self.reader.warn_once("IterationStats", "update_from_output", message)
        return None if one_step else taken

    def _keep_tenant_values(self) -> None:
        """The tenant values not taken yet, kept by the first engine's telemetry (vLLM's periodic
        ``log()``, its stop: no step comes to take them)."""
        if self.tenant_values is None or not self.tenant_values.touched:
            return
        taken = self._take(self.tenant_values, one_step=False)
        tel = self.telemetry.get(min(self.telemetry, default=0))
        if tel is not None:
            tel.keep_step(taken)

    def record_ended(self) -> None:
        """A span for each request the deep hook saw end without vLLM's FinishedRequestStats
        (aborted, cut short by a shutdown or a dead engine); no metric: vLLM counts none."""
        if not self.deep_hook or not (traces.ended or traces.lost[0]):
            return
        idx = min(self.telemetry, default=0)
        tel = self.telemetry.get(idx) or self._engine(idx)
        if tel is None:
            return
        lost, traces.lost[0] = traces.lost[0], 0
        if lost:
            tel.count_dropped(drops.EVICTED, lost)
        offset = time.time() - time.monotonic()
        translator = self._translators[idx]
        while traces.ended:
            try:
                a = traces.ended.popleft()
            except IndexError:  # drained by another thread
                return
            translator.record_ended(tel, a, offset)

    def logged(self) -> None:
        """vLLM's periodic ``log()``: the steps kept are applied (their spans and metrics), and
        the requests ended without vLLM's stats get their spans."""
        self._apply_kept_steps()
        self.record_ended()

    def stopped(self) -> None:
        """vLLM stops or its engine died: the requests ended then get their spans, and the
        telemetry is flushed at once, on a thread of its own (vLLM's process manager may kill
        this process a few seconds later; the flush at exit follows when it does not)."""
        self._apply_kept_steps()  # no engine step comes to apply them
        self.record_ended()
        # Not from a finalizer at interpreter exit (vLLM's AsyncLLM.__del__ shuts it down): the
        # flush at exit has run, and a thread started then never runs (its start() waits forever).
        if self.handle is not None and not sys.is_finalizing():
            threading.Thread(target=self._flush, daemon=True, name="otel-llm-flush").start()

    def _apply_kept_steps(self) -> None:
        self._keep_tenant_values()
        for tel in list(self.telemetry.values()):
            tel.flush()

    def _flush(self) -> None:
        try:
            self.handle.force_flush()
        except Exception:  # noqa: BLE001 - a flush must not raise into vLLM
            _log.exception("otel-llm: flushing the telemetry failed")

    def call_series(self, method: str, *args: Any, **kwargs: Any) -> None:
        """One of vLLM's own logger methods on :class:`VllmSeries`, where it runs here."""
        if self.series is not None:
            self.series.run(method, *args, **kwargs)


def _finish_reasons() -> tuple[str, ...]:
    """vLLM's finish reasons as its logger labels them (one ``request_success`` series each)."""
    return tuple(FINISH_REASONS.values())


def _shared_gauges(vllm_config: Any, series: Any, telemetry: dict[int, Any]) -> Any:
    """With several API servers, the scheduler gauges reported once per engine
    (:mod:`.gauges`); None with one, or when they cannot be shared."""
    try:
        from otel_llm.integrations.vllm.frontend.gauges import share

        return share(vllm_config, series, telemetry)
    except Exception:  # noqa: BLE001 - sharing is optional: per-process gauges stay
        _log.exception("otel-llm vLLM adapter: the scheduler gauges stay per API server, sharing them failed")
        return None
