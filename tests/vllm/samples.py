"""Both sides as Prometheus-style samples: {(sample name, frozenset(labels)): value}."""

from __future__ import annotations

import math
from typing import Any, Sequence

Key = tuple[str, frozenset]


def _le(bound: float) -> float:
    return float(bound)


def vllm_samples(families: set[str]) -> dict[Key, float]:
    """vLLM's PrometheusStatLogger, from prometheus_client's global registry."""
    from prometheus_client import REGISTRY

    out: dict[Key, float] = {}
    for metric in REGISTRY.collect():
        if metric.name not in families:
            continue
        for s in metric.samples:
            if s.name.endswith("_created"):
                continue
            labels = dict(s.labels)
            if "le" in labels:
                labels["le"] = _le(float(labels["le"]))
            out[(s.name, frozenset(labels.items()))] = float(s.value)
    return out


def otel_samples(reader: Any, families: set[str]) -> dict[Key, float]:
    """Ours, from an InMemoryMetricReader, in the same shape (cumulative ``le`` buckets)."""
    from opentelemetry.sdk.metrics.export import Gauge, Histogram, Sum

    data = reader.get_metrics_data()
    out: dict[Key, float] = {}
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name not in families:
                    continue
                for p in m.data.data_points:
                    labels = {k: str(v) for k, v in p.attributes.items()}
                    if isinstance(m.data, Histogram):
                        running = 0
                        for bound, n in zip(list(p.explicit_bounds) + [math.inf], p.bucket_counts):
                            running += n
                            le = frozenset({**labels, "le": _le(bound)}.items())
                            out[(m.name + "_bucket", le)] = float(running)
                        out[(m.name + "_sum", frozenset(labels.items()))] = float(p.sum)
                        out[(m.name + "_count", frozenset(labels.items()))] = float(p.count)
                    elif isinstance(m.data, Sum):
                        out[(m.name + "_total", frozenset(labels.items()))] = float(p.value)
                    elif isinstance(m.data, Gauge):
                        out[(m.name, frozenset(labels.items()))] = float(p.value)
    return out


def otel_family_names(reader: Any) -> set[str]:
    data = reader.get_metrics_data()
    return {m.name for rm in (data.resource_metrics if data else ()) for sm in rm.scope_metrics for m in sm.metrics}


def finished_request(**overrides: Any) -> Any:
    """vLLM's FinishedRequestStats of one request (4 tokens, 2 preemptions), fields overridable."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import FinishedRequestStats

    values = dict(
        finish_reason=FinishReason.LENGTH,
        request_id="q1",
        e2e_latency=1.25,
        num_prompt_tokens=10,
        num_preemptions=2,
        num_generation_tokens=4,
        max_tokens_param=4,
        queued_time=0.5,
        prefill_time=0.25,
        inference_time=0.7,
        decode_time=0.45,
        mean_time_per_output_token=0.15,
    )
    values.update(overrides)
    return FinishedRequestStats(**values)


def iteration_stats(finished: Any = ()) -> Any:
    """vLLM's IterationStats of one step (3 tokens, one preemption) with ``finished`` requests."""
    from vllm.v1.metrics.stats import IterationStats

    it = IterationStats()
    it.num_generation_tokens = 3
    it.prompt_token_stats.computed = it.prompt_token_stats.total = 10
    it.time_to_first_tokens_iter = [0.2]
    it.inter_token_latencies_iter = [0.05, 0.06]
    it.num_preempted_reqs = 1
    it.finished_requests = list(finished)
    return it


def plugin_manager(vllm_config: Any, engine_idxs: Sequence[int] = (0,)) -> tuple[Any, Any]:
    """vLLM's StatLoggerManager with the stat-logger plugins loaded as vLLM loads them (vLLM's own
    loggers only where the plugin builds them), and our logger in it."""
    from vllm.v1.metrics.loggers import StatLoggerManager, load_stat_logger_plugin_factories

    from otel_llm.integrations.vllm import OtelStatLogger

    manager = StatLoggerManager(
        vllm_config,
        engine_idxs=list(engine_idxs),
        custom_stat_loggers=load_stat_logger_plugin_factories(),
        enable_default_loggers=False,
    )
    (ours,) = [s for s in manager.stat_loggers if isinstance(s, OtelStatLogger)]
    return manager, ours
