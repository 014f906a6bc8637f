"""The metrics, declared once as data.

``METRICS`` is the single table (name per naming profile, instrument kind, unit, buckets,
extra label, meaning); the README's metric table is kept in step with it by a test. The
Views (metric_views), both recorders (recorder) and the vLLM mirror are built from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from otel_llm.config import buckets
from otel_llm.config.settings import TelemetryConfig
from otel_llm.events import CAUSE_UNKNOWN

SCOPE = "otel_llm"


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
    # extra label: "finished_reason", "reason", "cause", "cause_tenant" or "drop_reason" (label_key)
    label: Optional[str] = None
    # With a tenant source (OTEL_LLM_TENANT), labelled by the request's tenant too: summed over
    # tenant, the series equals the one without a tenant source.
    per_tenant: bool = False
    error_type: bool = False  # semconv: a failed request's observation carries error.type
    explicit_only: bool = False  # explicit buckets even when histograms go out exponential: they are the point
    # Where the recorders take the value from (routing, declared here rather than in each recorder):
    # a RequestSummary field at each finished request (not observed when None, nor when the field
    # ``observed_if`` names is 0), or a StepStats field at each engine step (not observed when None).
    summary_field: Optional[str] = None
    observed_if: Optional[str] = None
    step_field: Optional[str] = None

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
    MetricDef(
        "request_num_preemptions",
        "histogram",
        "{preemption}",
        "vllm:request_num_preemptions",
        "llm.server.request.num_preemptions",
        "Preemptions per finished request, zero included (le=0.5: never preempted).",
        buckets=lambda c: c.preemption_buckets,
        explicit_only=True,
        summary_field="num_preemptions",
        per_tenant=True,
    ),
    MetricDef(
        "request_num_preemptions_caused",
        "histogram",
        "{preemption}",
        "vllm:request_num_preemptions_caused",
        "llm.server.request.num_preemptions_caused",
        "Preemptions a finished request's KV demand caused (of other requests or itself), zero "
        "included (le=0.5: evicted nobody).",
        buckets=lambda c: c.preemption_buckets,
        explicit_only=True,
        summary_field="num_preemptions_caused",
        per_tenant=True,
    ),
    MetricDef(
        "num_preemptions",
        "counter",
        "{preemption}",
        "vllm:num_preemptions",
        "llm.server.preemptions",
        "Preemptions (all requests).",
    ),
    MetricDef(
        "num_preemptions_by_reason",
        "counter",
        "{preemption}",
        "vllm:num_preemptions_by_reason",
        "llm.server.preemptions.by_reason",
        "Preemptions by reason (e.g. kv_cache_full).",
        label="reason",
    ),
    MetricDef(
        "num_preemptions_by_cause",
        "counter",
        "{preemption}",
        "vllm:num_preemptions_by_cause",
        "llm.server.preemptions.by_cause",
        "Preemptions of finished requests by cause: request (another request's KV demand), self, "
        "cache_reset, unknown (counted when the preempted request finishes).",
        label="cause",
    ),
    MetricDef(
        "num_preemptions_by_tenant",
        "counter",
        "{preemption}",
        "vllm:num_preemptions_by_tenant",
        "llm.server.preemptions.by_tenant",
        "Preemptions by the victim's tenant and the tenant of the request whose KV demand caused it "
        "(cause_tenant: the victim's own when it preempted itself, none for a cache reset or an unknown "
        "cause); only with a tenant source (OTEL_LLM_TENANT).",
        label="cause_tenant",
        per_tenant=True,
    ),
    MetricDef(
        "num_recomputed_tokens",
        "counter",
        "{token}",
        "vllm:num_recomputed_tokens",
        "llm.server.recomputed_tokens",
        "Computed tokens thrown away by preemptions, to be recomputed.",
    ),
    MetricDef(
        "prompt_tokens",
        "counter",
        "{token}",
        "vllm:prompt_tokens",
        "llm.server.prompt_tokens",
        "Prefill tokens processed (counted at each request's first token).",
        per_tenant=True,
    ),
    MetricDef(
        "generation_tokens",
        "counter",
        "{token}",
        "vllm:generation_tokens",
        "llm.server.generation_tokens",
        "Generation tokens produced.",
        per_tenant=True,
    ),
    MetricDef(
        "aborted_generation_tokens",
        "counter",
        "{token}",
        "vllm:aborted_generation_tokens",
        "llm.server.aborted.generation_tokens",
        "Output tokens produced by requests that were then aborted (counted at their finish; the "
        "aborted requests are request_success with finish reason abort).",
        per_tenant=True,
    ),
    MetricDef(
        "request_success",
        "counter",
        "{request}",
        "vllm:request_success",
        "llm.server.requests",
        "Finished requests by finish reason.",
        label="finished_reason",
        per_tenant=True,
    ),
    MetricDef(
        "dropped_events",
        "counter",
        "{event}",
        "otel_llm.dropped_events",
        "otel_llm.dropped_events",
        "What the telemetry lost, by reason: invalid or impossible events, evicted requests, "
        "spans and metric points the export path dropped.",
        label="drop_reason",
    ),
    MetricDef(
        "num_requests_running",
        "gauge",
        "{request}",
        "vllm:num_requests_running",
        "llm.server.requests.running",
        "Requests running in the last engine step.",
        step_field="num_running",
    ),
    MetricDef(
        "num_requests_waiting",
        "gauge",
        "{request}",
        "vllm:num_requests_waiting",
        "llm.server.requests.waiting",
        "Requests waiting in the last engine step.",
        step_field="num_waiting",
    ),
    MetricDef(
        "kv_cache_usage_perc",
        "gauge",
        "",
        "vllm:kv_cache_usage_perc",
        "llm.server.kv_cache.usage",
        "KV-cache usage, 0 to 1 (1 = full).",
        step_field="kv_cache_usage",
    ),
    MetricDef(
        "e2e_request_latency_seconds",
        "histogram",
        "s",
        "vllm:e2e_request_latency_seconds",
        "gen_ai.server.request.duration",
        "Arrival to finish.",
        buckets=_latency,
        semconv_buckets=buckets.GENAI_REQUEST_DURATION,
        error_type=True,
        summary_field="e2e",
        per_tenant=True,
    ),
    MetricDef(
        "time_to_first_token_seconds",
        "histogram",
        "s",
        "vllm:time_to_first_token_seconds",
        "gen_ai.server.time_to_first_token",
        "Arrival to first output token.",
        buckets=_const(buckets.TIME_TO_FIRST_TOKEN),
        semconv_buckets=buckets.GENAI_TIME_TO_FIRST_TOKEN,
        per_tenant=True,
    ),
    MetricDef(
        "inter_token_latency_seconds",
        "histogram",
        "s",
        "vllm:inter_token_latency_seconds",
        "llm.server.inter_token_latency",
        "Between consecutive output steps of a request (one per step).",
        buckets=_const(buckets.INTER_TOKEN_LATENCY),
        per_tenant=True,
    ),
    MetricDef(
        "request_time_per_output_token_seconds",
        "histogram",
        "s",
        "vllm:request_time_per_output_token_seconds",
        "gen_ai.server.time_per_output_token",
        "Decode time / (output tokens - 1), per request (0 for a single token).",
        buckets=_const(buckets.INTER_TOKEN_LATENCY),
        semconv_buckets=buckets.GENAI_TIME_PER_OUTPUT_TOKEN,
        summary_field="time_per_output_token",
        per_tenant=True,
    ),
    MetricDef(
        "request_queue_time_seconds",
        "histogram",
        "s",
        "vllm:request_queue_time_seconds",
        "llm.server.request.queue_time",
        "First QUEUED (or ARRIVED) to first SCHEDULED.",
        buckets=_latency,
        summary_field="queue_time",
        per_tenant=True,
    ),
    MetricDef(
        "request_prefill_time_seconds",
        "histogram",
        "s",
        "vllm:request_prefill_time_seconds",
        "llm.server.request.prefill_time",
        "First SCHEDULED to first token (preemptions included).",
        buckets=_latency,
        summary_field="prefill_time",
    ),
    MetricDef(
        "request_decode_time_seconds",
        "histogram",
        "s",
        "vllm:request_decode_time_seconds",
        "llm.server.request.decode_time",
        "First token to last token (preemptions included).",
        buckets=_latency,
        summary_field="decode_time",
    ),
    MetricDef(
        "request_inference_time_seconds",
        "histogram",
        "s",
        "vllm:request_inference_time_seconds",
        "llm.server.request.inference_time",
        "First SCHEDULED to last token.",
        buckets=_latency,
        summary_field="inference_time",
    ),
    MetricDef(
        "request_preempted_time_seconds",
        "histogram",
        "s",
        "vllm:request_preempted_time_seconds",
        "llm.server.request.preempted_time",
        "Time spent back in the queue after preemptions, per request preempted at least once.",
        buckets=_latency,
        summary_field="preempted_time",
        observed_if="num_preemptions",
    ),
    MetricDef(
        "request_prompt_tokens",
        "histogram",
        "{token}",
        "vllm:request_prompt_tokens",
        "llm.server.request.prompt_tokens",
        "Prompt tokens per finished request.",
        buckets=request_token_buckets,
        summary_field="prompt_tokens",
    ),
    MetricDef(
        "request_generation_tokens",
        "histogram",
        "{token}",
        "vllm:request_generation_tokens",
        "llm.server.request.generation_tokens",
        "Output tokens per finished request.",
        buckets=request_token_buckets,
        summary_field="generation_tokens",
    ),
    MetricDef(
        "request_params_max_tokens",
        "histogram",
        "{token}",
        "vllm:request_params_max_tokens",
        "llm.server.request.max_tokens",
        "The max_tokens parameter per finished request (when set).",
        buckets=request_token_buckets,
        summary_field="max_tokens",
        observed_if="max_tokens",
    ),
    MetricDef(
        "iteration_tokens_total",
        "histogram",
        "{token}",
        "vllm:iteration_tokens_total",
        "llm.server.iteration.tokens",
        "Tokens computed per engine step (prefill + decode).",
        buckets=_const(buckets.ITERATION_TOKENS),
        step_field="num_batched_tokens",
    ),
)
BY_KEY = {m.key: m for m in METRICS}
PER_TENANT = frozenset(m.key for m in METRICS if m.per_tenant)
# Counted only with a tenant source: no series at all without one.
TENANT_ONLY = frozenset(("num_preemptions_by_tenant", "aborted_generation_tokens"))
# Observed at each finished request: (metric key, RequestSummary field, field that must be non-zero).
FINISH_OBSERVATIONS = tuple((m.key, m.summary_field, m.observed_if) for m in METRICS if m.summary_field)
# Set or observed at each engine step: (metric key, StepStats field).
STEP_GAUGES = tuple((m.key, m.step_field) for m in METRICS if m.step_field and m.kind == "gauge")
STEP_HISTOGRAMS = tuple((m.key, m.step_field) for m in METRICS if m.step_field and m.kind == "histogram")


def preemptions_by_cause(summary: Any) -> Iterator[tuple[str, int]]:
    """(cause kind, preemptions) of a finished request (a RequestSummary): what its source
    attributed, and the rest as unknown."""
    attributed = 0
    for kind, n in summary.preemptions_by_cause:
        if n > 0:
            attributed += n
            yield kind, n
    if summary.num_preemptions > attributed:
        yield CAUSE_UNKNOWN, summary.num_preemptions - attributed


def finish_values(summary: Any) -> Iterator[tuple[str, float]]:
    """(metric key, value) of each observation a finished request makes (a RequestSummary)."""
    for key, field, observed_if in FINISH_OBSERVATIONS:
        if observed_if is not None and not getattr(summary, observed_if):
            continue
        value = getattr(summary, field)
        if value is not None:
            yield key, value


_LABEL_KEYS = {
    "vllm": {
        "model": "model_name",
        "engine": "engine",
        "finished_reason": "finished_reason",
        "reason": "reason",
        "cause": "cause",
        "drop_reason": "reason",
        "tenant": "tenant",
        "cause_tenant": "cause_tenant",
    },
    "semconv": {
        "model": "gen_ai.request.model",
        "engine": "llm.engine",
        "finished_reason": "gen_ai.response.finish_reason",
        "reason": "llm.preemption.reason",
        "cause": "llm.preemption.cause",
        "drop_reason": "reason",
        "tenant": "llm.tenant",
        "cause_tenant": "llm.cause.tenant",
    },
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
    """The attribute name of a metric's extra label (``MetricDef.label``) in the config's profile."""
    return _LABEL_KEYS[config.naming][label]
