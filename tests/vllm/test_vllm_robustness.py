"""vLLM says its stats classes are not a stable interface: a field missing, renamed or retyped
degrades only the metric that needs it, with one warning; nothing raises into vLLM."""

from __future__ import annotations

import dataclasses
import logging
import time
import types

import pytest
from samples import finished_request, iteration_stats, otel_samples, plugin_manager

LOGGER = "otel_llm.integrations.vllm"


def _ours(o, model, families):
    return {
        (name, dict(labels).get("le")): v
        for (name, labels), v in otel_samples(o.reader, families).items()
        if dict(labels).get("engine") == "0" and dict(labels).get("model_name") == model
    }


def _warnings(caplog):
    """The adapter's own field warnings (vLLM's logger, run for its other series, fails on these
    hand-made stats as it would in vLLM, with one warning of its own)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.levelno == logging.WARNING and "PrometheusStatLogger" not in r.getMessage()
    ]


def test_renamed_iteration_field_degrades_that_metric_with_one_warning(otel, vllm_config, caplog):
    o = otel()
    manager, ours = plugin_manager(vllm_config)
    model = vllm_config.model_config.served_model_name
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            it = iteration_stats()
            it.itl_iter = it.__dict__.pop("inter_token_latencies_iter")  # renamed
            ours.record(scheduler_stats=None, iteration_stats=it, engine_idx=0)
        # Read first: the steps are translated when a collection applies them (defer_steps).
        got = _ours(
            o,
            model,
            {
                "vllm:inter_token_latency_seconds",
                "vllm:time_to_first_token_seconds",
                "vllm:generation_tokens",
                "vllm:num_preemptions",
            },
        )
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert "IterationStats.inter_token_latencies_iter is missing" in warnings[0]
    assert "vllm:inter_token_latency_seconds" in warnings[0]
    assert ours.field_warnings == {("IterationStats", "inter_token_latencies_iter")}
    assert got[("vllm:inter_token_latency_seconds_count", None)] == 0  # degraded: the zero series only
    assert got[("vllm:time_to_first_token_seconds_count", None)] == 3  # the rest goes on
    assert got[("vllm:generation_tokens_total", None)] == 9
    assert got[("vllm:num_preemptions_total", None)] == 3


def test_missing_or_retyped_finished_request_field(otel, vllm_config, caplog):
    o = otel()
    manager, ours = plugin_manager(vllm_config)
    model = vllm_config.model_config.served_model_name
    renamed = dataclasses.asdict(finished_request())
    renamed["queue_time"] = renamed.pop("queued_time")  # a future vLLM renames a field
    renamed["finish_reason"] = finished_request().finish_reason
    renamed = types.SimpleNamespace(**renamed)
    retyped = finished_request(request_id="q2", decode_time="0.45")  # a field changes type
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ours.record(scheduler_stats=None, iteration_stats=iteration_stats([renamed, retyped]), engine_idx=0)
        ours.record(scheduler_stats=None, iteration_stats=iteration_stats([renamed, retyped]), engine_idx=0)
        got = _ours(
            o,
            model,
            {
                "vllm:request_queue_time_seconds",
                "vllm:request_decode_time_seconds",
                "vllm:e2e_request_latency_seconds",
                "vllm:request_num_preemptions",
            },
        )
    warnings = _warnings(caplog)
    assert len(warnings) == 2, warnings
    assert any(
        "SimpleNamespace.queued_time is missing" in w and "vllm:request_queue_time_seconds" in w for w in warnings
    )
    assert any("FinishedRequestStats.decode_time has an unexpected value '0.45'" in w for w in warnings)
    assert got[("vllm:request_queue_time_seconds_count", None)] == 2  # only from the intact ones
    assert got[("vllm:request_decode_time_seconds_count", None)] == 2
    assert got[("vllm:e2e_request_latency_seconds_count", None)] == 4
    assert got[("vllm:e2e_request_latency_seconds_sum", None)] == 5.0
    assert got[("vllm:request_num_preemptions_count", None)] == 4
    assert len(o.spans.get_finished_spans()) == 4


def test_scheduler_stats_of_another_shape(otel, vllm_config, caplog):
    o = otel()
    manager, ours = plugin_manager(vllm_config)
    model = vllm_config.model_config.served_model_name
    sched = types.SimpleNamespace(num_running_reqs=3, num_waiting_reqs=2, kv_usage=0.5)  # kv_cache_usage renamed
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ours.record(scheduler_stats=sched, iteration_stats=None, engine_idx=0)
        ours.record(scheduler_stats=sched, iteration_stats=None, engine_idx=0)
        got = _ours(o, model, {"vllm:num_requests_running", "vllm:num_requests_waiting"})
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "SimpleNamespace.kv_cache_usage is missing" in warnings[0]
    assert got == {("vllm:num_requests_running", None): 3.0, ("vllm:num_requests_waiting", None): 2.0}


@pytest.mark.parametrize(
    "garbage",
    [
        (42, "not stats"),
        (None, object()),
        (types.SimpleNamespace(), types.SimpleNamespace(finished_requests=[object()])),
        (types.SimpleNamespace(num_running_reqs=-1, num_waiting_reqs=float("nan"), kv_cache_usage=7.0), None),
    ],
)
def test_nothing_raises_into_vllm(otel, vllm_config, caplog, garbage):
    otel()
    manager, ours = plugin_manager(vllm_config)
    sched, it = garbage
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            ours.record(scheduler_stats=sched, iteration_stats=it, engine_idx=0)
            ours.record(scheduler_stats=sched, iteration_stats=it, engine_idx=7)  # an engine it was not built for
    manager.log()


def test_a_failing_core_is_contained_counted_and_reported(otel, vllm_config, caplog, monkeypatch):
    o = otel()
    manager, ours = plugin_manager(vllm_config)

    def boom(*args, **kwargs):
        raise RuntimeError("core bug")

    monkeypatch.setattr(ours.telemetry[0], "record_iteration", boom)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            ours.record(scheduler_stats=None, iteration_stats=iteration_stats(), engine_idx=0)
        ours.telemetry[0].flush()  # the steps are translated together (defer_steps)
    reports = [r for r in caplog.records if "internal_error" in r.getMessage()]
    assert len(reports) == 1 and "core bug" in caplog.text  # one report for the three
    dropped = otel_samples(o.reader, {"otel_llm.dropped_events"})
    assert [v for (_, labels), v in dropped.items() if dict(labels).get("reason") == "internal_error"] == [3]


def test_iteration_timestamp_missing_falls_back_to_now(otel, vllm_config, caplog):
    o = otel()
    manager, ours = plugin_manager(vllm_config)
    it = iteration_stats([finished_request()])
    del it.iteration_timestamp
    before = time.time_ns()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ours.record(scheduler_stats=None, iteration_stats=it, engine_idx=0)
        ours.telemetry[0].flush()  # the step is translated with later ones (defer_steps)
    (span,) = o.spans.get_finished_spans()
    assert before - 10**8 <= span.end_time <= time.time_ns() + 10**8
    assert span.end_time - span.start_time == pytest.approx(1.25e9, abs=1e3)
    assert sum("iteration_timestamp is missing" in w for w in _warnings(caplog)) == 1


def test_an_exception_in_a_stat_logger_call_stays_in_the_plugin(otel, vllm_config, caplog, monkeypatch):
    """Whatever the adapter raises, vLLM's calls return; one error line per method and exception type."""
    from otel_llm.integrations.vllm.frontend import stat_logger

    monkeypatch.setattr(stat_logger, "_reported", set())  # what earlier tests reported in this process
    otel()
    manager, ours = plugin_manager(vllm_config)

    def boom(*args, **kwargs):
        raise RuntimeError("adapter bug")

    monkeypatch.setattr(ours._impl, "record", boom)
    monkeypatch.setattr(ours._impl, "logged", boom)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        for _ in range(3):
            manager.record(scheduler_stats=None, iteration_stats=iteration_stats(), engine_idx=0)
            manager.log()
    failed = [r.getMessage() for r in caplog.records if "failed (reported once per error type)" in r.getMessage()]
    assert failed == [
        "otel-llm vLLM adapter: record failed (reported once per error type)",
        "otel-llm vLLM adapter: log failed (reported once per error type)",
    ]
