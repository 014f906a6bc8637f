"""Which field of vLLM's stats feeds which of otel-llm's, for both paths: ``SchedulerStats``
(:func:`scheduler_gauges`, the gauges of a :class:`~otel_llm.events.StepStats`), ``IterationStats``
(per-iteration observations) and ``FinishedRequestStats`` (a request's summary), as tables
(:data:`FINISHED_DURATIONS`, :data:`ITERATION_COUNTS`, ...) read through
:class:`~otel_llm.integrations.vllm.translation.fields.FieldReader`: a field gone degrades the
metric the table names, with one warning; and vLLM's histogram bucket families
(:data:`BUCKET_FAMILIES`, ``--custom-histogram-buckets``). The stat-logger path applies them in
:mod:`~otel_llm.integrations.vllm.frontend.step_translator`, the engine-core stream in
:mod:`.stream_translate`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from otel_llm.integrations.vllm.translation.fields import FieldReader

DEFAULT_PREEMPTION_REASON = "kv_cache_full"  # vLLM preempts for KV cache space only


class Field(NamedTuple):
    ours: str  # the RequestSummary field, or record_iteration / StepStats argument
    vllm: str  # the attribute of vLLM's stats object
    metric: str  # what is not recorded without it (named in the warning)


# FinishedRequestStats -> RequestSummary: durations (seconds, as given) and counts (ints).
FINISHED_DURATIONS = (
    Field("queue_time", "queued_time", "vllm:request_queue_time_seconds"),
    Field("prefill_time", "prefill_time", "vllm:request_prefill_time_seconds"),
    Field("decode_time", "decode_time", "vllm:request_decode_time_seconds"),
    Field("inference_time", "inference_time", "vllm:request_inference_time_seconds"),
    Field("time_per_output_token", "mean_time_per_output_token", "vllm:request_time_per_output_token_seconds"),
)
FINISHED_COUNTS = (
    Field("prompt_tokens", "num_prompt_tokens", "vllm:request_prompt_tokens"),
    Field("generation_tokens", "num_generation_tokens", "vllm:request_generation_tokens"),
)
# IterationStats -> EngineTelemetry.record_iteration: per-step latencies and counts.
ITERATION_LATENCIES = (
    Field("ttfts", "time_to_first_tokens_iter", "vllm:time_to_first_token_seconds"),
    Field("itls", "inter_token_latencies_iter", "vllm:inter_token_latency_seconds"),
)
ITERATION_COUNTS = (
    Field("prompt_tokens", "num_prompt_tokens", "vllm:prompt_tokens"),
    Field("generation_tokens", "num_generation_tokens", "vllm:generation_tokens"),
    Field("num_preemptions", "num_preempted_reqs", "vllm:num_preemptions"),
)
# SchedulerStats -> StepStats (vLLM's waiting gauge counts the deferred, "skipped", ones too).
SCHEDULER_FIELDS = (
    Field("num_running", "num_running_reqs", "vllm:num_requests_running"),
    Field("num_waiting", "num_waiting_reqs", "vllm:num_requests_waiting"),
    Field("kv_cache_usage", "kv_cache_usage", "vllm:kv_cache_usage_perc"),
)


def scheduler_gauges(reader: FieldReader, sched: Any, last: tuple[int, int, float]) -> tuple[int, int, float]:
    """vLLM's ``SchedulerStats`` as (running, waiting, KV cache usage), for either path: waiting
    counts the deferred ("skipped") requests too, as vLLM's gauge does; a field gone keeps its
    ``last`` value (said once through ``reader``)."""
    running, waiting, usage = last
    run_f, wait_f, usage_f = SCHEDULER_FIELDS
    v = reader.number(sched, run_f.vllm, run_f.metric)
    running = int(v) if v is not None else running
    w = reader.number(sched, wait_f.vllm, wait_f.metric)
    skipped = getattr(sched, "num_skipped_waiting_reqs", 0)
    if type(skipped) is not int:
        skipped = 0
    waiting = int(w) + skipped if w is not None else waiting
    u = reader.number(sched, usage_f.vllm, usage_f.metric)
    usage = float(u) if u is not None else usage
    return running, waiting, usage


# vLLM's histogram bucket families (``--custom-histogram-buckets`` keys) and the series of each
# that otel-llm records, as vLLM's PrometheusStatLogger assigns them.
BUCKET_FAMILIES: dict[str, tuple[str, ...]] = {
    "request_latency": (
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
    ),
    "time_to_first_token": ("vllm:time_to_first_token_seconds",),
    "inter_token_latency": ("vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds"),
    "iteration_tokens": ("vllm:iteration_tokens_total",),
    "request_num_preemptions": ("vllm:request_num_preemptions",),
    "request_tokens": (
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_params_max_tokens",
    ),
}


def custom_buckets(vllm_config: Any) -> dict[str, list[float]]:
    """vLLM's ``--custom-histogram-buckets`` (family -> boundaries), as vLLM validated them."""
    custom = getattr(getattr(vllm_config, "observability_config", None), "custom_histogram_buckets", None)
    return {str(k): [float(b) for b in v] for k, v in custom.items()} if isinstance(custom, dict) else {}
