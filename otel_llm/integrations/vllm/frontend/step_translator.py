"""The stat-logger path's translation (vLLM's Python frontend): the engine steps a stat logger kept
(:class:`VllmStep`), handed in a row to one engine's :class:`StepTranslator`
(``EngineTelemetry.translate_steps_with``): their ``SchedulerStats`` and ``IterationStats`` as
:class:`~otel_llm.events.StepStats` and per-iteration observations, each ``FinishedRequestStats``
as a :class:`~otel_llm.summary.RequestSummary`, with what the deep hook saw of the request, through
the tables of :mod:`otel_llm.integrations.vllm.translation.translate`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from typing import Any, Optional, Sequence

from otel_llm.catalogue import drops
from otel_llm.config import tenants
from otel_llm.core.telemetry import EngineTelemetry
from otel_llm.events import StepStats
from otel_llm.integrations.vllm.frontend import attribution, tenant_steps
from otel_llm.integrations.vllm.frontend.traces import EndedRequest, RequestTrace, trace_of
from otel_llm.integrations.vllm.translation.fields import MISSING, FieldReader
from otel_llm.integrations.vllm.translation.translate import (
    DEFAULT_PREEMPTION_REASON,
    FINISHED_COUNTS,
    FINISHED_DURATIONS,
    ITERATION_COUNTS,
    ITERATION_LATENCIES,
    scheduler_gauges,
)
from otel_llm.summary import ENGINE_DEAD, SHUTDOWN, PreemptionCause, RequestSummary

_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs
_PREEMPTIONS = next(f for f in ITERATION_COUNTS if f.ours == "num_preemptions")
_TTFTS, _ITLS = ITERATION_LATENCIES
_PROMPT, _GENERATION = (f for f in ITERATION_COUNTS if f.ours in ("prompt_tokens", "generation_tokens"))
_told_unknown: list[bool] = []  # the one warning that, without the deep hook, causes are unknown


@dataclasses.dataclass(slots=True)
class VllmStep:
    """One engine step as vLLM's stat-logger call handed it over. Not frozen: one is built per
    kept step on vLLM's event loop, and a frozen dataclass sets each field through
    ``object.__setattr__`` (four times the cost of building it)."""

    scheduler_stats: Any
    iteration_stats: Any
    mm_cache_stats: Any
    # time.time() - time.monotonic() when it came: vLLM's wall-clock times onto the engine clock.
    wall_offset: float
    # With a tenant source: the step's values by tenant (tenant_steps.Taken); None: not taken.
    tenant_values: Optional[list] = None


@dataclasses.dataclass(frozen=True)
class VllmRequestSummary(RequestSummary):
    """A RequestSummary whose ``e2e`` is vLLM's own ``e2e_latency`` when known:
    ``finish_time - arrival_time`` would be vLLM's value only up to float rounding (the arrival
    is derived from it), and the histogram must hold exactly the value vLLM's logger observes."""

    e2e_latency: Optional[float] = None

    @property
    def e2e(self) -> float:
        if self.e2e_latency is not None:
            return self.e2e_latency
        return self.finish_time - self.arrival_time


class StepTranslator:
    """One engine's kept steps into its telemetry (``EngineTelemetry.translate_steps_with``).

    ``series``: vLLM's logger code for the series beyond the core, run per step where it is not
    read from vLLM's own logger (None otherwise); ``steps_read``: the per-step core series are
    read from vLLM's logger, only the finished requests are translated; ``gauges``: the
    scheduler gauges shared with other API servers, published per step; ``deep_hook``: the deep
    hook is attached (what it saw of each request, its preemptions' causes included);
    ``tenants``: the telemetry has a tenant source (each step's latencies and tokens are recorded
    by tenant, :mod:`.tenant_steps`, also when the other per-step series are read).
    """

    def __init__(
        self,
        engine_idx: int,
        reader: FieldReader,
        *,
        series: Any = None,
        steps_read: bool = False,
        gauges: Any = None,
        deep_hook: bool = False,
        tenants: bool = False,
    ) -> None:
        self.engine_idx = engine_idx
        self.tenants = tenants
        self.reader = reader
        self.series = series
        self.steps_read = steps_read
        self.gauges = gauges
        self.deep_hook = deep_hook
        self._last_sched: Optional[tuple[int, int, float]] = None  # (running, waiting, usage)

    def __call__(self, telemetry: EngineTelemetry, steps: Sequence[Any]) -> None:
        """``steps``: those kept in a row, and with a tenant source (beside vLLM's logger) the
        values taken by tenant at the steps in between, or those steps' ``IterationStats``."""
        kept = steps
        if self.tenants:
            steps = [s for s in kept if type(s) is VllmStep]
        if self.series is not None and self.series.reader is None:  # read from vLLM's logger: nothing to run
            for s in steps:
                self.series.run(
                    "record",
                    s.scheduler_stats,
                    s.iteration_stats,
                    mm_cache_stats=s.mm_cache_stats,
                    engine_idx=self.engine_idx,
                )
        iterations = [s for s in steps if s.iteration_stats is not None]
        if not self.steps_read:
            if iterations:
                self._record_iteration(telemetry, iterations)
            for s in steps:
                self._record_step(telemetry, s)
        elif self.tenants:
            self._record_by_tenant(telemetry, kept)
        self._record_finished(telemetry, iterations)

    def _record_iteration(self, telemetry: EngineTelemetry, iterations: Sequence[VllmStep]) -> None:
        """Several steps' IterationStats: their latencies and counts in one call (one a tenant)."""
        r = self.reader
        if self.tenants:
            self._record_by_tenant(telemetry, iterations)
            f = _PREEMPTIONS
            preempted = sum(int(r.number(s.iteration_stats, f.vllm, f.metric) or 0) for s in iterations)
            telemetry.record_iteration(num_preemptions=preempted, preemption_reason=DEFAULT_PREEMPTION_REASON)
            return
        values: dict[str, Any] = {f.ours: [] for f in ITERATION_LATENCIES}
        values.update({f.ours: 0 for f in ITERATION_COUNTS})
        for s in iterations:
            it = s.iteration_stats
            for f in ITERATION_LATENCIES:
                values[f.ours] += r.sequence(it, f.vllm, f.metric)
            for f in ITERATION_COUNTS:
                values[f.ours] += int(r.number(it, f.vllm, f.metric) or 0)
        telemetry.record_iteration(**values, preemption_reason=DEFAULT_PREEMPTION_REASON)

    def _record_by_tenant(self, telemetry: EngineTelemetry, kept: Sequence[Any]) -> None:
        """Several steps' latencies and token counts, each tenant's in one call: as taken by
        tenant (:mod:`.tenant_steps`) with the steps, or all of a step's under the tenant of a
        request with no facts where they could not be."""
        takes: list[tenant_steps.Taken] = []
        for s in kept:
            if type(s) is list:  # values taken at a step not kept
                takes.append(s)
            elif type(s) is not VllmStep:  # a step's IterationStats, kept without values taken
                takes.append([self._unattributed(s)])
            elif s.tenant_values is not None:
                if s.tenant_values:
                    takes.append(s.tenant_values)
            elif s.iteration_stats is not None:
                takes.append([self._unattributed(s.iteration_stats)])
        if not takes:
            return
        # Each tenant's values of every take in one record: its fixed cost once.
        merged: dict[Optional[str], list] = {}
        for taken in takes:
            for tenant, ttfts, itls, prompt, generation in taken:
                part = merged.get(tenant)
                if part is None:
                    merged[tenant] = [list(ttfts), list(itls), prompt, generation]
                else:
                    part[0] += ttfts
                    part[1] += itls
                    part[2] += prompt
                    part[3] += generation
        no_facts = (telemetry.tenant_of(None) or tenants.UNSET) if None in merged else tenants.UNSET
        telemetry.record_iteration_by_tenant(
            [(t if t is not None else no_facts, a, b, c, d) for t, (a, b, c, d) in merged.items()]
        )

    def _unattributed(self, it: Any) -> tuple[None, Sequence[float], Sequence[float], int, int]:
        """A step's values, taken by no tenant."""
        r = self.reader
        return (
            None,
            r.sequence(it, _TTFTS.vllm, _TTFTS.metric),
            r.sequence(it, _ITLS.vllm, _ITLS.metric),
            int(r.number(it, _PROMPT.vllm, _PROMPT.metric) or 0),
            int(r.number(it, _GENERATION.vllm, _GENERATION.metric) or 0),
        )

    def _record_step(self, telemetry: EngineTelemetry, s: VllmStep) -> None:
        r, sched, it = self.reader, s.scheduler_stats, s.iteration_stats
        last = self._last_sched
        running, waiting, usage = last if last is not None else (0, 0, 0.0)
        if sched is not None:
            running, waiting, usage = self._last_sched = scheduler_gauges(r, sched, (running, waiting, usage))
        # Only an iteration observes iteration_tokens_total (0 included), as vLLM does.
        batched = ts = None
        if it is not None:
            batched = self._iteration_tokens(it)
            ts = r.number(it, "iteration_timestamp", "span times")
        if sched is None and last is None and batched is None:
            return
        at = ts - s.wall_offset if ts is not None else time.monotonic()
        telemetry.on_step(StepStats(at, running, waiting, usage, batched))
        if sched is not None and self.gauges is not None:
            self.gauges.publish(self.engine_idx, running, waiting, usage)

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

    def _record_finished(self, telemetry: EngineTelemetry, iterations: Sequence[VllmStep]) -> None:
        """The finished requests of several steps' IterationStats: metrics and spans."""
        r, deep_hook = self.reader, self.deep_hook
        drained = False
        for s in iterations:
            it = s.iteration_stats
            finished = r.raw(it, "finished_requests", "the per-request metrics and spans")
            if finished is MISSING or not finished:
                continue
            if deep_hook and not drained:
                drained = True
                self._drain_causes(telemetry)
            ts = r.number(it, "iteration_timestamp", "span times")
            finish_time = (ts - s.wall_offset) if ts is not None else time.monotonic()
            for f in list(finished):
                deep = trace_of(f) if deep_hook else None
                summary = self.summary(f, finish_time, s.wall_offset, deep)
                if summary is None:
                    continue
                if deep is None:
                    if summary.num_preemptions and not _told_unknown:
                        _told_unknown.append(True)
                        _log.warning(
                            "otel-llm: the causes of vLLM's preemptions are unknown without the deep hook "
                            "(OTEL_LLM_VLLM_DEEP_HOOK not 0, a vLLM it attaches to)"
                        )
                    telemetry.record_finished(summary)
                    continue
                self._open_causes(telemetry, deep, s.wall_offset)
                # A request the deep hook already ended (cut short at shutdown) keeps its one span,
                # and its preemptions counted once in the tenant matrix, there.
                telemetry.record_finished(summary, deep.carrier, span=not deep.ended, matrix=not deep.ended)
                attribution.translated(deep)

    def record_ended(self, telemetry: EngineTelemetry, ended: EndedRequest, offset: float) -> None:
        """A request the deep hook saw end without vLLM's FinishedRequestStats (aborted, cut
        short): its span, none of vLLM's metrics (vLLM counts it in none); with a tenant source,
        its preemptions in the tenant matrix (vLLM counted them in ``num_preemptions``) and,
        aborted by its client, its output tokens in ``aborted_generation_tokens``."""
        self._drain_causes(telemetry)
        trace = ended.trace
        finish = ended.end_time - offset
        preemptions = tuple((ts, 0, DEFAULT_PREEMPTION_REASON) for ts in trace.preempted_at)
        causes = attribution.causes_of(trace, len(preemptions))
        summary = VllmRequestSummary(
            request_id=ended.request_id,
            finish_reason="error" if ended.incomplete == ENGINE_DEAD else "abort",
            arrival_time=ended.arrival_time - offset,
            finish_time=finish,
            prompt_tokens=ended.prompt_tokens,
            generation_tokens=ended.generation_tokens,
            max_tokens=ended.max_tokens,
            num_preemptions=len(preemptions),
            preempted_time=trace.preempted_time(finish),
            preemptions=preemptions,
            resumptions=trace.resumed_at,
            preemption_causes=causes,
            preemptions_by_cause=_by_kind(causes),
            num_preemptions_caused=trace.caused,
            incomplete=ended.incomplete,
            error_type=ended.error_type,
            tenant_facts=trace.tenant_facts,
        )
        self._open_causes(telemetry, trace, offset)
        telemetry.record_finished(summary, trace.carrier, metrics=False)
        attribution.translated(trace)

    @staticmethod
    def _drain_causes(telemetry: EngineTelemetry) -> None:
        """The causes the engine cores reported so far, applied (before any finished request that
        needs them is summed up); what they lost, counted."""
        attribution.drain()
        lost = attribution.take_lost()
        if lost:
            telemetry.count_dropped(drops.CAUSE_RECORDS_LOST, lost)

    @staticmethod
    def _open_causes(telemetry: EngineTelemetry, trace: RequestTrace, offset: float) -> None:
        """The spans of the request's causes still in flight, opened now: its links need them."""
        for cause in attribution.causes_in_flight(trace):
            if cause.external_id is not None and cause.arrival_time is not None:
                telemetry.reserve_span(cause.external_id, cause.arrival_time - offset, cause.carrier)

    def summary(self, f: Any, finish_time: float, offset: float, deep: Any) -> Optional[VllmRequestSummary]:
        """The RequestSummary of one of vLLM's FinishedRequestStats; ``deep``: what the deep hook
        saw of that request (None without it)."""
        r = self.reader
        reason = r.raw(f, "finish_reason", "vllm:request_success")
        if reason is MISSING or reason is None:
            return None
        e2e = r.number(f, "e2e_latency", "vllm:e2e_request_latency_seconds")
        num_preemptions = r.number(f, "num_preemptions", "vllm:request_num_preemptions")
        arrival = finish_time - e2e if e2e is not None else None
        preemptions: tuple[tuple[float, int, str], ...] = ()
        resumptions: tuple[float, ...] = ()
        causes: tuple[PreemptionCause, ...] = ()
        preempted_time = None
        ttft = None
        if deep is not None:
            preemptions = tuple((ts, 0, DEFAULT_PREEMPTION_REASON) for ts in deep.preempted_at)
            resumptions = deep.resumed_at
            preempted_time = deep.preempted_time(finish_time)
            if deep.arrival_time is not None:
                arrival = deep.arrival_time - offset
            ttft = deep.first_token_latency
            if num_preemptions is None:
                num_preemptions = len(preemptions)
            causes = attribution.causes_of(deep, _int(num_preemptions) or 0)
        request_id = r.raw(f, "request_id", "span attribute gen_ai.request.id")
        values: dict[str, Any] = {d.ours: r.number(f, d.vllm, d.metric) for d in FINISHED_DURATIONS}
        values.update({c.ours: _int(r.number(f, c.vllm, c.metric)) for c in FINISHED_COUNTS})
        return VllmRequestSummary(
            e2e_latency=e2e,
            request_id=str(request_id) if request_id not in (MISSING, None) else "",
            finish_reason=str(reason),
            arrival_time=arrival if arrival is not None else finish_time,
            finish_time=finish_time,
            max_tokens=_int(r.number(f, "max_tokens_param", "vllm:request_params_max_tokens")) or 0,
            num_preemptions=_int(num_preemptions) or 0,
            ttft=ttft,
            preempted_time=preempted_time,
            recomputed_tokens=0,
            cached_tokens=_int(getattr(f, "num_cached_tokens", 0)) or 0,
            preemptions=preemptions,
            resumptions=resumptions,
            preemption_causes=causes,
            preemptions_by_cause=_by_kind(causes),
            num_preemptions_caused=deep.caused if deep is not None else 0,
            # Aborted by vLLM's shutdown (in flight when it began), not by its client.
            incomplete=SHUTDOWN if deep is not None and deep.stopping and str(reason) == "abort" else None,
            tenant_facts=deep.tenant_facts if deep is not None else None,
            **values,
        )


def _by_kind(causes: Sequence[PreemptionCause]) -> tuple[tuple[str, int], ...]:
    return tuple(Counter(c.kind for c in causes).items())


def _int(value: Any) -> Optional[int]:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)
