"""Parity: the same real engine-core stream, through vLLM's real OutputProcessor / IterationStats
and StatLoggerManager.record(), gives the same numbers in our metrics as in vLLM's own
PrometheusStatLogger (every vLLM metric that otel-llm reproduces)."""

from __future__ import annotations

import time

import pytest
from conftest import VLLM_PREEMPTION_BUCKETS
from samples import otel_family_names, otel_samples, plugin_manager, vllm_samples

from otel_llm.testing.vllm.stream import build, default_specs, run

# The vLLM metrics otel-llm's core telemetry reproduces (vllm naming profile); vLLM's logger
# code records the others (otel_llm.integrations.vllm.series.series).
CORE = {
    "vllm:request_num_preemptions",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:e2e_request_latency_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:iteration_tokens_total",
}


def _manager(vllm_config):
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    manager, ours = plugin_manager(vllm_config, [0, 1])
    theirs = [s for s in manager.stat_loggers if isinstance(s, PrometheusStatLogger)]
    assert len(theirs) == 1, manager.stat_loggers
    return manager, ours


def _run_two_engines(vllm_config):
    manager, ours = _manager(vllm_config)
    now_m, now_w = time.monotonic(), time.time()
    streams = {0: build(default_specs("e0-"), now_m, now_w), 1: build(default_specs("e1-")[:4], now_m, now_w)}
    run(manager, streams)
    return manager, ours, streams


@pytest.mark.parametrize("deep_hook", ["off", "on"])
def test_parity_with_vllm_prometheus_logger(otel, vllm_config, monkeypatch, deep_hook):
    if deep_hook == "on":
        monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    o = otel(preemption_buckets=VLLM_PREEMPTION_BUCKETS)
    manager, ours, streams = _run_two_engines(vllm_config)
    manager.log_engine_initialized()  # as AsyncLLM does at start: vLLM's cache_config_info
    from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook

    assert vllm_deep_hook.is_installed() == (deep_hook == "on")
    assert ours.field_warnings == frozenset()

    from prometheus_client import REGISTRY

    vllm_families = {m.name for m in REGISTRY.collect() if m.name.startswith("vllm:")}
    assert CORE < vllm_families
    assert vllm_families <= otel_family_names(o.reader)  # every family, not only the core ones

    expected = vllm_samples(vllm_families)
    got = otel_samples(o.reader, vllm_families)
    # Every series, the zero series vLLM creates at start included, with vLLM's value.
    missing = sorted(set(expected) - set(got))
    mismatches = {k: (v, got[k]) for k, v in expected.items() if k in got and got[k] != v}
    extra = set(got) - set(expected)
    assert not missing, missing[:10]
    assert not mismatches, mismatches
    assert not extra, extra

    # Not vacuous: the numbers that the stream implies.
    model = vllm_config.model_config.served_model_name
    e0 = frozenset({"model_name": model, "engine": "0"}.items())
    e1 = frozenset({"model_name": model, "engine": "1"}.items())
    assert got[("vllm:request_num_preemptions_count", e0)] == 7
    assert got[("vllm:request_num_preemptions_count", e1)] == 4
    assert got[("vllm:request_num_preemptions_sum", e0)] == 0 + 0 + 1 + 2 + 7 + 1 + 0
    assert got[("vllm:num_preemptions_total", e0)] == 11
    assert got[("vllm:num_preemptions_total", e1)] == 3
    le = lambda base, v: frozenset(dict(base, le=float(v)).items())  # noqa: E731 - a one-line key builder
    assert [got[("vllm:request_num_preemptions_bucket", le(e0, b))] for b in (1, 2, 3, 10, float("inf"))] == [
        5,
        6,
        6,
        7,
        7,
    ]
    assert got[("vllm:prompt_tokens_total", e0)] == sum(s.prompt for s in streams[0].specs)
    assert got[("vllm:generation_tokens_total", e0)] == sum(s.tokens for s in streams[0].specs)
    success = {
        dict(k[1]).get("finished_reason"): v
        for k, v in got.items()
        if k[0] == "vllm:request_success_total" and k[1] >= e0 and dict(k[1])["engine"] == "0"
    }
    assert success == {"length": 4, "stop": 2, "abort": 1, "error": 0, "repetition": 0}
    # max_tokens unset on one request: observed by neither.
    assert got[("vllm:request_params_max_tokens_count", e0)] == 6
    manager.log()  # the other StatLoggerBase methods, as AsyncLLM calls them


def test_never_preempted_bucket_beyond_vllm(otel, vllm_config):
    """Our default boundaries (0.5, 1, 2, ...): le=0.5 holds exactly the never-preempted requests,
    which vLLM's le=1 lumps with the once-preempted ones. Same counts and sum otherwise."""
    o = otel()  # default preemption buckets
    _run_two_engines(vllm_config)
    family = {"vllm:request_num_preemptions"}
    got = otel_samples(o.reader, family)
    theirs = vllm_samples(family)
    model = vllm_config.model_config.served_model_name
    e0 = frozenset({"model_name": model, "engine": "0"}.items())
    le = lambda v: frozenset(dict(e0, le=float(v)).items())  # noqa: E731 - a one-line key builder
    assert got[("vllm:request_num_preemptions_bucket", le(0.5))] == 3  # e0-r0, e0-r0b, e0-r0c
    assert got[("vllm:request_num_preemptions_bucket", le(1))] == 5
    assert theirs[("vllm:request_num_preemptions_bucket", le(1))] == 5  # vLLM: 0 and 1 together
    for suffix in ("_sum", "_count"):
        key = ("vllm:request_num_preemptions" + suffix, e0)
        assert got[key] == theirs[key]


def test_an_iteration_without_tokens_is_observed_as_zero(otel, vllm_config):
    """vLLM observes ``iteration_tokens_total`` for every iteration that has outputs, also one
    that computed no token (an error finish with no new token is the only output of the step):
    a StepStats with ``num_batched_tokens=0`` is observed too, so every sample stays equal."""
    from otel_llm.testing.vllm.stream import Spec

    o = otel(preemption_buckets=VLLM_PREEMPTION_BUCKETS)
    manager, _ = _manager(vllm_config)
    specs = [
        Spec("ok", arrive=0, queue=0, prompt=10, tokens=3, max_tokens=3),
        Spec("err", arrive=10, queue=0, prompt=10, tokens=2, finish="error", empty_last=True),
    ]
    run(manager, {0: build(specs, time.monotonic(), time.time())})
    expected = vllm_samples(CORE)
    got = otel_samples(o.reader, CORE)
    diff = {k: (v, got.get(k, 0.0)) for k, v in expected.items() if got.get(k, 0.0) != v}
    assert not diff
    zero_bucket = [
        v
        for (name, labels), v in got.items()
        if name == "vllm:iteration_tokens_total_bucket" and dict(labels).get("le") == 1.0
    ]
    assert zero_bucket and zero_bucket[0] >= 1  # the 0-token iteration is in le=1
