"""The metrics: declared once as data, built from that table in one place.

``METRICS`` is the single table (name per naming profile, instrument kind, unit, buckets,
extra label, meaning); the README's metric table is kept in step with it by a test.

Two recorders implement the same small interface (what the telemetry observes):

* :class:`FastMetrics` (default): counters are plain integers read by observable counters,
  gauges read the last step, histograms are :class:`~otel_llm.aggregation.HistogramCell`s
  exported through explicit-bucket Views.
* :class:`SdkMetrics`: the straightforward use of the SDK, one ``record``/``add`` per
  observation. It is the reference that tests compare the fast path with, the benchmark's
  "naive OTel" baseline, and the fallback on a MeterProvider built without our Views.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation
from opentelemetry.sdk.metrics.view import View

from . import __version__, buckets
from .aggregation import ExemplarIds, ExponentialHistogramCell, HistogramCell, InProcessHistogram
from .config import TelemetryConfig
from .events import StepStats
from .tracker import DROP_REASONS

_log = logging.getLogger(__name__)

SCOPE = "otel_llm"
OVERFLOW_LABEL_VALUE = "overflow"


@dataclass(frozen=True)
class MetricDef:
    key: str
    kind: str  # "counter" | "gauge" | "histogram"
    unit: str
    vllm: str  # name in the vllm profile (what Prometheus shows, before _total/_bucket suffixes)
    semconv: str  # name in the semconv profile
    meaning: str
    buckets: Optional[Callable[[TelemetryConfig], tuple[float, ...]]] = None
    semconv_buckets: Optional[tuple[float, ...]] = None  # where the GenAI conventions advise others
    label: Optional[str] = None  # extra label: "finished_reason" or "reason"
    error_type: bool = False  # semconv: a failed request's observation carries error.type
    explicit_only: bool = False  # explicit buckets even when histograms go out exponential: they are the point

    def exponential(self, config: TelemetryConfig) -> bool:
        return self.kind == "histogram" and config.exponential and not self.explicit_only

    def name(self, naming: str) -> str:
        return self.vllm if naming == "vllm" else self.semconv

    def instrument_name(self, naming: str) -> str:
        # The OTel API rejects ':' in instrument names: create with '.', rename with a View.
        return self.name(naming).replace(":", ".")

    def boundaries(self, config: TelemetryConfig) -> tuple[float, ...]:
        assert self.buckets is not None
        custom = config.histogram_buckets.get(self.key)
        if custom is not None:
            return custom
        if config.naming == "semconv" and self.semconv_buckets is not None:
            return self.semconv_buckets
        return self.buckets(config)


def _latency(_: TelemetryConfig) -> tuple[float, ...]:
    return buckets.REQUEST_LATENCY


def request_token_buckets(config: TelemetryConfig) -> tuple[float, ...]:
    return buckets.request_tokens(config.max_model_len)


def _const(values: tuple[float, ...]) -> Callable[[TelemetryConfig], tuple[float, ...]]:
    return lambda _config: values


METRICS: tuple[MetricDef, ...] = (
    MetricDef("request_num_preemptions", "histogram", "{preemption}", "vllm:request_num_preemptions",
              "llm.server.request.num_preemptions",
              "Preemptions per finished request, zero included (le=0.5: never preempted).",
              buckets=lambda c: c.preemption_buckets, explicit_only=True),
    MetricDef("num_preemptions", "counter", "{preemption}", "vllm:num_preemptions", "llm.server.preemptions",
              "Preemptions (all requests)."),
    MetricDef("num_preemptions_by_reason", "counter", "{preemption}", "vllm:num_preemptions_by_reason",
              "llm.server.preemptions.by_reason", "Preemptions by reason (e.g. kv_cache_full).", label="reason"),
    MetricDef("num_recomputed_tokens", "counter", "{token}", "vllm:num_recomputed_tokens",
              "llm.server.recomputed_tokens", "Computed tokens thrown away by preemptions, to be recomputed."),
    MetricDef("prompt_tokens", "counter", "{token}", "vllm:prompt_tokens", "llm.server.prompt_tokens",
              "Prefill tokens processed (counted at each request's first token)."),
    MetricDef("generation_tokens", "counter", "{token}", "vllm:generation_tokens", "llm.server.generation_tokens",
              "Generation tokens produced."),
    MetricDef("request_success", "counter", "{request}", "vllm:request_success", "llm.server.requests",
              "Finished requests by finish reason.", label="finished_reason"),
    MetricDef("dropped_events", "counter", "{event}", "otel_llm.dropped_events", "otel_llm.dropped_events",
              "What the telemetry lost, by reason: invalid or impossible events, evicted requests, "
              "spans and metric points the export path dropped.",
              label="reason"),
    MetricDef("num_requests_running", "gauge", "{request}", "vllm:num_requests_running",
              "llm.server.requests.running", "Requests running in the last engine step."),
    MetricDef("num_requests_waiting", "gauge", "{request}", "vllm:num_requests_waiting",
              "llm.server.requests.waiting", "Requests waiting in the last engine step."),
    MetricDef("kv_cache_usage_perc", "gauge", "", "vllm:kv_cache_usage_perc", "llm.server.kv_cache.usage",
              "KV-cache usage, 0 to 1 (1 = full)."),
    MetricDef("e2e_request_latency_seconds", "histogram", "s", "vllm:e2e_request_latency_seconds",
              "gen_ai.server.request.duration", "Arrival to finish.", buckets=_latency,
              semconv_buckets=buckets.GENAI_REQUEST_DURATION, error_type=True),
    MetricDef("time_to_first_token_seconds", "histogram", "s", "vllm:time_to_first_token_seconds",
              "gen_ai.server.time_to_first_token", "Arrival to first output token.",
              buckets=_const(buckets.TIME_TO_FIRST_TOKEN), semconv_buckets=buckets.GENAI_TIME_TO_FIRST_TOKEN),
    MetricDef("inter_token_latency_seconds", "histogram", "s", "vllm:inter_token_latency_seconds",
              "llm.server.inter_token_latency", "Between consecutive output steps of a request (one per step).",
              buckets=_const(buckets.INTER_TOKEN_LATENCY)),
    MetricDef("request_time_per_output_token_seconds", "histogram", "s",
              "vllm:request_time_per_output_token_seconds", "gen_ai.server.time_per_output_token",
              "Decode time / (output tokens - 1), per request (0 for a single token).",
              buckets=_const(buckets.INTER_TOKEN_LATENCY), semconv_buckets=buckets.GENAI_TIME_PER_OUTPUT_TOKEN),
    MetricDef("request_queue_time_seconds", "histogram", "s", "vllm:request_queue_time_seconds",
              "llm.server.request.queue_time", "First QUEUED (or ARRIVED) to first SCHEDULED.", buckets=_latency),
    MetricDef("request_prefill_time_seconds", "histogram", "s", "vllm:request_prefill_time_seconds",
              "llm.server.request.prefill_time", "First SCHEDULED to first token (preemptions included).",
              buckets=_latency),
    MetricDef("request_decode_time_seconds", "histogram", "s", "vllm:request_decode_time_seconds",
              "llm.server.request.decode_time", "First token to last token (preemptions included).",
              buckets=_latency),
    MetricDef("request_inference_time_seconds", "histogram", "s", "vllm:request_inference_time_seconds",
              "llm.server.request.inference_time", "First SCHEDULED to last token.", buckets=_latency),
    MetricDef("request_preempted_time_seconds", "histogram", "s", "vllm:request_preempted_time_seconds",
              "llm.server.request.preempted_time",
              "Time spent back in the queue after preemptions, per request preempted at least once.",
              buckets=_latency),
    MetricDef("request_prompt_tokens", "histogram", "{token}", "vllm:request_prompt_tokens",
              "llm.server.request.prompt_tokens", "Prompt tokens per finished request.", buckets=request_token_buckets),
    MetricDef("request_generation_tokens", "histogram", "{token}", "vllm:request_generation_tokens",
              "llm.server.request.generation_tokens", "Output tokens per finished request.",
              buckets=request_token_buckets),
    MetricDef("request_params_max_tokens", "histogram", "{token}", "vllm:request_params_max_tokens",
              "llm.server.request.max_tokens", "The max_tokens parameter per finished request (when set).",
              buckets=request_token_buckets),
    MetricDef("iteration_tokens_total", "histogram", "{token}", "vllm:iteration_tokens_total",
              "llm.server.iteration.tokens", "Tokens computed per engine step (prefill + decode).",
              buckets=_const(buckets.ITERATION_TOKENS)),
)
BY_KEY = {m.key: m for m in METRICS}

_LABEL_KEYS = {
    "vllm": {"model": "model_name", "engine": "engine", "finished_reason": "finished_reason", "reason": "reason"},
    "semconv": {"model": "gen_ai.request.model", "engine": "llm.engine",
                "finished_reason": "gen_ai.response.finish_reason", "reason": "llm.preemption.reason"},
}


# GenAI semantic conventions followed by the semconv profile (and the spans' gen_ai.* attributes).
SEMCONV_VERSION = "semantic-conventions-genai v0.1.0"
GEN_AI_OPERATION = "text_completion"  # an engine completes text from a prompt (well-known value)
ERROR_TYPE = "_OTHER"  # error.type of a request finished with reason "error" (the conventions' fallback)


def base_attributes(config: TelemetryConfig) -> dict[str, str]:
    keys = _LABEL_KEYS[config.naming]
    attrs = {keys["model"]: config.model_name, keys["engine"]: config.engine}
    if config.naming == "semconv":
        attrs["gen_ai.operation.name"] = GEN_AI_OPERATION
        attrs["gen_ai.provider.name"] = config.provider_name
    return attrs


def error_attributes(config: TelemetryConfig) -> Optional[dict[str, str]]:
    """Attributes of a failed request's observations on histograms with ``MetricDef.error_type``
    (semconv: error.type is conditionally required on gen_ai.server.request.duration)."""
    return {**base_attributes(config), "error.type": ERROR_TYPE} if config.naming == "semconv" else None


def label_key(config: TelemetryConfig, label: str) -> str:
    return "reason" if label == "reason" and config.naming == "vllm" else _LABEL_KEYS[config.naming][label]


def views(config: Optional[TelemetryConfig] = None) -> list[View]:
    """Every View the telemetry needs: renames (``vllm:`` names) and explicit buckets (or, with
    ``config.histogram_aggregation`` base2_exponential_bucket_histogram, exponential ones for the
    histograms that are not ``explicit_only``).

    Pass them when you build your own MeterProvider: ``MeterProvider(views=otel_llm.views(config))``.
    """
    config = config or TelemetryConfig()
    allowed = {m.key for m in METRICS if m.kind == "histogram"} - {"request_num_preemptions"}
    unknown = sorted(set(config.histogram_buckets) - allowed)
    if unknown:
        raise ValueError(f"histogram_buckets: {unknown} are not histogram keys of otel_llm.metrics.METRICS "
                         "(request_num_preemptions has preemption_buckets)")
    out = []
    for m in METRICS:
        instrument = m.instrument_name(config.naming)
        rename = m.name(config.naming) if instrument != m.name(config.naming) else None
        if m.kind == "histogram":
            aggregation = InProcessHistogram(m.boundaries(config), exponential=m.exponential(config))
            out.append(View(instrument_name=instrument, meter_name=SCOPE, name=rename, aggregation=aggregation))
        elif rename:
            out.append(View(instrument_name=instrument, meter_name=SCOPE, name=rename))
    return out


def use_reader_views(meter_provider: Any, reader: Any, reader_views: Sequence[View]) -> None:
    """Give one reader of ``meter_provider`` Views of its own (the SDK has Views per provider only):
    OTLP readers get exponential histograms while a Prometheus reader keeps explicit buckets.
    Before any instrument records (its streams are made from the Views on first use). Relies on
    SDK 1.45 internals (pinned; tests/test_exponential.py)."""
    storage = meter_provider._measurement_consumer._reader_storages[reader]
    storage._sdk_config = dataclasses.replace(storage._sdk_config, views=list(reader_views))


def provider_has_views(meter_provider: Any, config: TelemetryConfig) -> bool:
    """True when ``meter_provider`` was built with :func:`views` for this naming profile."""
    sdk_config = getattr(meter_provider, "_sdk_config", None)
    wanted = BY_KEY["inter_token_latency_seconds"].instrument_name(config.naming)
    return any(
        isinstance(getattr(v, "_aggregation", None), InProcessHistogram)
        and getattr(v, "_instrument_name", None) == wanted
        for v in getattr(sdk_config, "views", ())
    )


MAX_LABEL_LENGTH = 128


class LabelLimiter:
    """Bounds a user-derived label: at most ``limit`` distinct values (the rest map to
    ``overflow``), each at most MAX_LABEL_LENGTH characters."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if not isinstance(value, str):
            return OVERFLOW_LABEL_VALUE
        value = value[:MAX_LABEL_LENGTH]
        if value not in self._seen:
            if len(self._seen) >= self._limit:
                return OVERFLOW_LABEL_VALUE
            self._seen.add(value)
        return value


class Recorder:
    """What the telemetry observes. Exemplar ids come with the request-scoped observations."""

    def preempted(self, reason: str, num_computed_tokens: int) -> None: ...
    def prompt_tokens(self, n: int) -> None: ...
    def ttft(self, seconds: float, exemplar: Optional[ExemplarIds], ctx: Any) -> None: ...
    def tokens(self, n: int, itl: Optional[float], exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        """``n`` output tokens of one step, ``itl`` seconds after the request's previous step."""
    def finished(self, values: dict[str, float], finish_reason: str, num_preemptions: int,
                 exemplar: Optional[ExemplarIds], ctx: Any) -> None: ...
    def step(self, stats: StepStats) -> None: ...
    def dropped(self, reason: str, n: int = 1) -> None: ...
    def latencies(self, ttfts: Sequence[float], itls: Sequence[float], exemplar: Optional[ExemplarIds],
                  ctx: Any) -> None:
        """An engine step's TTFT and inter-token latency observations, not tied to one request."""
    def show_zero_series(self, finish_reasons: Iterable[str], histograms: Iterable[str]) -> None:
        """Export series from now on, at zero until observed (as vLLM's logger does): dashboards
        show 0 rather than no data, and ``increase()`` sees a series' first observations.
        ``request_success`` gets one series per reason given, the gauges theirs, and the
        histograms named (metric keys) theirs."""


# ---------------------------------------------------------------------------------------
# Fast path


class _Hub:
    """The instruments of one MeterProvider: created once, read from every engine's recorder.

    The SDK returns an already registered asynchronous instrument without its new callbacks,
    so engines sharing a provider (data-parallel ranks, tests) share one hub whose callbacks
    read them all.
    """

    def __init__(self, meter: Meter, config: TelemetryConfig) -> None:
        self.naming = config.naming
        # Serialises writers (engines). Collection never takes it, so recording into the SDK
        # while holding it cannot deadlock with a reader's collect.
        self.lock = threading.Lock()
        self.recorders: "weakref.WeakSet[FastMetrics]" = weakref.WeakSet()
        self.cells: dict[tuple[str, tuple], HistogramCell] = {}
        # Cells exported from their creation, at zero until observed (show_zero_series).
        self.shown: set[int] = set()
        # Telemetries that keep event batches (TelemetryConfig.defer_steps): applied at collection.
        self.deferring: "weakref.WeakSet[Any]" = weakref.WeakSet()
        for m in METRICS:
            name = m.instrument_name(self.naming)
            if m.kind == "counter":
                meter.create_observable_counter(name, [self._counter_callback(m.key)], m.unit, m.meaning)
            elif m.kind == "gauge":
                meter.create_observable_gauge(name, [self._gauge_callback(m.key)], m.unit, m.meaning)
            else:
                meter.create_observable_counter(name, [self._histogram_callback(m.key)], m.unit, m.meaning)

    def cell(self, key: str, bounds: tuple[float, ...], attributes: dict[str, str],
             exponential: bool = False) -> HistogramCell:
        ident = (key, tuple(sorted(attributes.items())))
        cell = self.cells.get(ident)
        if cell is None:
            cell = self.cells[ident] = (ExponentialHistogramCell if exponential else HistogramCell)(bounds, attributes)
        return cell

    def before_collect(self) -> None:
        """Run by every callback (the SDK runs them before it reads any instrument): pending event
        batches applied. Never raises into the SDK's collection."""
        for telemetry in list(self.deferring):
            try:
                telemetry.apply_pending()
            except Exception:  # noqa: BLE001
                _log.warning("otel_llm: applying pending events at collection failed", exc_info=True)

    def _counter_callback(self, key: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        def callback(_: CallbackOptions) -> Iterator[Observation]:
            self.before_collect()
            totals: dict[tuple, tuple[dict[str, str], int]] = {}
            for recorder in list(self.recorders):
                for attrs, value in recorder.counter_values(key):
                    ident = tuple(sorted(attrs.items()))
                    previous = totals.get(ident)
                    totals[ident] = (attrs, value + (previous[1] if previous else 0))
            for attrs, value in totals.values():
                yield Observation(value, attrs)
        return callback

    def _gauge_callback(self, key: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        def callback(_: CallbackOptions) -> Iterator[Observation]:
            self.before_collect()
            for recorder in list(self.recorders):
                value = recorder.gauges.get(key)
                if value is not None:
                    yield Observation(value, recorder.attributes)
        return callback

    def _histogram_callback(self, key: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        def callback(_: CallbackOptions) -> Iterator[Observation]:
            self.before_collect()
            for (cell_key, _attrs), cell in list(self.cells.items()):
                if cell_key == key and (any(cell.counts) or id(cell) in self.shown):
                    yield cell.observation()
        return callback


_hubs: "weakref.WeakKeyDictionary[Any, _Hub]" = weakref.WeakKeyDictionary()
_hubs_lock = threading.Lock()


def _new_hubs_lock_after_fork() -> None:
    global _hubs_lock  # a child must not inherit it held by a parent's thread
    _hubs_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_hubs_lock_after_fork)


def _hub_for(meter_provider: MeterProvider, config: TelemetryConfig) -> _Hub:
    with _hubs_lock:
        hub = _hubs.get(meter_provider)
        if hub is None:
            hub = _hubs[meter_provider] = _Hub(meter_provider.get_meter(SCOPE, __version__), config)
        elif hub.naming != config.naming:
            raise ValueError(
                f"naming: {config.naming!r} differs from {hub.naming!r}, already used on this MeterProvider; "
                "one naming profile per provider"
            )
        return hub


class FastMetrics(Recorder):
    """Plain-Python accumulation on the hot path; the SDK reads it at collect time."""

    def __init__(self, meter_provider: MeterProvider, config: TelemetryConfig) -> None:
        self.hub = _hub_for(meter_provider, config)
        self.lock = self.hub.lock
        self.config = config
        self.attributes = base_attributes(config)
        self._reason_key = label_key(config, "reason")
        self._finish_key = label_key(config, "finished_reason")
        self._limit_reason = LabelLimiter(config.max_label_values)
        self._limit_finish = LabelLimiter(config.max_label_values)
        self.gauges: dict[str, float] = {}
        self.n_preemptions = 0
        self.n_recomputed = 0
        self.n_prompt = 0
        self.n_generation = 0
        self.by_reason: dict[str, int] = {}
        self.by_finish: dict[str, int] = {}
        # Every reason exported from the start at 0: Prometheus' increase() misses a counter
        # series whose first sample is already 1.
        self.drops: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        cell = self._cell
        self.h_ttft = cell("time_to_first_token_seconds")
        self.h_itl = cell("inter_token_latency_seconds")
        self.h_iteration = cell("iteration_tokens_total")
        self.request_cells = {k: cell(k) for k in _REQUEST_HISTOGRAMS}
        errors = error_attributes(config)
        # The same cells for a failed request, except error.type where the conventions ask for it.
        self.error_cells = ({k: cell(k, errors) if BY_KEY[k].error_type else c for k, c in self.request_cells.items()}
                            if errors else self.request_cells)
        self.h_preemptions = cell("request_num_preemptions")
        self.hub.recorders.add(self)

    def _cell(self, key: str, attributes: Optional[dict[str, str]] = None) -> HistogramCell:
        m = BY_KEY[key]
        return self.hub.cell(key, m.boundaries(self.config), attributes or self.attributes, m.exponential(self.config))

    def counter_values(self, key: str) -> Iterable[tuple[dict[str, str], int]]:
        if key == "num_preemptions":
            return [(self.attributes, self.n_preemptions)]
        if key == "num_recomputed_tokens":
            return [(self.attributes, self.n_recomputed)]
        if key == "prompt_tokens":
            return [(self.attributes, self.n_prompt)]
        if key == "generation_tokens":
            return [(self.attributes, self.n_generation)]
        labelled = {"num_preemptions_by_reason": (self.by_reason, self._reason_key),
                    "request_success": (self.by_finish, self._finish_key),
                    "dropped_events": (self.drops, "reason")}[key]
        values, label = labelled
        return [({**self.attributes, label: v}, n) for v, n in list(values.items())]

    def preempted(self, reason: str, num_computed_tokens: int) -> None:
        self.n_preemptions += 1
        self.n_recomputed += num_computed_tokens
        reason = self._limit_reason(reason)
        self.by_reason[reason] = self.by_reason.get(reason, 0) + 1

    def prompt_tokens(self, n: int) -> None:
        self.n_prompt += n

    def ttft(self, seconds: float, exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.h_ttft.observe(seconds, exemplar)

    def tokens(self, n: int, itl: Optional[float], exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.n_generation += n
        if itl is not None:
            self.h_itl.observe(itl, exemplar)

    def finished(self, values: dict[str, float], finish_reason: str, num_preemptions: int,
                 exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        reason = self._limit_finish(finish_reason)
        self.by_finish[reason] = self.by_finish.get(reason, 0) + 1
        cells = self.error_cells if finish_reason == "error" else self.request_cells
        for key, value in values.items():
            cells[key].observe(value, exemplar)
        self.h_preemptions.observe(num_preemptions, exemplar)

    def step(self, stats: StepStats) -> None:
        gauges = self.gauges
        gauges["num_requests_running"] = stats.num_running
        gauges["num_requests_waiting"] = stats.num_waiting
        gauges["kv_cache_usage_perc"] = stats.kv_cache_usage
        if stats.num_batched_tokens is not None:
            self.h_iteration.observe(stats.num_batched_tokens)

    def dropped(self, reason: str, n: int = 1) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + n

    def latencies(self, ttfts: Sequence[float], itls: Sequence[float], exemplar: Optional[ExemplarIds],
                  ctx: Any) -> None:
        if exemplar is None:
            self.h_ttft.observe_many(ttfts)
            self.h_itl.observe_many(itls)
            return
        for value in ttfts:
            self.h_ttft.observe(value, exemplar)
        for value in itls:
            self.h_itl.observe(value, exemplar)

    def show_zero_series(self, finish_reasons: Iterable[str], histograms: Iterable[str]) -> None:
        for reason in finish_reasons:
            reason = self._limit_finish(reason)
            self.by_finish.setdefault(reason, 0)
        for key in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            self.gauges.setdefault(key, 0)
        self.hub.shown.update(id(self._cell(key)) for key in histograms)


# Per-request histograms recorded at finish, by metric key (request_num_preemptions apart: an int).
_REQUEST_HISTOGRAMS = (
    "e2e_request_latency_seconds", "request_time_per_output_token_seconds", "request_queue_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
    "request_preempted_time_seconds", "request_prompt_tokens", "request_generation_tokens",
    "request_params_max_tokens",
)


# ---------------------------------------------------------------------------------------
# Straightforward path


class SdkMetrics(Recorder):
    """One SDK ``record``/``add``/``set`` per observation, attributes passed on every call."""

    def __init__(self, meter_provider: MeterProvider, config: TelemetryConfig) -> None:
        meter = meter_provider.get_meter(SCOPE, __version__)
        self.lock = threading.Lock()
        self.config = config
        self.attributes = base_attributes(config)
        self._error_attributes = error_attributes(config)
        self._reason_key = label_key(config, "reason")
        self._finish_key = label_key(config, "finished_reason")
        self._limit_reason = LabelLimiter(config.max_label_values)
        self._limit_finish = LabelLimiter(config.max_label_values)
        self.i: dict[str, Any] = {}
        for m in METRICS:
            name = m.instrument_name(config.naming)
            if m.kind == "counter":
                self.i[m.key] = meter.create_counter(name, m.unit, m.meaning)
            elif m.kind == "gauge":
                self.i[m.key] = meter.create_gauge(name, m.unit, m.meaning)
            else:
                self.i[m.key] = meter.create_histogram(name, m.unit, m.meaning)
        for reason in DROP_REASONS:
            self.i["dropped_events"].add(0, {**self.attributes, "reason": reason})

    def preempted(self, reason: str, num_computed_tokens: int) -> None:
        i, attrs = self.i, self.attributes
        i["num_preemptions"].add(1, attrs)
        i["num_preemptions_by_reason"].add(1, {**attrs, self._reason_key: self._limit_reason(reason)})
        i["num_recomputed_tokens"].add(num_computed_tokens, attrs)

    def prompt_tokens(self, n: int) -> None:
        self.i["prompt_tokens"].add(n, self.attributes)

    def ttft(self, seconds: float, exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.i["time_to_first_token_seconds"].record(seconds, self.attributes, context=ctx)

    def tokens(self, n: int, itl: Optional[float], exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        self.i["generation_tokens"].add(n, self.attributes)
        if itl is not None:
            self.i["inter_token_latency_seconds"].record(itl, self.attributes, context=ctx)

    def finished(self, values: dict[str, float], finish_reason: str, num_preemptions: int,
                 exemplar: Optional[ExemplarIds], ctx: Any) -> None:
        i, attrs = self.i, self.attributes
        i["request_success"].add(1, {**attrs, self._finish_key: self._limit_finish(finish_reason)})
        errors = self._error_attributes if finish_reason == "error" else None
        for key, value in values.items():
            i[key].record(value, errors if errors and BY_KEY[key].error_type else attrs, context=ctx)
        i["request_num_preemptions"].record(num_preemptions, attrs, context=ctx)

    def step(self, stats: StepStats) -> None:
        i, attrs = self.i, self.attributes
        i["num_requests_running"].set(stats.num_running, attrs)
        i["num_requests_waiting"].set(stats.num_waiting, attrs)
        i["kv_cache_usage_perc"].set(stats.kv_cache_usage, attrs)
        if stats.num_batched_tokens is not None:
            i["iteration_tokens_total"].record(stats.num_batched_tokens, attrs)

    def dropped(self, reason: str, n: int = 1) -> None:
        self.i["dropped_events"].add(n, {**self.attributes, "reason": reason})

    def latencies(self, ttfts: Sequence[float], itls: Sequence[float], exemplar: Optional[ExemplarIds],
                  ctx: Any) -> None:
        for value in ttfts:
            self.ttft(value, exemplar, ctx)
        for value in itls:
            self.tokens(0, value, exemplar, ctx)

    def show_zero_series(self, finish_reasons: Iterable[str], histograms: Iterable[str]) -> None:
        # An SDK histogram has no point before its first record: only the counter's series.
        for reason in finish_reasons:
            self.i["request_success"].add(0, {**self.attributes, self._finish_key: self._limit_finish(reason)})
