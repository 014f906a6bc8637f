"""The vLLM adapter: vLLM's ``SchedulerStats`` and ``IterationStats``, per engine step, translated
into the core telemetry (one :class:`~otel_llm.core.telemetry.EngineTelemetry` per engine index),
and vLLM's own series beyond the core (:mod:`otel_llm.integrations.vllm.series`). Beside vLLM's
own logger the core series it records at each step are read from it (:data:`STEP_SERIES`), and
only the finished requests are translated. Independent of
vLLM's base classes, so it is testable without vLLM; :mod:`otel_llm.integrations.vllm.stat_logger`
is the shell vLLM loads."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from otel_llm.catalogue import drops
from otel_llm.catalogue.metrics import BY_KEY, METRICS, base_attributes, label_key, request_token_buckets
from otel_llm.config.settings import TelemetryConfig
from otel_llm.core.telemetry import EngineTelemetry
from otel_llm.events import StepStats
from otel_llm.integrations.vllm import handle as shared_handle
from otel_llm.integrations.vllm.fields import MISSING, FieldReader
from otel_llm.recording.in_process import InProcessRecorder
from otel_llm.summary import ENGINE_DEAD, SHUTDOWN

_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs

DEFAULT_PREEMPTION_REASON = "kv_cache_full"
SIBLING_SPAN_NAME = "llm_request.scheduling"  # our span's name when vLLM traces requests itself
PROVIDER_NAME = "vllm"  # gen_ai.provider.name unless OTEL_LLM_PROVIDER_NAME says otherwise
MAX_ENGINES = 1024  # engine indexes tracked by one logger (elastic EP may add some at run time)
# The core metrics that vLLM's own logger records at each engine step, as the adapter would.
STEP_SERIES = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "iteration_tokens_total",
    "prompt_tokens",
    "generation_tokens",
    "num_preemptions",
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
)


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
        from otel_llm.integrations.vllm import replace as vllm_replace

        vllm_replace.mode()  # a bad OTEL_LLM_VLLM_METRICS stops here, named
        self.reader = FieldReader()
        self.vllm_config = vllm_config
        engine_indexes = list(engine_indexes)
        served, max_len = self._from_vllm_config(vllm_config)
        env_model = os.environ.get("OTEL_LLM_MODEL_NAME", "").strip()
        handle = handle if handle is not None else shared_handle.current()
        own_config = None
        if handle is None:
            overrides: dict[str, Any] = {}
            if not env_model and served:
                overrides["model_name"] = served
            if not os.environ.get("OTEL_LLM_MAX_MODEL_LEN", "").strip() and max_len:
                overrides["max_model_len"] = max_len  # vLLM's 1-2-5 token buckets stop there
            if not os.environ.get("OTEL_LLM_PROVIDER_NAME", "").strip():
                overrides["provider_name"] = PROVIDER_NAME  # tells vLLM apart in a fleet of engines
            own_config = TelemetryConfig.from_env(**overrides)
        # vLLM's series that the core telemetry does not reproduce: built before the providers,
        # which need their Views.
        self.series = _series(vllm_config, engine_indexes, (own_config or handle.config).naming)
        self._series_failed: set[str] = set()
        # Replace mode: this logger answers vLLM's /metrics in place of vLLM's own logger.
        self.replacing = False
        if replace:
            reason = (
                vllm_replace.obstacle(
                    vllm_config,
                    (own_config or handle.config).naming,
                    handle is not None and not shared_handle.answers_vllm(),
                )
                if self.series is not None
                else "vLLM's series beyond the core metrics could not be built"
            )
            if reason is not None:
                vllm_replace.report_fallback(reason)
            self.replacing = reason is None
        elif vllm_replace.requested():  # the add-mode class: this vLLM may build its own logger anyway
            vllm_replace.report_fallback(vllm_replace.version_obstacle() or "this stat-logger class is add mode's")
        if handle is None:
            if self.series is not None:
                own_config = _with_vllm_buckets(own_config, self.series, vllm_config)
            handle = shared_handle.get_handle(
                own_config,
                self.series.views() if self.series is not None else (),
                self._vllm_facing_reader if self.replacing else tuple,
            )
        self.handle = handle
        base = handle.config
        # The model label: OTEL_LLM_MODEL_NAME, else a name the handle's owner chose, else vLLM's.
        if env_model:
            self.model_name = env_model
        elif base.model_name != "unknown" or not served:
            self.model_name = base.model_name
        else:
            self.model_name = served
        self.config = dataclasses.replace(base, model_name=self.model_name)
        if _vllm_traces_requests(vllm_config):
            # vLLM's own llm_request span is the request's span: ours, with the preemption
            # events, is an internal sibling under the same parent, not a second llm_request.
            self.config = dataclasses.replace(self.config, span_name=SIBLING_SPAN_NAME, span_kind="internal")
        # Created at start at zero as vLLM creates its series: the histograms vLLM has too.
        self._zero_histograms = [
            m.key
            for m in METRICS
            if m.kind == "histogram" and self.series is not None and m.vllm in self.series.families
        ]
        self.telemetry: dict[int, EngineTelemetry] = {}
        # Per engine: the steps kept to be translated together, and the call that does it.
        self._kept: dict[int, collections.deque[tuple[Any, Any, Any, float]]] = {}
        self._appliers: dict[int, Callable[[], None]] = {}
        for idx in engine_indexes:
            self._engine(idx)
        if self.series is not None:
            self._bind_series()
        self.gauges = _shared_gauges(vllm_config, self.series, self.telemetry)
        if self.series is not None and beside_vllm_logger and not self.replacing and self.gauges is None:
            # vLLM's logger has recorded these series into prometheus_client's registry: read
            # there at collection rather than recorded again each step. Shared scheduler gauges
            # (several API servers) publish the series' own values each step.
            from prometheus_client import REGISTRY

            self.series.read_from(REGISTRY)
        # Read from vLLM's logger at collection, those series are translated at no step.
        self.steps_read = self._read_step_series(served)
        self._last_sched: dict[int, tuple[int, int, float]] = {}
        self._deep_hook = None
        from otel_llm.integrations.vllm import deep_hook as vllm_deep_hook

        if vllm_deep_hook.enabled() and vllm_deep_hook.install():
            self._deep_hook = vllm_deep_hook
            vllm_deep_hook.listen(self.stopped)

    def _read_step_series(self, served: Optional[str]) -> bool:
        """Export the core series of :data:`STEP_SERIES` from vLLM's own logger, which records
        them at each step as this adapter would (vLLM's names, labels, buckets and values), where
        the series beyond the core are read from it too, and where what is exported stays the
        same: the ``vllm`` naming profile, vLLM's model name, explicit buckets equal to vLLM's, no
        exemplars on them (``always_on`` gives them some, without a trace), and providers that
        only this plugin records into. Preemptions by reason are vLLM's preemptions, all
        ``kv_cache_full``."""
        series, config = self.series, self.config
        recorders = [tel.metrics for tel in self.telemetry.values()]
        in_process = [m for m in recorders if isinstance(m, InProcessRecorder)]
        if not in_process or len(in_process) != len(recorders):
            return False
        sources: dict[str, Callable[[], Iterable[Any]]] = {}
        if (
            series is not None
            and series.source is not None
            and shared_handle.owned()
            and config.naming == "vllm"
            and self.model_name == served
            and all(tel.exemplar_filter != "always_on" for tel in self.telemetry.values())
        ):
            labels = set(base_attributes(config))
            for key in STEP_SERIES:
                m = BY_KEY[key]
                family = series.families.get(m.vllm)
                if (
                    family is None
                    or family.kind != m.kind
                    or set(family.labelnames) != labels
                    or (m.kind == "histogram" and tuple(map(float, m.boundaries(config))) != family.bounds)
                    or m.exponential(config)
                ):
                    sources.clear()
                    break
                sources[key] = functools.partial(series.read, family)
            if sources:
                sources["num_preemptions_by_reason"] = functools.partial(
                    _by_reason, sources["num_preemptions"], label_key(config, "reason")
                )
        in_process[0].read_elsewhere(sources)  # none: a series this provider read before is recorded again
        return bool(sources)

    def _vllm_facing_reader(self) -> list[Any]:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        from otel_llm.integrations.vllm.replace import VllmFacingReader

        assert self.series is not None  # replace mode needs vLLM's series (their HELP text)
        documentation = {name: f.documentation for name, f in self.series.families.items()}
        return [VllmFacingReader(get_prometheus_registry(), documentation)]

    def _bind_series(self) -> None:
        from otel_llm.integrations.vllm.series import SeriesView

        provider = self.handle.meter_provider
        if provider is None:  # OTEL_SDK_DISABLED
            self.series = None
            return
        have = {v.series_name for v in getattr(self.handle, "extra_views", ()) if isinstance(v, SeriesView)}
        left_out = self.series.bind(provider, have.__contains__)
        # The steps kept call vLLM's logger code. The telemetries, not this adapter: a cycle
        # through the series would keep the adapter (a deep-hook listener) past its vLLM.
        self.series.before_read = functools.partial(_apply_kept_steps, self.telemetry)
        if left_out:
            _log.warning(
                "otel-llm vLLM adapter: %d of vLLM's series are not exported, their Views are not on the "
                "MeterProvider (build it with setup_telemetry(config, extra_views=VllmSeries(vllm_config, "
                "engine_indexes).views())): %s",
                len(left_out),
                ", ".join(sorted(left_out)),
            )

    def _from_vllm_config(self, vllm_config: Any) -> tuple[Optional[str], Optional[int]]:
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is None:
            return None, None
        served = self.reader.raw(model_config, "served_model_name", "the model_name label")
        if isinstance(served, (list, tuple)) and served:
            served = served[0]
        max_len = self.reader.number(model_config, "max_model_len", "the request token buckets")
        return (
            served if isinstance(served, str) and served else None,
            int(max_len) if max_len is not None and max_len >= 1 else None,
        )

    def _engine(self, idx: int) -> Any:
        tel = self.telemetry.get(idx)
        if tel is None:
            if len(self.telemetry) >= MAX_ENGINES:
                self.reader.warn_once("engine_idx", str(idx), f"beyond {MAX_ENGINES} engines: not recorded")
                return None
            handle, engine = self.handle, str(idx)
            default = getattr(handle, "telemetry", None)
            cfg = getattr(default, "config", None)
            if (
                cfg is not None
                and cfg.model_name == self.model_name
                and cfg.engine == engine
                and (cfg.span_name == self.config.span_name)
                and default not in self.telemetry.values()
            ):
                assert default is not None  # cfg is its config
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
            self._kept[idx] = collections.deque()
            # Through a weak reference: the adapter holding its own bound method would be a cycle
            # that keeps a stopped adapter alive, listening to the deep hook, until a collection.
            self._appliers[idx] = functools.partial(_record_kept, weakref.ref(self), tel, idx)
            self.telemetry[idx] = tel
        return tel

    # -- record ---------------------------------------------------------------------

    def record(self, scheduler_stats: Any, iteration_stats: Any, engine_idx: int, mm_cache_stats: Any = None) -> None:
        idx = engine_idx if isinstance(engine_idx, int) else 0
        tel = self.telemetry.get(idx) or self._engine(idx)  # each step: the lookup inline
        if tel is None or (scheduler_stats is None and iteration_stats is None):
            self.call_series("record", scheduler_stats, iteration_stats, mm_cache_stats=mm_cache_stats, engine_idx=idx)
            return
        hook = self._deep_hook
        if hook is not None and (hook.ended or hook.lost[0]):
            self.record_ended()
        if self.steps_read and not getattr(iteration_stats, "finished_requests", None):
            return  # only the finished requests are left to translate, a few steps in a hundred
        step = (scheduler_stats, iteration_stats, mm_cache_stats, time.time() - time.monotonic())
        if self.gauges is not None:  # at once: other API servers read the published gauges
            self._record(tel, idx, (step,))
            return
        # Translated with the next steps' (defer_steps), all together: between two engine steps
        # the server's other work evicts the caches, and the translation costs two to three
        # times more cold (a finished request's summary, metrics and span on vLLM's event loop:
        # 86 us one by one, 50 us together); each step's share of the calls is smaller too.
        # Applied at the latest when the engine goes idle, at the next collection or flush, or
        # at vLLM's periodic log().
        self._kept[idx].append(step)
        idle = (
            scheduler_stats is not None
            and getattr(scheduler_stats, "num_running_reqs", None) == 0
            and getattr(scheduler_stats, "num_waiting_reqs", None) == 0
        )
        tel.defer(self._appliers[idx], idle)

    def _record_kept(self, tel: Any, idx: int) -> None:
        """The steps kept for engine ``idx`` so far (the first of their deferred calls takes them
        all, the others find none)."""
        kept, steps = self._kept[idx], []
        while kept:
            try:
                steps.append(kept.popleft())
            except IndexError:  # taken by another thread
                break
        if steps:
            try:
                self._record(tel, idx, steps)
            except Exception:
                # Each step of the batch is lost: counted each (the caller counts and reports one).
                tel.count_dropped(drops.INTERNAL_ERROR, len(steps) - 1)
                raise

    def _record(self, tel: Any, idx: int, steps: Sequence[tuple[Any, Any, Any, float]]) -> None:
        if self._runs_series():
            for sched, it, mm_cache_stats, _ in steps:
                self.call_series("record", sched, it, mm_cache_stats=mm_cache_stats, engine_idx=idx)
        iterations = [(it, offset) for _, it, _, offset in steps if it is not None]
        if not self.steps_read:
            if iterations:
                self._record_iteration_counts(tel, iterations)
            for sched, it, _, offset in steps:
                self._record_step(tel, idx, sched, it, offset)
        self._record_finished(tel, iterations)

    def record_ended(self) -> None:
        """A span for each request the deep hook saw end without vLLM's FinishedRequestStats
        (aborted, cut short by a shutdown or a dead engine); no metric: vLLM counts none."""
        hook = self._deep_hook
        if hook is None or not (hook.ended or hook.lost[0]):
            return
        tel = self._engine(min(self.telemetry, default=0))
        if tel is None:
            return
        lost, hook.lost[0] = hook.lost[0], 0
        if lost:
            tel.count_dropped(drops.EVICTED, lost)
        offset = time.time() - time.monotonic()
        while hook.ended:
            try:
                a = hook.ended.popleft()
            except IndexError:  # drained by another thread
                return
            finish = a.end_time - offset
            preemptions = tuple((ts, 0, DEFAULT_PREEMPTION_REASON) for ts in a.trace.preempted_at)
            summary = _summary_class()(
                request_id=a.request_id,
                finish_reason="error" if a.incomplete == ENGINE_DEAD else "abort",
                arrival_time=a.arrival_time - offset,
                finish_time=finish,
                prompt_tokens=a.prompt_tokens,
                generation_tokens=a.generation_tokens,
                max_tokens=a.max_tokens,
                num_preemptions=len(preemptions),
                preempted_time=a.trace.preempted_time(finish),
                preemptions=preemptions,
                incomplete=a.incomplete,
                error_type=a.error_type,
            )
            tel.record_finished(summary, a.trace.carrier, metrics=False)

    def logged(self) -> None:
        """vLLM's periodic ``log()``: the steps kept are applied (their spans and metrics), and
        the requests ended without vLLM's stats get their spans."""
        _apply_kept_steps(self.telemetry)
        self.record_ended()

    def stopped(self) -> None:
        """vLLM stops or its engine died: the requests ended then get their spans, and the
        telemetry is flushed at once, on a thread of its own (vLLM's process manager may kill
        this process a few seconds later; the flush at exit follows when it does not)."""
        _apply_kept_steps(self.telemetry)  # no engine step comes to apply them
        self.record_ended()
        # Not from a finalizer at interpreter exit (vLLM's AsyncLLM.__del__ shuts it down): the
        # flush at exit has run, and a thread started then never runs (its start() waits forever).
        if self.handle is not None and not sys.is_finalizing():
            threading.Thread(target=self._flush, daemon=True, name="otel-llm-flush").start()

    def _flush(self) -> None:
        try:
            self.handle.force_flush()
        except Exception:  # noqa: BLE001 - a flush must not raise into vLLM
            _log.exception("otel-llm: flushing the telemetry failed")

    def _runs_series(self) -> bool:
        """vLLM's logger code runs here for the series beyond the core (they are not read from
        vLLM's own logger)."""
        return self.series is not None and self.series.source is None

    def call_series(self, method: str, *args: Any, **kwargs: Any) -> None:
        """One of vLLM's own logger methods on :class:`VllmSeries` (none when the series are read
        from vLLM's own logger); a failure is reported once and leaves the core telemetry untouched."""
        if not self._runs_series():
            return
        try:
            getattr(self.series.logger, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - vLLM's own logger code must not break the telemetry's hook
            if method not in self._series_failed:
                self._series_failed.add(method)
                _log.warning(
                    "otel-llm vLLM adapter: vLLM's PrometheusStatLogger.%s failed (%r): vLLM's series beyond "
                    "the core metrics may be incomplete (reported once)",
                    method,
                    exc,
                )

    def _record_step(self, tel: Any, idx: int, sched: Any, it: Any, offset: float) -> None:
        r = self.reader
        last = self._last_sched.get(idx)
        running, waiting, usage = last if last is not None else (0, 0, 0.0)
        if sched is not None:
            v = r.number(sched, "num_running_reqs", "vllm:num_requests_running")
            running = int(v) if v is not None else running
            w = r.number(sched, "num_waiting_reqs", "vllm:num_requests_waiting")
            # vLLM's gauge counts the deferred ("skipped") waiting requests too.
            skipped = getattr(sched, "num_skipped_waiting_reqs", 0)
            if type(skipped) is not int:
                skipped = 0
            waiting = int(w) + skipped if w is not None else waiting
            u = r.number(sched, "kv_cache_usage", "vllm:kv_cache_usage_perc")
            usage = float(u) if u is not None else usage
            self._last_sched[idx] = (running, waiting, usage)
        # Only an iteration observes iteration_tokens_total (0 included), as vLLM does.
        batched = ts = None
        if it is not None:
            batched = self._iteration_tokens(it)
            ts = r.number(it, "iteration_timestamp", "span times")
        if sched is None and last is None and batched is None:
            return
        tel.on_step(StepStats(ts - offset if ts is not None else time.monotonic(), running, waiting, usage, batched))
        if sched is not None and self.gauges is not None:
            self.gauges.publish(idx, running, waiting, usage)

    def _iteration_tokens(self, it: Any) -> Optional[int]:
        # vLLM: prompt_token_stats.computed + num_generation_tokens (cached prompt tokens excluded).
        # None (not observed) when a field is missing: the metric degrades, with one warning.
        r = self.reader
        gen = r.number(it, "num_generation_tokens", "vllm:iteration_tokens_total")
        pts = r.raw(it, "prompt_token_stats", "vllm:iteration_tokens_total")
        if gen is None or pts is MISSING:
            return None
        computed = r.number(pts, "computed", "vllm:iteration_tokens_total") if pts is not None else 0
        if computed is None:
            return None
        return int(computed + gen)

    def _record_iteration_counts(self, tel: Any, iterations: Sequence[tuple[Any, float]]) -> None:
        """Several steps' IterationStats: their latencies and counts in one call."""
        r = self.reader
        ttfts: list[float] = []
        itls: list[float] = []
        prompt = gen = preempted = 0
        for it, _ in iterations:
            ttfts += r.sequence(it, "time_to_first_tokens_iter", "vllm:time_to_first_token_seconds")
            itls += r.sequence(it, "inter_token_latencies_iter", "vllm:inter_token_latency_seconds")
            prompt += int(r.number(it, "num_prompt_tokens", "vllm:prompt_tokens") or 0)
            gen += int(r.number(it, "num_generation_tokens", "vllm:generation_tokens") or 0)
            preempted += int(r.number(it, "num_preempted_reqs", "vllm:num_preemptions") or 0)
        tel.record_iteration(
            ttfts=ttfts,
            itls=itls,
            prompt_tokens=prompt,
            generation_tokens=gen,
            num_preemptions=preempted,
            preemption_reason=DEFAULT_PREEMPTION_REASON,
        )

    def _record_finished(self, tel: Any, iterations: Sequence[tuple[Any, float]]) -> None:
        """The finished requests of several steps' IterationStats: metrics and spans."""
        r = self.reader
        for it, offset in iterations:
            finished = r.raw(it, "finished_requests", "the per-request metrics and spans")
            if finished is MISSING or not finished:
                continue
            ts = r.number(it, "iteration_timestamp", "span times")
            finish_time = (ts - offset) if ts is not None else time.monotonic()
            for f in list(finished):
                deep = self._deep_hook.trace_of(f) if self._deep_hook is not None else None
                summary = self._summary(f, finish_time, offset, deep)
                if summary is not None:
                    # A request the deep hook already ended (cut short at shutdown) keeps its one span.
                    span = deep is None or not deep.ended
                    tel.record_finished(summary, deep.carrier if deep is not None else None, span=span)

    def _summary(self, f: Any, finish_time: float, offset: float, deep: Any) -> Any:
        """The RequestSummary of one of vLLM's FinishedRequestStats; ``deep``: what the deep hook
        saw of that request (None without it)."""
        r = self.reader
        reason = r.raw(f, "finish_reason", "vllm:request_success")
        if reason is MISSING or reason is None:
            return None
        e2e = r.number(f, "e2e_latency", "vllm:e2e_request_latency_seconds")
        num_preemptions = r.number(f, "num_preemptions", "vllm:request_num_preemptions")
        arrival = finish_time - e2e if e2e is not None else None
        preemptions: tuple = ()
        preempted_time = None
        ttft = None
        if deep is not None:
            preemptions = tuple((ts, 0, DEFAULT_PREEMPTION_REASON) for ts in deep.preempted_at)
            preempted_time = deep.preempted_time(finish_time)
            if deep.arrival_time is not None:
                arrival = deep.arrival_time - offset
            ttft = deep.first_token_latency
            if num_preemptions is None:
                num_preemptions = len(preemptions)
        request_id = r.raw(f, "request_id", "span attribute gen_ai.request.id")
        max_tokens = r.number(f, "max_tokens_param", "vllm:request_params_max_tokens")
        return _summary_class()(
            e2e_latency=e2e,
            request_id=str(request_id) if request_id not in (MISSING, None) else "",
            finish_reason=str(reason),
            arrival_time=arrival if arrival is not None else finish_time,
            finish_time=finish_time,
            prompt_tokens=_int(r.number(f, "num_prompt_tokens", "vllm:request_prompt_tokens")),
            generation_tokens=_int(r.number(f, "num_generation_tokens", "vllm:request_generation_tokens")),
            max_tokens=_int(max_tokens) or 0,
            num_preemptions=_int(num_preemptions) or 0,
            queue_time=r.number(f, "queued_time", "vllm:request_queue_time_seconds"),
            ttft=ttft,
            prefill_time=r.number(f, "prefill_time", "vllm:request_prefill_time_seconds"),
            decode_time=r.number(f, "decode_time", "vllm:request_decode_time_seconds"),
            inference_time=r.number(f, "inference_time", "vllm:request_inference_time_seconds"),
            time_per_output_token=r.number(
                f, "mean_time_per_output_token", "vllm:request_time_per_output_token_seconds"
            ),
            preempted_time=preempted_time,
            recomputed_tokens=0,
            cached_tokens=_int(getattr(f, "num_cached_tokens", 0)) or 0,
            preemptions=preemptions,
            # Aborted by vLLM's shutdown (in flight when it began), not by its client.
            incomplete=SHUTDOWN if deep is not None and deep.stopping and str(reason) == "abort" else None,
        )


_summary_cls: list = []


def _summary_class() -> type:
    """A RequestSummary whose ``e2e`` is vLLM's own ``e2e_latency`` when known.

    ``finish_time - arrival_time`` would be vLLM's value only up to float rounding (the arrival
    is derived from it); the histogram must hold exactly the value vLLM's logger observes.
    """
    if not _summary_cls:
        from otel_llm.summary import RequestSummary

        @dataclasses.dataclass(frozen=True)
        class VllmRequestSummary(RequestSummary):
            e2e_latency: Optional[float] = None

            @property
            def e2e(self) -> float:
                if self.e2e_latency is not None:
                    return self.e2e_latency
                return self.finish_time - self.arrival_time

        _summary_cls.append(VllmRequestSummary)
    return _summary_cls[0]


def _with_vllm_buckets(config: Any, series: Any, vllm_config: Any) -> Any:
    """The config with vLLM's histogram boundaries where vLLM's settings changed them
    (``--custom-histogram-buckets``): for every core histogram whose boundaries in vLLM's
    logger differ from vLLM's defaults (which are ours in the ``vllm`` profile). An explicit
    ``OTEL_LLM_PREEMPTION_BUCKETS`` / ``OTEL_LLM_MAX_MODEL_LEN`` wins."""
    defaults = dataclasses.replace(config, naming="vllm", histogram_buckets={})
    custom = getattr(getattr(vllm_config, "observability_config", None), "custom_histogram_buckets", None) or {}
    overrides = dict(config.histogram_buckets)
    preemption = config.preemption_buckets
    for m in METRICS:
        family = series.families.get(m.vllm)
        if m.kind != "histogram" or family is None or not family.bounds:
            continue
        if m.key == "request_num_preemptions":
            # Ours start at 0.5 on purpose: vLLM's apply only when set by the user.
            if "request_num_preemptions" in custom and not os.environ.get("OTEL_LLM_PREEMPTION_BUCKETS", "").strip():
                preemption = family.bounds
        elif m.buckets is request_token_buckets and os.environ.get("OTEL_LLM_MAX_MODEL_LEN", "").strip():
            continue
        elif tuple(map(float, m.boundaries(defaults))) != family.bounds:
            overrides[m.key] = family.bounds
    try:
        return dataclasses.replace(config, histogram_buckets=overrides, preemption_buckets=preemption)
    except ValueError as exc:  # e.g. a boundary <= 0, which vLLM allows and Ray's exporter rejects
        _log.warning("otel-llm vLLM adapter: vLLM's custom histogram buckets are not used (%s)", exc)
        return config


def _vllm_traces_requests(vllm_config: Any) -> bool:
    """vLLM's own tracing (``--otlp-traces-endpoint``) makes an ``llm_request`` span per request."""
    observability = getattr(vllm_config, "observability_config", None)
    return bool(getattr(observability, "otlp_traces_endpoint", None))


def _finish_reasons() -> tuple[str, ...]:
    """vLLM's finish reasons as its logger labels them (one ``request_success`` series each)."""
    try:
        from vllm.v1.engine import FinishReason

        return tuple(str(reason) for reason in FinishReason)
    except Exception:  # noqa: BLE001 - a vLLM without it: the reasons every vLLM has
        return ("stop", "length", "abort", "error")


def _series(vllm_config: Any, engine_indexes: list[int], naming: str) -> Any:
    try:
        from otel_llm.integrations.vllm.series import VllmSeries

        return VllmSeries(vllm_config, engine_indexes, naming)
    except Exception as exc:  # noqa: BLE001 - vLLM's series are optional: the core metrics stay
        _log.warning(
            "otel-llm vLLM adapter: vLLM's series beyond the core metrics are not recorded, their "
            "logger could not be built (%r)",
            exc,
        )
        return None


def _shared_gauges(vllm_config: Any, series: Any, telemetry: dict[int, Any]) -> Any:
    """With several API servers, the scheduler gauges reported once per engine
    (:mod:`.vllm_gauges`); None with one, or when they cannot be shared."""
    try:
        from otel_llm.integrations.vllm.gauges import share

        return share(vllm_config, series, telemetry)
    except Exception:  # noqa: BLE001 - sharing is optional: per-process gauges stay
        _log.exception("otel-llm vLLM adapter: the scheduler gauges stay per API server, sharing them failed")
        return None


def _record_kept(adapter: "weakref.ref[VllmAdapter]", tel: EngineTelemetry, idx: int) -> None:
    live = adapter()
    if live is not None:
        live._record_kept(tel, idx)


def _by_reason(read: Callable[[], Iterable[Any]], label: str) -> Iterator[Any]:
    """Preemptions by reason as read from vLLM's count of preemptions, every one for the KV
    cache (series from the first preemption on, as when recorded)."""
    from opentelemetry.metrics import Observation

    for o in read():
        if o.value:
            yield Observation(o.value, {**o.attributes, label: DEFAULT_PREEMPTION_REASON})


def _apply_kept_steps(telemetry: dict[int, EngineTelemetry]) -> None:
    """Apply the engine steps each engine's telemetry keeps (EngineTelemetry.defer)."""
    for tel in list(telemetry.values()):
        tel.flush()


def _int(value: Any) -> Optional[int]:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)
