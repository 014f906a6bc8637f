"""What the telemetry observes, as one small interface with two implementations:

* :class:`~otel_llm.recording.in_process.FastMetrics` (default): counters are plain integers read by
  observable counters, gauges read the last step, histograms are
  :class:`~otel_llm.recording.cells.HistogramCell`s exported through explicit-bucket Views.
* :class:`~otel_llm.recording.sdk.SdkMetrics`: the straightforward use of the SDK, one
  ``record``/``add`` per observation. It is the reference that tests compare the fast path
  with, the benchmark's "naive OTel" baseline, and the fallback on a MeterProvider built
  without our Views.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Optional, Sequence

from otel_llm.events import StepStats
from otel_llm.recording.cells import ExemplarIds


class Recorder:
    """What the telemetry observes. Exemplar ids come with the request-scoped observations.

    ``lock`` is the one lock every call is made under (EngineTelemetry takes it): recorders
    that share state (the engines of one MeterProvider share histogram cells) share it.
    """

    @property
    def lock(self) -> threading.Lock:
        raise NotImplementedError

    def preempted(self, reason: str, num_computed_tokens: int) -> None: ...
    def prompt_tokens(self, n: int) -> None: ...
    def ttft(self, seconds: float, exemplar: Optional[ExemplarIds], ctx: Any) -> None: ...
    def tokens(self, n: int, itl: Optional[float], exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        """``n`` output tokens of one step, ``itl`` seconds after the request's previous step."""

    def finished(
        self,
        values: dict[str, float],
        finish_reason: str,
        num_preemptions: int,
        exemplar: Optional[ExemplarIds],
        ctx: Any,
    ) -> None: ...
    def step(self, stats: StepStats) -> None: ...
    def dropped(self, reason: str, n: int = 1) -> None: ...
    def latencies(
        self, ttfts: Sequence[float], itls: Sequence[float], exemplar: Optional[ExemplarIds], ctx: Any
    ) -> None:
        """An engine step's TTFT and inter-token latency observations, not tied to one request."""

    def show_zero_series(self, finish_reasons: Iterable[str], histograms: Iterable[str]) -> None:
        """Export series from now on, at zero until observed (as vLLM's logger does): dashboards
        show 0 rather than no data, and ``increase()`` sees a series' first observations.
        ``request_success`` gets one series per reason given, the gauges theirs, and the
        histograms named (metric keys) theirs."""
