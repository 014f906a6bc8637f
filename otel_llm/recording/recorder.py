"""What the telemetry observes, as one small interface with two implementations:

* :class:`~otel_llm.recording.in_process.InProcessRecorder` (default): counters are plain
  integers read by observable counters, gauges read the last step, histograms are
  :class:`~otel_llm.recording.cells.HistogramCell`s exported through explicit-bucket Views.
* :class:`~otel_llm.recording.sdk.SdkRecorder`: the straightforward use of the SDK, one
  ``record``/``add`` per observation. It is the reference that tests compare the fast path
  with, the benchmark's "naive OTel" baseline, and the fallback on a MeterProvider built
  without our Views.

Which value goes to which metric is the metric table's (``otel_llm.catalogue.metrics``:
``FINISH_OBSERVATIONS``, ``STEP_GAUGES``, ``STEP_HISTOGRAMS``); a recorder only knows how to
record.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Optional, Protocol, Sequence

from otel_llm.events import StepStats
from otel_llm.recording.cells import ExemplarIds
from otel_llm.summary import RequestSummary

# A source of gauge values by metric key; None: this recorder does not report that gauge.
GaugeSource = Callable[[str], Optional[float]]


class PendingWork(Protocol):
    """What a telemetry keeps to record in batches (event batches, an adapter's engine steps):
    every collection of its MeterProvider has it applied first (the in-process recorder's
    ``drain``), so that no reader sees a partial picture."""

    def apply_pending(self) -> None: ...


class RequestSeries(Protocol):
    """Where one request's observations go: the recorder itself, or, with a tenant source, its
    tenant's series (:meth:`Recorder.for_tenant`)."""

    def prompt_tokens(self, n: int) -> None: ...
    def ttft(self, seconds: float, exemplar: Optional[ExemplarIds], ctx: Any) -> None: ...
    def tokens(self, n: int, itl: Optional[float], exemplar: Optional[ExemplarIds], ctx: Any) -> None: ...
    def finished(self, summary: RequestSummary, exemplar: Optional[ExemplarIds], ctx: Any) -> None: ...
    def latencies(
        self, ttfts: Sequence[float], itls: Sequence[float], exemplar: Optional[ExemplarIds], ctx: Any
    ) -> None:
        """An engine step's TTFT and inter-token latency observations, not tied to one request."""
        ...


class TenantRequestSeries(RequestSeries, Protocol):
    def preempted_by_tenant(self, cause_tenant: str) -> None:
        """One preemption of a request of this tenant, caused by a request of ``cause_tenant``."""
        ...

    def aborted_tokens(self, n: int) -> None:
        """The output tokens of an aborted request the engine's own metrics do not count."""
        ...


class Recorder(Protocol):
    """What the telemetry observes. Exemplar ids come with the request-scoped observations.

    ``lock`` is the one lock every call is made under (EngineTelemetry takes it): recorders
    that share state (the engines of one MeterProvider share histogram cells) share it.
    """

    @property
    def lock(self) -> "threading.RLock": ...

    # Whether set_gauge_source is honoured (the in-process recorder reads gauges at collection).
    takes_gauge_source: bool

    def preempted(self, reason: str, num_computed_tokens: int) -> None: ...
    def prompt_tokens(self, n: int) -> None: ...
    def ttft(self, seconds: float, exemplar: Optional[ExemplarIds], ctx: Any) -> None: ...
    def tokens(self, n: int, itl: Optional[float], exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        """``n`` output tokens of one step, ``itl`` seconds after the request's previous step."""
        ...

    def finished(self, summary: RequestSummary, exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        """One finished request: ``request_success`` and every per-request histogram."""
        ...

    def for_tenant(self, tenant: str) -> "TenantRequestSeries":
        """The series of requests of ``tenant`` (the config's tenant source is set)."""
        ...

    def step(self, stats: StepStats) -> None: ...
    def dropped(self, reason: str, n: int = 1) -> None: ...
    def latencies(
        self, ttfts: Sequence[float], itls: Sequence[float], exemplar: Optional[ExemplarIds], ctx: Any
    ) -> None: ...

    def show_zero_series(self, finish_reasons: Iterable[str], histograms: Iterable[str]) -> None:
        """Export series from now on, at zero until observed (as vLLM's logger does): dashboards
        show 0 rather than no data, and ``increase()`` sees a series' first observations.
        ``request_success`` gets one series per reason given, the gauges theirs, and the
        histograms named (metric keys) theirs."""
        ...

    def set_gauge_source(self, source: GaugeSource) -> None:
        """From now on, the step gauges (``STEP_GAUGES``) report ``source(key)`` at collection
        instead of this recorder's last step (used where another process reports them)."""
        ...
