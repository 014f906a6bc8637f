"""Replace mode (``OTEL_LLM_VLLM_METRICS=replace``): vLLM builds no Prometheus logger of its own,
and what prometheus_client's REGISTRY serves (vLLM's /metrics route serves it, through the same
content negotiation) equals what stock vLLM serves for the same scripted engine-core stream
through vLLM's real OutputProcessor and StatLoggerManager: the same families, HELP and TYPE
lines, series and values, in the text format and in OpenMetrics, with the ``le="0.5"`` bucket
and exemplars besides."""

from __future__ import annotations

import logging
import re

import pytest
from prometheus_client import REGISTRY
from prometheus_client.exposition import choose_encoder

from otel_llm.testing.vllm.stream import build, default_specs, run

OPENMETRICS = "application/openmetrics-text; version=1.0.0"
TEXT = "text/plain"
T0_MONOTONIC, T0_WALL = 1000.0, 1.7e9  # the same clocks for both runs: equal latencies
NEVER_PREEMPTED = re.compile(r'^vllm[:_]request_num_preemptions_bucket\{.*le="0\.5".*')


@pytest.fixture
def clean(monkeypatch):
    """Both runs from nothing: vLLM's global metrics, our providers and the deep hook reset."""
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from otel_llm.integrations import vllm as plugin
    from otel_llm.integrations.vllm.frontend import deep_hook

    for var in ("OTEL_LLM_VLLM_METRICS", "OTEL_LLM_NAMING"):
        monkeypatch.delenv(var, raising=False)
    plugin.reset()
    unregister_vllm_metrics()
    yield
    plugin.reset()
    deep_hook.uninstall()
    unregister_vllm_metrics()


def _manager(vllm_config, factories):
    from vllm.v1.metrics.loggers import StatLoggerManager

    manager = StatLoggerManager(
        vllm_config, engine_idxs=[0, 1], custom_stat_loggers=factories, enable_default_loggers=False
    )
    manager.log_engine_initialized()  # as AsyncLLM does at start (vLLM's cache_config_info)
    return manager


def _streams():
    return {
        0: build(default_specs("e0-"), T0_MONOTONIC, T0_WALL),
        1: build(default_specs("e1-")[:4], T0_MONOTONIC, T0_WALL),
    }


def _scrape(accept: str) -> tuple[str, list[str]]:
    """(content type, the vllm lines, sorted) as vLLM's /metrics would answer ``accept``:
    ``_created`` values (the series' creation times) and exemplars (``# {...}``) left out."""
    encoder, content_type = choose_encoder(accept)
    lines = []
    for line in encoder(REGISTRY).decode().splitlines():
        if not re.match(r"^(# (HELP|TYPE) )?vllm[:_]", line):
            continue
        line = line.split(" # {", 1)[0]
        if "_created" in line and not line.startswith("#"):
            line = line.rsplit(" ", 1)[0] + " <created>"
        lines.append(line)
    return content_type, sorted(lines)


def _stock(vllm_config, accept: str) -> tuple[str, list[str], list[str]]:
    """Stock vLLM: its own PrometheusStatLogger; the scrape at start and after the stream."""
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    manager = _manager(vllm_config, [])
    _, at_start = _scrape(accept)
    run(manager, _streams())
    content_type, after = _scrape(accept)
    unregister_vllm_metrics()
    return content_type, at_start, after


def _replace_class(monkeypatch):
    from otel_llm.integrations.vllm.frontend.stat_logger import stat_logger_class

    monkeypatch.setenv("OTEL_LLM_VLLM_METRICS", "replace")
    return stat_logger_class()


@pytest.mark.parametrize("accept", [TEXT, OPENMETRICS])
def test_replace_serves_what_vllm_serves(clean, vllm_config, monkeypatch, accept):
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    stock_type, stock_start, stock_after = _stock(vllm_config, accept)
    assert len(stock_after) > 400  # every family of vLLM's logger, two engines

    cls = _replace_class(monkeypatch)
    manager = _manager(vllm_config, [cls])
    (ours,) = manager.stat_loggers  # vLLM built no PrometheusStatLogger beside it
    assert isinstance(ours, cls) and isinstance(ours, PrometheusStatLogger) and ours.vllm_logger is None
    content_type, start = _scrape(accept)
    assert content_type == stock_type
    # At start: every series vLLM creates at zero, and our never-preempted bucket (two engines).
    assert [line for line in start if not NEVER_PREEMPTED.match(line)] == stock_start
    assert len([line for line in start if NEVER_PREEMPTED.match(line)]) == 2
    run(manager, _streams())
    _, after = _scrape(accept)
    extra = [line for line in after if NEVER_PREEMPTED.match(line)]
    assert [line for line in after if not NEVER_PREEMPTED.match(line)] == stock_after
    # Engine 0's stream has 3 requests never preempted (r0, r0b, r0c), engine 1's 2 (r0, r0b).
    assert sorted(line.rsplit(" ", 1)[1] for line in extra) == ["2.0", "3.0"]
    if accept == OPENMETRICS:
        encoder, _ = choose_encoder(accept)
        assert re.search(
            r'_bucket\{[^}]*\} [0-9.]+ # \{span_id="[0-9a-f]{16}",trace_id="[0-9a-f]{32}"\}', encoder(REGISTRY).decode()
        )  # exemplars: a bucket leads to a trace


def test_replace_scraped_mid_stream_serves_what_vllm_serves(clean, vllm_config, monkeypatch):
    """Mid-stream the plugin still keeps its last engine steps (defer_steps), vLLM's logger code
    among them: the scrape applies them first."""
    from opentelemetry.metrics import CallbackOptions
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from otel_llm.recording.in_process import drain

    steps = 7
    unregister_vllm_metrics()
    run(_manager(vllm_config, []), _streams(), steps=steps)
    _, stock = _scrape(TEXT)
    unregister_vllm_metrics()
    manager = _manager(vllm_config, [_replace_class(monkeypatch)])
    run(manager, _streams(), steps=steps)
    (ours,) = manager.stat_loggers
    assert all(tel._pending for tel in ours.telemetry.values())  # steps kept, on both engines
    # What a read of vLLM's series runs first, as the core's instruments do, whatever the SDK's order.
    drain(ours.handle.meter_provider, CallbackOptions())
    assert not any(tel._pending for tel in ours.telemetry.values())
    _, mid = _scrape(TEXT)
    assert [line for line in mid if not NEVER_PREEMPTED.match(line)] == stock


def test_replace_scrape_after_shutdown_answers(clean, vllm_config, monkeypatch):
    """After the plugin's providers shut down (vLLM shutting down), a scrape still answers,
    without vLLM's families: nothing raises into vLLM's route (which would answer 500)."""
    from otel_llm.integrations import vllm as plugin

    manager = _manager(vllm_config, [_replace_class(monkeypatch)])
    run(manager, {0: build(default_specs()[:2], T0_MONOTONIC, T0_WALL)})
    assert any(line.startswith("vllm:generation_tokens_total") for line in _scrape(TEXT)[1])
    plugin.reset()
    for accept in (TEXT, OPENMETRICS):
        assert _scrape(accept)[1] == []


def test_a_bad_mode_disables_the_plugin_not_vllm(clean, vllm_config, monkeypatch, caplog):
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from otel_llm.integrations.vllm.frontend.stat_logger import stat_logger_class

    monkeypatch.setenv("OTEL_LLM_VLLM_METRICS", "sideways")
    with caplog.at_level(logging.WARNING):
        manager = _manager(vllm_config, [stat_logger_class()])
    ours, theirs = manager.stat_loggers
    assert ours.telemetry == {} and type(theirs) is PrometheusStatLogger  # vLLM serves its own
    (line,) = [r.getMessage() for r in caplog.records if "OTEL_LLM_VLLM_METRICS" in r.getMessage()]
    assert "telemetry disabled" in line and "'sideways'" in line and "add, replace" in line
    run(manager, {0: build(default_specs()[:2], T0_MONOTONIC, T0_WALL)})
    assert 'vllm:generation_tokens_total{engine="0",model_name' in "\n".join(_scrape(TEXT)[1])


@pytest.mark.parametrize("case", ["api_servers", "semconv", "use_handle"])
def test_replace_runs_as_add_where_it_cannot_stand_in(clean, otel, vllm_config, monkeypatch, caplog, case):
    """One line naming the reason; vLLM's own logger built by the plugin serves vLLM's /metrics."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    if case == "api_servers":
        monkeypatch.setattr(vllm_config.parallel_config, "_api_process_count", 2)
    elif case == "semconv":
        monkeypatch.setenv("OTEL_LLM_NAMING", "semconv")
    else:
        otel()  # providers handed over with use_handle
    _, _, stock_after = _stock(vllm_config, TEXT) if case == "semconv" else (None, None, None)
    cls = _replace_class(monkeypatch)
    with caplog.at_level(logging.WARNING):
        manager = _manager(vllm_config, [cls])
    (ours,) = manager.stat_loggers
    assert type(ours.vllm_logger) is PrometheusStatLogger
    (line,) = [r.getMessage() for r in caplog.records if "runs as add" in r.getMessage()]
    assert {"api_servers": "several API servers", "semconv": "OTEL_LLM_NAMING=semconv", "use_handle": "use_handle"}[
        case
    ] in line
    assert ours.telemetry  # the plugin records on, in add mode
    run(manager, _streams())
    if stock_after is not None:  # semconv: no vllm: name of ours in the registry, vLLM's all there
        assert _scrape(TEXT)[1] == stock_after


def test_replace_is_the_default_and_falls_back_with_an_info_line(clean, vllm_config, monkeypatch, caplog):
    """With OTEL_LLM_VLLM_METRICS unset the plugin stands in for vLLM's logger; where it cannot
    (several API servers), vLLM's own logger runs beside it, said in one info line, no warning."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from otel_llm.integrations import vllm as plugin
    from otel_llm.integrations.vllm.frontend.stat_logger import stat_logger_class

    cls = stat_logger_class()
    assert issubclass(cls, PrometheusStatLogger)
    manager = _manager(vllm_config, [cls])
    (ours,) = manager.stat_loggers
    assert ours.vllm_logger is None and ours.telemetry

    plugin.reset()  # the next logger starts from nothing
    monkeypatch.setattr(vllm_config.parallel_config, "_api_process_count", 2)
    with caplog.at_level(logging.INFO, logger="otel_llm"):
        manager = _manager(vllm_config, [cls])
    (ours,) = manager.stat_loggers
    assert type(ours.vllm_logger) is PrometheusStatLogger
    said = [r for r in caplog.records if r.name.startswith("otel_llm") and "add mode" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO], said
    assert "several API servers" in said[0].getMessage()
    assert not [r for r in caplog.records if r.name.startswith("otel_llm") and r.levelno >= logging.WARNING]


def test_a_bad_setting_under_the_default_leaves_vllm_its_own_logger(clean, vllm_config, monkeypatch, caplog):
    """Replace mode's class with the plugin disabled by a bad setting: vLLM's own logger is built
    and serves vLLM's /metrics, as if the plugin were not installed."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from otel_llm.integrations.vllm.frontend.stat_logger import stat_logger_class

    monkeypatch.setenv("OTEL_LLM_PREEMPTION_BUCKETS", "one,two")
    with caplog.at_level(logging.WARNING):
        manager = _manager(vllm_config, [stat_logger_class()])
    (ours,) = manager.stat_loggers
    assert ours.telemetry == {} and type(ours.vllm_logger) is PrometheusStatLogger
    assert any("OTEL_LLM_PREEMPTION_BUCKETS" in r.getMessage() for r in caplog.records), caplog.text
    run(manager, {0: build(default_specs()[:2], T0_MONOTONIC, T0_WALL)})
    assert 'vllm:generation_tokens_total{engine="0",model_name' in "\n".join(_scrape(TEXT)[1])


@pytest.mark.parametrize("engines", [1, 2])
def test_replace_with_tenants_serves_vllms_values_by_tenant(clean, vllm_config, monkeypatch, engines):
    """Replace mode with a tenant source (``priority``, three classes), one engine (the values
    taken every few steps) or two (taken at each step): time to first token, inter-token
    latency and the prompt and generation token counters are served by tenant, each engine's
    count and tokens per tenant those of its requests, and summed over tenant, each engine's
    series (buckets, counts, sums) what stock vLLM serves."""
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from otel_llm.integrations.vllm.frontend import deep_hook

    families = (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
    )

    def streams():
        out = {}
        for engine in range(engines):
            specs = default_specs(f"e{engine}-")
            for i, spec in enumerate(specs):
                spec.priority = (i + engine) % 3
            out[engine] = build(specs, T0_MONOTONIC, T0_WALL)
        return out

    def scrape() -> dict[tuple, float]:
        """{(sample name, engine, le, tenant or None): value} of the four families."""
        out: dict[tuple, float] = {}
        for family in text_string_to_metric_families(choose_encoder(TEXT)[0](REGISTRY).decode()):
            for s in family.samples:
                if family.name in families and not s.name.endswith("_created"):
                    key = (s.name, s.labels.get("engine"), s.labels.get("le"), s.labels.get("tenant"))
                    out[key] = s.value
        return out

    def summed(samples: dict[tuple, float]) -> dict[tuple, float]:
        out: dict[tuple, float] = {}
        for (name, engine, le, _), value in samples.items():
            out[(name, engine, le)] = out.get((name, engine, le), 0.0) + value
        return out

    unregister_vllm_metrics()
    manager = _manager(vllm_config, [])
    run(manager, streams())
    stock = scrape()
    unregister_vllm_metrics()
    assert stock and all(key[3] is None for key in stock)

    monkeypatch.setenv("OTEL_LLM_TENANT", "priority")
    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    manager = _manager(vllm_config, [_replace_class(monkeypatch)])
    scripts = streams()
    run(manager, scripts)
    assert deep_hook.is_installed()
    ours = scrape()
    by_tenant = {k: v for k, v in ours.items() if k[3] is not None}
    assert {k: v for k, v in ours.items() if k[3] is None and v} == {}
    for engine, script in scripts.items():
        for p in range(3):
            requests = [s for s in script.specs if s.priority == p]
            tokens = by_tenant[("vllm:generation_tokens_total", str(engine), None, str(p))]
            assert tokens == sum(s.tokens for s in requests)
            assert by_tenant[("vllm:prompt_tokens_total", str(engine), None, str(p))] == sum(s.prompt for s in requests)
            ttfts = by_tenant[("vllm:time_to_first_token_seconds_count", str(engine), None, str(p))]
            assert ttfts == len(requests)
    got, expected = summed(by_tenant), summed(stock)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == (pytest.approx(value, abs=1e-9) if key[0].endswith("_sum") else value), key
