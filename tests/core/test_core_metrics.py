"""Scripted request lifecycles with known answers, through EngineTelemetry into an in-memory reader."""

from __future__ import annotations

import logging

import pytest

import otel_llm
from otel_llm import StepStats, TelemetryConfig
from otel_llm.catalogue.metrics import METRICS, TENANT_ONLY
from otel_llm.testing import in_memory_telemetry, lifecycle
from tests.support.otel_helpers import BOTH_PATHS, FAST, SDK, E, RequestEvent

COUNTS = (0, 0, 1, 2, 2, 3, 7, 25)


def run(r, counts=COUNTS, t0=100.0):
    for i, k in enumerate(counts):
        r.telemetry.on_events(lifecycle(f"r{i}", t0 + i, preemptions=k))


@BOTH_PATHS
def test_preemption_histogram_exact(paths):
    r = in_memory_telemetry(**paths)
    run(r)
    p = r.point("vllm:request_num_preemptions", model_name="tiny", engine="0")
    assert p.explicit_bounds == (0.5, 1, 2, 3, 4, 5, 10, 20)
    assert p.bucket_counts == (2, 1, 2, 1, 0, 0, 1, 0, 1)
    assert p.count == 8 and p.sum == 40
    assert (p.min, p.max) == (0, 25)


def test_counters_equal_event_totals():
    r = in_memory_telemetry()
    run(r)
    assert r.point("vllm:num_preemptions").value == 40
    assert r.point("vllm:num_preemptions_by_reason", reason="kv_cache_full").value == 40
    # lifecycle() throws away prompt_tokens + k computed tokens at the k-th preemption (k from 0).
    assert r.point("vllm:num_recomputed_tokens").value == sum(10 * k + k * (k - 1) // 2 for k in COUNTS)
    assert r.point("vllm:prompt_tokens").value == 8 * 10
    assert r.point("vllm:generation_tokens").value == 8 * 3
    assert r.point("vllm:request_success", finished_reason="stop").value == 8


@BOTH_PATHS
def test_counters_keep_their_totals_after_the_telemetry_is_shut_down_and_let_go(paths):
    """The provider's exports after a telemetry ended (its final one at shutdown) still count
    what it recorded: a cumulative counter never falls back."""
    import gc

    r = in_memory_telemetry(**paths)
    run(r)
    r.telemetry.on_events(lifecycle("cut", 200.0)[:3])  # arrived, queued, scheduled: in flight
    assert r.telemetry.shutdown() == 1
    assert r.telemetry.shutdown() == 0
    r.telemetry = None  # type: ignore[assignment]  # nothing holds the telemetry any more
    gc.collect()
    assert r.point("vllm:request_success", finished_reason="stop").value == 8
    assert r.point("vllm:num_preemptions").value == 40
    assert r.point("vllm:request_num_preemptions").count == 8


def test_derived_latencies_exact():
    r = in_memory_telemetry()
    t0 = 50.0
    r.telemetry.on_events(
        [
            RequestEvent(E.ARRIVED, "a", t0, prompt_tokens=7, max_tokens=9),
            RequestEvent(E.QUEUED, "a", t0 + 0.5),
            RequestEvent(E.SCHEDULED, "a", t0 + 1.0),
            RequestEvent(E.PREEMPTED, "a", t0 + 1.5, num_computed_tokens=7, reason="kv_cache_full"),
            RequestEvent(E.SCHEDULED, "a", t0 + 4.0),
            RequestEvent(E.TOKENS, "a", t0 + 5.0, num_tokens=1),
            RequestEvent(E.TOKENS, "a", t0 + 5.5, num_tokens=2),
            RequestEvent(E.TOKENS, "a", t0 + 7.0, num_tokens=1),
            RequestEvent(E.FINISHED, "a", t0 + 8.0, finish_reason="length"),
        ]
    )
    one = {
        "vllm:e2e_request_latency_seconds": 8.0,
        "vllm:request_queue_time_seconds": 0.5,  # first SCHEDULED - QUEUED
        "vllm:time_to_first_token_seconds": 5.0,
        "vllm:request_prefill_time_seconds": 4.0,
        "vllm:request_decode_time_seconds": 2.0,
        "vllm:request_inference_time_seconds": 6.0,
        "vllm:request_time_per_output_token_seconds": 2.0 / 3,  # decode / (4 tokens - 1)
        "vllm:request_preempted_time_seconds": 2.5,
        "vllm:request_prompt_tokens": 7,
        "vllm:request_generation_tokens": 4,
        "vllm:request_params_max_tokens": 9,
    }
    for name, value in one.items():
        p = r.point(name)
        assert (p.count, p.sum) == (1, pytest.approx(value)), name
    itl = r.point("vllm:inter_token_latency_seconds")
    assert (itl.count, itl.sum, itl.min, itl.max) == (2, pytest.approx(2.0), 0.5, 1.5)
    assert r.point("vllm:request_success", finished_reason="length").value == 1


def test_never_preempted_requests_skip_preempted_time():
    r = in_memory_telemetry()
    run(r, counts=(0, 0, 3))
    assert r.point("vllm:request_preempted_time_seconds").count == 1
    assert r.point("vllm:request_num_preemptions").bucket_counts[0] == 2


def test_gauges_and_iteration_tokens_from_step_stats():
    r = in_memory_telemetry()
    r.telemetry.on_step(StepStats(1.0, num_running=3, num_waiting=5, kv_cache_usage=0.75, num_batched_tokens=100))
    r.telemetry.on_step(StepStats(2.0, num_running=2, num_waiting=1, kv_cache_usage=0.5, num_batched_tokens=8))
    assert r.point("vllm:num_requests_running").value == 2
    assert r.point("vllm:num_requests_waiting").value == 1
    assert r.point("vllm:kv_cache_usage_perc").value == 0.5
    it = r.point("vllm:iteration_tokens_total")
    assert (it.count, it.sum) == (2, 108)
    assert it.bucket_counts[1] == 1 and it.bucket_counts[5] == 1  # le=8 and le=128


def test_configured_buckets_are_used():
    r = in_memory_telemetry(TelemetryConfig(model_name="m", preemption_buckets=(1, 2, 3, 4, 5, 10, 20)))
    run(r)
    p = r.point("vllm:request_num_preemptions")
    assert p.explicit_bounds == (1, 2, 3, 4, 5, 10, 20)
    assert p.bucket_counts == (3, 2, 1, 0, 0, 1, 0, 1)


@BOTH_PATHS
def test_histogram_buckets_replace_a_histograms_defaults(paths):
    config = TelemetryConfig(model_name="m", histogram_buckets={"e2e_request_latency_seconds": (0.05, 0.1)})
    r = in_memory_telemetry(config, **paths)
    run(r)  # lifecycle(): a request lasts 0.09 s + 5 ms per preemption: 0.09 ... 0.1 for k <= 2
    p = r.point("vllm:e2e_request_latency_seconds")
    assert p.explicit_bounds == (0.05, 0.1)
    assert p.bucket_counts == (0, 5, 3)
    assert r.point("vllm:request_queue_time_seconds").explicit_bounds[:2] == (0.3, 0.5)  # the others unchanged


def test_histogram_buckets_are_validated():
    with pytest.raises(ValueError, match=r"histogram_buckets\['e2e_request_latency_seconds'\].*<= 0"):
        TelemetryConfig(histogram_buckets={"e2e_request_latency_seconds": (0, 1)})
    for key in ("no_such_metric", "num_preemptions", "request_num_preemptions"):
        with pytest.raises(ValueError, match="not histogram keys"):
            otel_llm.views(TelemetryConfig(histogram_buckets={key: (1, 2)}))


def test_show_zero_series_exports_the_named_series_at_zero_before_any_request():
    r = in_memory_telemetry()
    r.telemetry.metrics.show_zero_series(["stop", "length", "abort"], ["request_num_preemptions"])
    p = r.point("vllm:request_num_preemptions")
    assert (p.count, p.sum, set(p.bucket_counts)) == (0, 0, {0})
    assert r.point("vllm:request_success", finished_reason="abort").value == 0
    assert r.point("vllm:num_requests_running").value == 0
    assert "vllm:e2e_request_latency_seconds" not in r.metrics()  # not named: exported once observed


@pytest.mark.parametrize(
    "bounds, rule",
    [
        ((), "empty"),
        ((0, 1), "<= 0"),
        ((-1, 1), "<= 0"),
        ((1, float("inf")), "not finite"),
        ((float("nan"),), "not finite"),
        ((2, 1), "sorted"),
        ((1, 1), "duplicated"),
        (("a",), "not a sequence"),
    ],
)
def test_bad_boundaries_rejected_at_config(bounds, rule):
    with pytest.raises(ValueError, match="preemption_buckets") as info:
        TelemetryConfig(preemption_buckets=bounds)
    assert rule in str(info.value)
    if "<= 0" in rule:
        assert "Ray" in str(info.value)


def test_semconv_profile_names():
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", naming="semconv"))
    run(r)
    r.telemetry.on_step(StepStats(1.0, 1, 1, 0.5, 10))
    names = set(r.metrics())
    assert not [n for n in names if n.startswith("vllm")]
    for name in (
        "gen_ai.server.request.duration",
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
        "llm.server.request.num_preemptions",
        "llm.server.preemptions",
        "llm.server.requests.running",
    ):
        assert name in names
    p = r.point("llm.server.request.num_preemptions")
    assert p.attributes["gen_ai.request.model"] == "tiny"
    assert p.bucket_counts == (2, 1, 2, 1, 0, 0, 1, 0, 1)
    duration = r.point("gen_ai.server.request.duration")
    assert duration.explicit_bounds[0] == 0.01 and duration.explicit_bounds[-1] == 81.92


def test_every_declared_metric_is_produced():
    r = in_memory_telemetry()
    run(r)
    r.telemetry.on_events([RequestEvent(E.TOKENS, "nobody", 1.0, num_tokens=1)])  # one dropped event
    r.telemetry.on_step(StepStats(1.0, 1, 1, 0.5, 10))
    produced = set(r.metrics())
    # The tenant matrix has series only with a tenant source (tests/core/test_tenants.py).
    assert produced == {m.vllm for m in METRICS if m.key not in TENANT_ONLY}


def test_provider_without_views_warns_once_and_still_counts(caplog):
    config = TelemetryConfig(model_name="tiny")
    with caplog.at_level(logging.WARNING, logger="otel_llm"):
        r = in_memory_telemetry(config, with_views=False)
        second = otel_llm.EngineTelemetry(config, meter_provider=r.meter_provider)
    assert [rec.message for rec in caplog.records].count(caplog.records[0].message) == 1
    assert "views" in caplog.records[0].message
    run(r)
    p = r.point("vllm.request_num_preemptions")  # SDK default name and buckets
    assert p.count == 8 and p.sum == 40
    assert second.metrics.__class__.__name__ == "SdkRecorder"


def test_views_cover_every_metric_with_a_colon():
    names = {v._name for v in otel_llm.views(TelemetryConfig())}
    assert {m.vllm for m in METRICS if ":" in m.vllm} <= names


@pytest.mark.parametrize("delta", [False, True])
def test_record_iteration_latencies_equal_on_both_paths(delta):
    """record_iteration observes a step's TTFTs and ITLs in one call per histogram on the fast path."""
    points = []
    for paths in (FAST, SDK):
        r = in_memory_telemetry(**paths, delta=delta)
        r.telemetry.record_iteration(ttfts=[0.02, 0.3], itls=[0.01, 0.01, 0.2, 3.0])
        first = r.metrics()  # one collection per phase: a delta reader sees each observation once
        r.telemetry.record_iteration(itls=[0.05])
        (second,) = r.metrics()["vllm:inter_token_latency_seconds"]
        (ttft,), (itl,) = first["vllm:time_to_first_token_seconds"], first["vllm:inter_token_latency_seconds"]
        points.append([(p.count, p.sum, p.min, p.max, tuple(p.bucket_counts)) for p in (ttft, itl, second)])
    # Sums equal up to float rounding: a delta point's sum is the running sum's difference.
    assert [p[1] for p in points[0]] == pytest.approx([p[1] for p in points[1]])
    assert [p[:1] + p[2:] for p in points[0]] == [p[:1] + p[2:] for p in points[1]]
    assert points[0][1][:4] == (4, pytest.approx(3.22), 0.01, 3.0)
    assert points[0][2][0] == (1 if delta else 5)
