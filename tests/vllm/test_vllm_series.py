"""vLLM's optional metrics and its settings that change metrics, through the plugin as vLLM
loads it (providers built from the environment, our Prometheus endpoint on a free port): the
same scripted stream and scheduler stats through vLLM's StatLoggerManager give the same samples
on our endpoint as on vLLM's own registry, for LoRA, speculative decoding, KV-cache block
metrics and custom histogram buckets. (The CPU engine runs none of these features: their
stats are made here as vLLM's scheduler makes them.)"""

from __future__ import annotations

import time
import urllib.request

import pytest
from conftest import VLLM_PREEMPTION_BUCKETS
from samples import finished_request, iteration_stats, otel_samples, plugin_manager, vllm_samples

from otel_llm.testing.vllm.stream import build, default_specs, run

TTFT_BUCKETS = [0.1, 1.0, 10.0]
PREEMPTION_BUCKETS = [1.0, 2.0, 5.0]


@pytest.fixture
def plugin_endpoint(monkeypatch: pytest.MonkeyPatch):
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from otel_llm.integrations import vllm as plugin

    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "0")
    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "0")
    plugin.reset()
    unregister_vllm_metrics()
    yield
    plugin.reset()
    unregister_vllm_metrics()


def _config(model_dir: str, **kwargs):
    from vllm.config import ModelConfig

    from otel_llm.testing.vllm.config import class_level_config

    return class_level_config(ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32"), **kwargs)


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("vllm:") and not s.name.endswith("_created")
    }


def _run(vllm_config, scheduler_stats):
    from prometheus_client import REGISTRY, generate_latest

    manager, ours = plugin_manager(vllm_config)
    manager.log_engine_initialized()
    run(manager, {0: build(default_specs("s-"), time.monotonic(), time.time())})
    manager.record(scheduler_stats=scheduler_stats, iteration_stats=None, engine_idx=0)
    port = ours._impl.handle.prometheus_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        got = _samples(response.read().decode())
    return _samples(generate_latest(REGISTRY).decode()), got


def _assert_same(theirs: dict, ours: dict, families: set[str]) -> None:
    present = {name for name, _ in theirs}
    assert all(any(n.startswith(f) for n in present) for f in families), families - present
    missing = sorted(k for k in theirs if k not in ours)
    differ = {k: (v, ours[k]) for k, v in theirs.items() if k in ours and v != ours[k]}
    assert not missing, missing[:10]
    assert not differ, differ


def test_lora_info_and_speculative_decoding_and_kv_block_metrics(plugin_endpoint, model_dir):
    from vllm.config import LoRAConfig, ObservabilityConfig, SpeculativeConfig
    from vllm.v1.metrics.stats import KVCacheEvictionEvent, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    config = _config(
        model_dir,
        lora_config=LoRAConfig(max_loras=2, max_lora_rank=8),
        speculative_config=SpeculativeConfig(
            method="ngram", num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=1
        ),
        observability_config=ObservabilityConfig(kv_cache_metrics=True),
    )
    spec = SpecDecodingStats.new(2)
    spec.observe_draft(num_draft_tokens=2, num_accepted_tokens=1)
    spec.observe_draft(num_draft_tokens=2, num_accepted_tokens=2)
    stats = SchedulerStats(
        num_running_reqs=1,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
        spec_decoding_stats=spec,
        running_lora_adapters={"adapter-a": 1},
        waiting_lora_adapters={"adapter-b": 1},
        kv_cache_eviction_events=[
            KVCacheEvictionEvent(lifetime_seconds=3.0, idle_seconds=1.0, reuse_gaps_seconds=(0.5, 2.0))
        ],
    )
    theirs, ours = _run(config, stats)
    # lora_requests_info's value is the time of vLLM's record (set_to_current_time): read from
    # vLLM's logger, the very value.
    lora = "vllm:lora_requests_info"
    _assert_same(
        theirs,
        ours,
        {
            "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "vllm:kv_block_lifetime_seconds",
            "vllm:kv_block_reuse_gap_seconds",
            lora,
        },
    )
    assert [v for (n, _), v in theirs.items() if n == "vllm:spec_decode_num_accepted_tokens_total"] == [3.0]
    (when,) = [v for (n, labels), v in ours.items() if n == lora and ("running_lora_adapters", "adapter-a") in labels]
    assert abs(when - time.time()) < 60


def test_vllms_custom_histogram_buckets_are_honoured_by_every_histogram(plugin_endpoint, model_dir):
    from vllm.config import ObservabilityConfig
    from vllm.v1.metrics.stats import SchedulerStats

    config = _config(
        model_dir,
        observability_config=ObservabilityConfig(
            custom_histogram_buckets={
                "time_to_first_token": TTFT_BUCKETS,
                "request_num_preemptions": PREEMPTION_BUCKETS,
            }
        ),
    )
    theirs, ours = _run(config, SchedulerStats())
    _assert_same(theirs, ours, {"vllm:time_to_first_token_seconds", "vllm:request_num_preemptions"})
    for name, bounds in (
        ("vllm:time_to_first_token_seconds_bucket", TTFT_BUCKETS),
        ("vllm:request_num_preemptions_bucket", PREEMPTION_BUCKETS),
    ):
        les = sorted(float(dict(labels)["le"]) for n, labels in ours if n == name)
        assert les == [*bounds, float("inf")]


def test_semconv_profile_names_vllms_other_series_without_a_vllm_colon_name(otel, vllm_config):
    """In the semconv profile vLLM's other series are ``vllm.<name>`` with GenAI label names."""

    o = otel(naming="semconv")
    manager, _ = plugin_manager(vllm_config)
    run(manager, {0: build(default_specs("n-"), time.monotonic(), time.time())})
    data = o.reader.get_metrics_data()
    points = {
        m.name: list(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
    }
    assert not [name for name in points if name.startswith("vllm:")]
    (computed,) = points["vllm.request_prefill_kv_computed_tokens"]
    model = vllm_config.model_config.served_model_name
    assert dict(computed.attributes) == {"gen_ai.request.model": model, "llm.engine": "0"}
    theirs = vllm_samples({"vllm:request_prefill_kv_computed_tokens"})
    labels = frozenset({"model_name": model, "engine": "0"}.items())
    assert computed.count == theirs[("vllm:request_prefill_kv_computed_tokens_count", labels)] == len(default_specs())
    assert computed.sum == theirs[("vllm:request_prefill_kv_computed_tokens_sum", labels)] > 0
    assert "vllm.prefix_cache_queries" in points and "gen_ai.server.request.duration" in points


def test_beside_vllms_logger_its_series_are_read_not_recorded_again(otel, vllm_config, monkeypatch):
    """vLLM's StatLoggerManager builds its own PrometheusStatLogger beside the plugin: the series
    beyond the core are read from it (prometheus_client's registry) at collection, and the plugin
    runs none of vLLM's logger code again per step. What vLLM's logger alone records is there,
    with vLLM's value, histograms bucket for bucket."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    o = otel()
    manager, ours = plugin_manager(vllm_config)
    (theirs,) = [s for s in manager.stat_loggers if isinstance(s, PrometheusStatLogger)]
    series = ours._impl.series
    assert series.source is REGISTRY
    calls: list[str] = []
    for method in ("record", "record_admission_rejection", "record_sleep_state", "log_engine_initialized"):
        monkeypatch.setattr(series.logger, method, lambda *a, _m=method, **k: calls.append(_m))
    run(manager, {0: build(default_specs("b-"), time.monotonic(), time.time())})
    manager.log_engine_initialized()
    manager.record_admission_rejection("max_num_queued_reqs")
    theirs.record_admission_rejection("max_num_queued_reqs")  # vLLM's logger alone
    assert calls == []
    families = {"vllm:admission_rejections", "vllm:request_prefill_kv_computed_tokens", "vllm:cache_config_info"}
    got, expected = otel_samples(o.reader, families), vllm_samples(families)
    assert got == expected
    model = vllm_config.model_config.served_model_name
    rejected = frozenset({"model_name": model, "reason": "max_num_queued_reqs"}.items())
    assert got[("vllm:admission_rejections_total", rejected)] == 2
    labels = frozenset({"model_name": model, "engine": "0"}.items())
    assert got[("vllm:request_prefill_kv_computed_tokens_count", labels)] == len(default_specs())


def test_vllms_values_read_directly_are_those_of_its_collected_samples(otel, vllm_config):
    """Beside vLLM's logger, every family is read from the values of vLLM's prometheus_client
    metrics themselves, not from the samples its registry builds: the same observations, series
    for series (histograms bucket for bucket). A gauge set to a function is read from its samples."""
    from prometheus_client import Gauge

    otel()
    manager, ours = plugin_manager(vllm_config, [0, 1])
    series = ours._impl.series
    now_m, now_w = time.monotonic(), time.time()
    run(manager, {0: build(default_specs("d0-"), now_m, now_w), 1: build(default_specs("d1-")[:4], now_m, now_w)})
    manager.record_admission_rejection("max_num_queued_reqs")

    def read(observations):
        out = {}
        for o in observations:
            cell = o.context.get(next(iter(o.context))) if o.context else None
            value = (tuple(cell.counts), cell.total) if cell is not None else o.value
            out[frozenset(o.attributes.items())] = value
        return out

    families = [f for f in series.families.values() if f.recording]
    seen = {"counter": 0, "gauge": 0, "histogram": 0}
    for family in families:
        direct = series.reader.read_values(family)
        assert direct is not None, family.name
        assert read(direct) == read(series.reader.read_samples(family)), family.name
        seen[family.kind] += len(direct)
    assert all(n > 0 for n in seen.values()), seen

    from prometheus_client import REGISTRY

    gauge = next(f for f in families if f.kind == "gauge" and f.labelnames)
    metric = REGISTRY._names_to_collectors[gauge.name]
    assert isinstance(metric, Gauge)
    values = next(iter(metric._metrics))
    metric.labels(*values).set_function(lambda: 42.0)
    assert series.reader.read_values(gauge) is None
    attributes = dict(zip(gauge.otel_labels, values))
    assert [o.value for o in series.read(gauge) if o.attributes == attributes] == [42.0]


def test_beside_vllms_logger_finished_requests_are_translated_together(plugin_endpoint, model_dir):
    """Where vLLM's logger records the per-step series, the steps with finished requests are kept
    and translated together (their metrics and spans): after 16 such steps, when the engine goes
    idle, at vLLM's periodic log() and at a collection, whichever comes first."""
    from vllm.v1.metrics.stats import SchedulerStats

    manager, ours = plugin_manager(_config(model_dir))
    impl = ours._impl
    assert impl.steps_read
    tel = impl.telemetry[0]

    def translated() -> int:
        return sum(tel.metrics.by_finish.values())

    def step(n: int, running: int = 1) -> None:
        for i in range(n):
            manager.record(
                scheduler_stats=SchedulerStats(num_running_reqs=running, num_waiting_reqs=0),
                iteration_stats=iteration_stats([finished_request(request_id=f"q{translated()}-{i}")]),
                engine_idx=0,
            )

    step(15)
    assert translated() == 0
    step(1)  # the 16th
    assert translated() == 16
    step(2)
    assert translated() == 16
    step(1, running=0)  # idle
    assert translated() == 19
    step(3)
    manager.log()
    assert translated() == 22
    step(2)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{impl.handle.prometheus_port}/metrics", timeout=30)
    assert translated() == 24
    text = metrics.read().decode()
    model = impl.model_name
    line = f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{model}"}} 24.0'
    assert line in text


@pytest.mark.parametrize("exemplar_filter, steps_read", [("trace_based", True), ("always_on", False)])
def test_with_its_own_providers_the_per_step_core_series_are_vllms_read_at_collection(
    plugin_endpoint, model_dir, monkeypatch, caplog, exemplar_filter, steps_read
):
    """Beside vLLM's own logger, on the providers the plugin builds, the core series that vLLM's
    logger records each engine step (latencies, iteration tokens, token and preemption counters,
    scheduler gauges) are read from it at collection: the plugin records nothing for them per
    step, and every vLLM series on our endpoint has vLLM's value. With ``always_on`` exemplars
    (which those series then carry) the plugin records them itself, with the same values."""
    from prometheus_client import REGISTRY, generate_latest

    from otel_llm.integrations.vllm.frontend import step_translator

    monkeypatch.setenv("OTEL_METRICS_EXEMPLAR_FILTER", exemplar_filter)
    monkeypatch.setenv("OTEL_LLM_PREEMPTION_BUCKETS", ",".join(map(str, VLLM_PREEMPTION_BUCKETS)))
    monkeypatch.setattr(step_translator, "_told_unknown", [])
    vllm_config = _config(model_dir)
    manager, ours = plugin_manager(vllm_config, [0, 1])
    impl = ours._impl
    assert impl.steps_read is steps_read
    now_m, now_w = time.monotonic(), time.time()
    streams = {0: build(default_specs("e0-"), now_m, now_w), 1: build(default_specs("e1-")[:4], now_m, now_w)}
    run(manager, streams)
    with urllib.request.urlopen(f"http://127.0.0.1:{impl.handle.prometheus_port}/metrics", timeout=30) as response:
        got = _samples(response.read().decode())
    expected = _samples(generate_latest(REGISTRY).decode())

    recorded = [(sum(t.metrics.h_ttft.counts), t.metrics.counts["generation_tokens"]) for t in impl.telemetry.values()]
    if steps_read:
        assert recorded == [(0, 0), (0, 0)]
    else:
        assert all(ttft > 0 and tokens > 0 for ttft, tokens in recorded), recorded
    missing = sorted(k for k in expected if k not in got)
    differ = {k: (v, got[k]) for k, v in expected.items() if k in got and v != got[k]}
    assert not missing, missing[:10]
    assert not differ, differ
    # Beyond vLLM's: preemptions by reason (vLLM's, all kv_cache_full), no recomputed tokens, and
    # the attribution's series (without the deep hook: every cause unknown, nobody caused any).
    extra = {name for name, _ in set(got) - set(expected)}
    caused = "vllm:request_num_preemptions_caused"
    assert extra == {
        "vllm:num_preemptions_by_reason_total",
        "vllm:num_recomputed_tokens_total",
        "vllm:num_preemptions_by_cause_total",
        *(f"{caused}{suffix}" for suffix in ("_bucket", "_sum", "_count")),
    }
    model = vllm_config.model_config.served_model_name
    for engine, preemptions in (("0", 11), ("1", 3)):
        labels = {"model_name": model, "engine": engine}
        assert expected[("vllm:num_preemptions_total", frozenset(labels.items()))] == preemptions
        by_reason = frozenset({**labels, "reason": "kv_cache_full"}.items())
        assert got[("vllm:num_preemptions_by_reason_total", by_reason)] == preemptions
        assert got[("vllm:num_recomputed_tokens_total", frozenset(labels.items()))] == 0
        unknown = frozenset({**labels, "cause": "unknown"}.items())  # said once
        told = [r for r in caplog.records if "causes of vLLM's preemptions are unknown" in r.getMessage()]
        assert len(told) == 1
        assert got[("vllm:num_preemptions_by_cause_total", unknown)] == preemptions
        assert got[(f"{caused}_sum", frozenset(labels.items()))] == 0
        finished = expected[("vllm:request_num_preemptions_count", frozenset(labels.items()))]
        assert got[(f"{caused}_count", frozenset(labels.items()))] == finished
        tokens = sum(s.tokens for s in streams[int(engine)].specs)
        assert got[("vllm:generation_tokens_total", frozenset(labels.items()))] == tokens
