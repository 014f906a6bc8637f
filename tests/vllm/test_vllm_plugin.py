"""The plugin is found through its installed entry point by vLLM's own loader and built by
vLLM's own StatLoggerManager with a real VllmConfig; labels and providers."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from samples import otel_samples

from otel_llm.testing.vllm.stream import build, default_specs, run


def test_entry_point_found_by_vllm_loader():
    from vllm.v1.metrics.loggers import StatLoggerBase, load_stat_logger_plugin_factories

    from otel_llm.integrations import vllm as plugin

    factories = load_stat_logger_plugin_factories()
    assert plugin.OtelStatLogger in factories  # the very class, loaded from the entry point
    assert issubclass(plugin.OtelStatLogger, StatLoggerBase)

    from vllm.plugins import load_plugins_by_group

    general = load_plugins_by_group("vllm.general_plugins")
    from otel_llm.integrations.vllm.frontend import deep_hook as vllm_deep_hook

    assert general["otel_llm_deep_hook"] is vllm_deep_hook.register


def test_built_by_stat_logger_manager_with_real_vllm_config(otel, vllm_config):
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase, StatLoggerManager, load_stat_logger_plugin_factories

    from otel_llm.integrations.vllm import OtelStatLogger

    o = otel()
    manager = StatLoggerManager(
        vllm_config, engine_idxs=[0, 1, 3], custom_stat_loggers=load_stat_logger_plugin_factories()
    )
    ours = [s for s in manager.stat_loggers if isinstance(s, OtelStatLogger)]
    assert len(ours) == 1
    logger = ours[0]
    # An aggregate logger: one instance for every data-parallel engine, one EngineTelemetry each.
    assert isinstance(logger, AggregateStatLoggerBase)
    assert logger.engine_indexes == [0, 1, 3]
    assert sorted(logger.telemetry) == [0, 1, 3]
    model = vllm_config.model_config.served_model_name
    assert {(t.config.model_name, t.config.engine) for t in logger.telemetry.values()} == {
        (model, "0"),
        (model, "1"),
        (model, "3"),
    }
    assert len({id(t.metrics.instruments) for t in logger.telemetry.values()}) == 1  # one provider set
    assert all(t.config.max_model_len == vllm_config.model_config.max_model_len for t in logger.telemetry.values())

    manager.log_engine_initialized()
    now_m, now_w = time.monotonic(), time.time()
    run(manager, {3: build(default_specs("x-")[:2], now_m, now_w)})
    manager.log()
    got = otel_samples(o.reader, {"vllm:request_success"})
    # Every engine's five finish reasons exist from the start, as vLLM creates them.
    assert got == {
        (
            "vllm:request_success_total",
            frozenset({"model_name": model, "engine": engine, "finished_reason": reason}.items()),
        ): 1.0 if engine == "3" and reason in ("length", "stop") else 0.0
        for engine in ("0", "1", "3")
        for reason in ("stop", "length", "abort", "error", "repetition")
    }
    # Spans: one per finished request, with the exact preemption count.
    spans = o.spans.get_finished_spans()
    assert sorted(s.attributes["gen_ai.request.id"] for s in spans) == ["x-r0", "x-r0b"]
    assert {s.name for s in spans} == {"llm_request"}
    assert all(s.attributes["llm.request.num_preemptions"] == 0 for s in spans)


def test_builds_its_own_providers_from_the_environment(vllm_config, monkeypatch):
    """Without use_handle(): setup_telemetry from OTEL_* / OTEL_LLM_*, labels from vLLM's config."""
    from vllm.v1.metrics.loggers import StatLoggerManager, load_stat_logger_plugin_factories
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from otel_llm.integrations import vllm as plugin
    from otel_llm.integrations.vllm import OtelStatLogger

    monkeypatch.setenv("OTEL_LLM_PREEMPTION_BUCKETS", "0.5,1,2,4,8")
    plugin.reset()
    unregister_vllm_metrics()
    try:
        manager = StatLoggerManager(
            vllm_config, engine_idxs=[0], custom_stat_loggers=load_stat_logger_plugin_factories()
        )
        (logger,) = [s for s in manager.stat_loggers if isinstance(s, OtelStatLogger)]
        handle = logger._impl.handle
        assert handle.config.model_name == vllm_config.model_config.served_model_name
        assert handle.config.max_model_len == vllm_config.model_config.max_model_len
        assert handle.config.preemption_buckets == (0.5, 1, 2, 4, 8)
        assert handle.config.provider_name == "vllm"  # the engine kind, apart from engine_stub's and transformers'
        assert logger.telemetry[0] is handle.telemetry  # setup_telemetry's own engine "0"
        monkeypatch.setenv("OTEL_LLM_MODEL_NAME", "my-model")
        plugin.reset()
        (logger2,) = [
            s
            for s in StatLoggerManager(
                vllm_config, custom_stat_loggers=load_stat_logger_plugin_factories()
            ).stat_loggers
            if isinstance(s, OtelStatLogger)
        ]
        assert logger2.telemetry[0].config.model_name == "my-model"
    finally:
        plugin.reset()
        unregister_vllm_metrics()


def test_a_bad_setting_disables_the_plugin_not_vllm(vllm_config, monkeypatch, caplog):
    from vllm.v1.metrics.loggers import StatLoggerManager, load_stat_logger_plugin_factories
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from otel_llm.integrations import vllm as plugin
    from otel_llm.integrations.vllm import OtelStatLogger

    monkeypatch.setenv("OTEL_LLM_PREEMPTION_BUCKETS", "0,1,2")  # <= 0: rejected by the config
    plugin.reset()
    unregister_vllm_metrics()
    try:
        manager = StatLoggerManager(vllm_config, custom_stat_loggers=load_stat_logger_plugin_factories())
        (logger,) = [s for s in manager.stat_loggers if isinstance(s, OtelStatLogger)]
        assert logger.telemetry == {}
        assert "telemetry disabled" in caplog.text and "OTEL_LLM_PREEMPTION_BUCKETS" in caplog.text
        run(manager, {0: build(default_specs()[:1], time.monotonic(), time.time())})  # vLLM goes on
    finally:
        plugin.reset()
        unregister_vllm_metrics()


def test_importing_otel_llm_does_not_import_vllm():
    code = (
        "import sys, otel_llm, otel_llm.integrations, otel_llm.integrations.vllm, "
        "otel_llm.integrations.vllm.frontend.deep_hook; otel_llm.TelemetryConfig; otel_llm.EngineTelemetry; "
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')); "
        "assert not bad, bad; print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_beyond_vllm_exemplars_link_histograms_to_request_spans(otel, vllm_config):
    from vllm.v1.metrics.loggers import StatLoggerManager, load_stat_logger_plugin_factories

    o = otel()
    manager = StatLoggerManager(
        vllm_config, custom_stat_loggers=load_stat_logger_plugin_factories(), enable_default_loggers=False
    )
    script = build(default_specs(), time.monotonic(), time.time())
    run(manager, {0: script})
    by_trace = {s.context.trace_id: s for s in o.spans.get_finished_spans()}
    data = o.reader.get_metrics_data()
    (point,) = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "vllm:request_num_preemptions"
        for p in m.data.data_points
    ]
    assert point.exemplars
    for exemplar in point.exemplars:
        span = by_trace[exemplar.trace_id]  # the request whose value the bucket holds
        assert span.attributes["llm.request.num_preemptions"] == exemplar.value
    assert {e.value for e in point.exemplars} >= {0, 7}
