"""Reliability: every invalid setting fails at start-up, once, with a message naming it.

Three entry points: ``TelemetryConfig(...)``, ``TelemetryConfig.from_env(env)`` and
``setup_telemetry(environ=env)``. Each invalid value raises one ValueError whose message names
the setting (or the environment variable), shows the value, and states the rule; nothing is
left running after a failed setup; and a config that was accepted never fails later, on the
first ``record()``.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import subprocess
import sys

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader, NumberDataPoint

import otel_llm
from otel_llm import EngineTelemetry, EventType, RequestEvent, TelemetryConfig, setup_telemetry
from otel_llm.config.settings import CONFIG_VARIABLES, ENTRY_POINT_VARIABLES, from_environment
from otel_llm.export import env_checks as sdk_env
from otel_llm.export.settings_check import check_settings
from otel_llm.stack.ports import free_port
from tests.support.otel_helpers import BOTH_PATHS, attrs

E = EventType
RULE_WORDS = ("must", "not", "empty", "duplicated", "sorted", "positive", "finite", "is not one of")

# (keyword, value, words the message must hold besides the setting and the value)
BAD_KWARGS = [
    ("preemption_buckets", (), ("empty",)),
    ("preemption_buckets", (0, 1, 2), ("<= 0", "positive")),
    ("preemption_buckets", (-1.0, 1.0), ("<= 0",)),
    ("preemption_buckets", (0.5, math.inf), ("not finite",)),
    ("preemption_buckets", (0.5, math.nan), ("not finite",)),
    ("preemption_buckets", (2, 1), ("sorted",)),
    ("preemption_buckets", (1, 1, 2), ("duplicated",)),
    ("preemption_buckets", None, ("not a sequence of numbers",)),
    ("preemption_buckets", ("a", "b"), ("not a sequence of numbers",)),
    ("naming", "prometheus", ("must be one of",)),
    ("naming", None, ("must be one of",)),
    ("model_name", "", ("non-empty string",)),
    ("model_name", 7, ("non-empty string",)),
    ("engine", 0, ("must be a string",)),
    ("prometheus_port", 65536, ("0..65535",)),
    ("prometheus_port", -1, ("0..65535",)),
    ("prometheus_port", "9464", ("0..65535",)),
    ("prometheus_port", True, ("0..65535",)),
    ("prometheus_host", "", ("host name",)),
    ("otlp_protocol", "http/json", ("must be one of",)),
    ("otlp_protocol", "GRPC ", ("must be one of",)),
    ("otlp_endpoint", "localhost:4317", ("http:// or https:// URL",)),
    ("otlp_endpoint", "ftp://collector", ("http:// or https:// URL",)),
    ("otlp_endpoint", "http://", ("http:// or https:// URL",)),
    ("metrics_exporters", ("otlp", "jaeger"), ("is not one of",)),
    ("metrics_exporters", 5, ("must be",)),
    ("traces_exporters", ("prometheus",), ("is not one of",)),
    ("metric_export_interval_ms", 0, (">= 1",)),
    ("metric_export_interval_ms", 1.5, ("integer",)),
    ("exemplar_filter", "sometimes", ("must be one of",)),
    ("max_model_len", 0, (">= 1",)),
    ("max_inflight_requests", -5, (">= 1",)),
    ("max_label_values", 0, (">= 1",)),
    ("max_label_values", 2.0, ("integer",)),
    ("tenant", "nobody", ("must be one of priority, lora, model",)),
    ("tenant", 5, ("must be a string",)),
    ("tenant_max_values", 0, (">= 1",)),
    ("content_max_length", 0, (">= 1",)),
    ("defer_steps", 0, (">= 1",)),
    ("defer_steps", 2.5, (">= 1",)),
    ("record_content", "false", ("True or False",)),  # a truthy string must not switch content on
    ("spans", None, ("True or False",)),
    ("sdk_disabled", "no", ("True or False",)),
    ("resource_attributes", "service.name=x", ("mapping",)),
    ("resource_attributes", {"k": 1}, ("mapping",)),
]


def _one_clear_message(exc: BaseException, setting: str, value: object, words: tuple[str, ...]) -> None:
    message = str(exc)
    assert setting in message, f"message does not name {setting!r}: {message}"
    shown = [repr(value), str(value)]
    if isinstance(value, (tuple, list)):  # a list may be reported by its offending element
        shown += [repr(v) for v in value] + [repr(float(v)) for v in value if isinstance(v, (int, float))]
        if not value:
            shown.append("empty")
    assert any(s in message for s in shown), f"message does not show {value!r}: {message}"
    for word in words:
        assert word in message, f"message lacks the rule ({word!r}): {message}"
    assert "\n" not in message and "Traceback" not in message
    assert exc.__cause__ is None and exc.__suppress_context__ or exc.__context__ is None, (
        "the ValueError should stand alone, not chained to an SDK traceback"
    )


@pytest.mark.parametrize("setting,value,words", BAD_KWARGS, ids=[f"{s}={v!r}" for s, v, _ in BAD_KWARGS])
def test_invalid_keyword_setting_fails_at_construction(setting, value, words):
    with pytest.raises(ValueError) as info:
        TelemetryConfig(**{setting: value})
    _one_clear_message(info.value, setting, value, words)


# (variable, raw value, rule words); every variable config.py parses appears at least once.
BAD_ENV = [
    ("OTEL_LLM_NAMING", "prom", ("must be one of",)),
    ("OTEL_LLM_MODEL_NAME", None, ()),  # any non-blank string is a valid model name
    ("OTEL_LLM_ENGINE", None, ()),  # any string is a valid engine index label
    ("OTEL_LLM_PREEMPTION_BUCKETS", "1,x", ("comma-separated list of numbers",)),
    ("OTEL_LLM_PREEMPTION_BUCKETS", "2,1", ("sorted",)),
    ("OTEL_LLM_PREEMPTION_BUCKETS", "0,1", ("positive",)),
    ("OTEL_LLM_PREEMPTION_BUCKETS", "1,1", ("duplicated",)),
    ("OTEL_LLM_PREEMPTION_BUCKETS", "1,inf", ("not finite",)),
    ("OTEL_LLM_PREEMPTION_BUCKETS", "1,nan", ("not finite",)),
    ("OTEL_LLM_PREEMPTION_BUCKETS", " , ", ("empty",)),
    ("OTEL_LLM_MAX_MODEL_LEN", "0", (">= 1",)),
    ("OTEL_LLM_MAX_MODEL_LEN", "1e3", ("not an integer",)),
    ("OTEL_LLM_SPANS", "maybe", ("not a boolean",)),
    ("OTEL_LLM_MAX_INFLIGHT_REQUESTS", "-5", (">= 1",)),
    ("OTEL_LLM_MAX_LABEL_VALUES", "1.5", ("not an integer",)),
    ("OTEL_LLM_RECORD_CONTENT", "2", ("not a boolean",)),
    ("OTEL_LLM_CONTENT_MAX_LENGTH", "abc", ("not an integer",)),
    ("OTEL_LLM_DEFER_STEPS", "0", (">= 1",)),
    ("OTEL_LLM_PROMETHEUS_PORTS", "0", (">= 1",)),
    ("OTEL_LLM_PREEMPTION_EVENTS", "span", ("must be one of",)),
    ("OTEL_LLM_PROVIDER_NAME", None, ()),  # any non-blank string is a provider name
    ("OTEL_LLM_TENANT", "user", ("must be one of priority, lora, model, header:NAME, baggage:KEY",)),
    ("OTEL_LLM_TENANT", "header:", ("needs a name after the colon",)),
    ("OTEL_LLM_TENANT_MAX_VALUES", "0", (">= 1",)),
    ("OTEL_LOGS_EXPORTER", "zipkin", ("is not one of",)),
    ("OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION", "exponential", ("must be one of",)),
    ("OTEL_METRICS_EXPORTER", "otlp,jaeger", ("is not one of",)),
    ("OTEL_TRACES_EXPORTER", "prometheus", ("is not one of",)),
    ("OTEL_EXPORTER_PROMETHEUS_HOST", None, ()),  # blank = unset; any other string is a host
    ("OTEL_EXPORTER_PROMETHEUS_PORT", "70000", ("0..65535",)),
    ("OTEL_EXPORTER_PROMETHEUS_PORT", "-1", ("0..65535",)),
    ("OTEL_EXPORTER_PROMETHEUS_PORT", "http", ("not an integer",)),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json", ("must be one of",)),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "localhost:4317", ("http:// or https:// URL",)),
    ("OTEL_METRIC_EXPORT_INTERVAL", "soon", ("not a number",)),
    ("OTEL_METRIC_EXPORT_INTERVAL", "-1", (">= 1",)),
    ("OTEL_METRIC_EXPORT_INTERVAL", "inf", ("not finite",)),
    ("OTEL_METRICS_EXEMPLAR_FILTER", "sometimes", ("must be one of",)),
    ("OTEL_SDK_DISABLED", "perhaps", ("not a boolean",)),
]
# Parsed by setup_telemetry (otel_llm/export/setup.py), not by TelemetryConfig.
BAD_SETUP_ENV = [
    ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "thrift", ("must be",)),
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", ("must be",)),
    ("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "notaurl", ("http:// or https:// URL",)),
    ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "ftp://x", ("http:// or https:// URL",)),
]
# Read by the SDK and its exporters themselves; checked first by otel_llm.export.env_checks (the SDK would
# fail deep inside, fall back to a default with a log line, or fail every export later).
BAD_SDK_ENV = [
    ("OTEL_EXPORTER_OTLP_TIMEOUT", "abc", ("seconds > 0",)),
    ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "-5", ("seconds > 0",)),
    ("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "inf", ("seconds > 0",)),
    ("OTEL_EXPORTER_OTLP_COMPRESSION", "bogus", ("must be one of", "gzip")),
    ("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "zstd", ("must be one of",)),
    ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "deflate", ("must be one of gzip with the grpc exporter",)),
    ("OTEL_EXPORTER_OTLP_CERTIFICATE", "/nonexistent/ca.pem", ("readable file",)),
    ("OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "/nonexistent/key.pem", ("readable file",)),
    ("OTEL_METRIC_EXPORT_TIMEOUT", "abc", ("milliseconds > 0",)),
    ("OTEL_BSP_MAX_QUEUE_SIZE", "abc", ("integer >= 1",)),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "0", ("integer >= 1",)),
    ("OTEL_BSP_SCHEDULE_DELAY", "-1", ("integer >= 1",)),
    ("OTEL_BSP_EXPORT_TIMEOUT", "1.5", ("integer >= 0",)),
    ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4096", ("must be <=", "OTEL_BSP_MAX_QUEUE_SIZE")),
    ("OTEL_TRACES_SAMPLER", "sometimes", ("must be one of", "parentbased_traceidratio")),
    ("OTEL_RESOURCE_ATTRIBUTES", "team=llm,garbage", ("must be key=value",)),
]
BAD_SAMPLER_ARG = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"}
BASE_ENV = {
    "OTEL_METRICS_EXPORTER": "otlp",
    "OTEL_TRACES_EXPORTER": "otlp",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
}


def test_every_variable_config_parses_has_a_bad_value_case():
    assert {var for var, _, _ in BAD_ENV} == set(CONFIG_VARIABLES)


# Read by one entry point each, through otel_llm.config.settings.from_environment.
BAD_ENTRY_POINT_ENV = [
    ("OTEL_LLM_VLLM_METRICS", "both", ("expected one of add, replace",)),
    ("OTEL_LLM_VLLM_DEEP_HOOK", "maybe", ("expected true/false", "or force")),
    ("OTEL_LLM_PHOENIX", None, ()),  # any path; a missing executable is said where Phoenix starts
]


def test_every_entry_point_variable_has_a_bad_value_case():
    assert {var for var, _, _ in BAD_ENTRY_POINT_ENV} == set(ENTRY_POINT_VARIABLES)


@pytest.mark.parametrize("var,raw,words", [c for c in BAD_ENTRY_POINT_ENV if c[1] is not None])
def test_invalid_entry_point_variable_fails_named(var, raw, words):
    with pytest.raises(ValueError) as info:
        from_environment(var, {var: raw})
    _one_clear_message(info.value, var, raw, words)


def test_the_environment_wins_over_an_entry_points_defaults_and_code_over_both():
    defaults = {"model_name": "served-model", "provider_name": "vllm"}
    assert TelemetryConfig.from_env({}, defaults=defaults).model_name == "served-model"
    env = {"OTEL_LLM_MODEL_NAME": "from-env"}
    config = TelemetryConfig.from_env(env, defaults=defaults)
    assert (config.model_name, config.provider_name) == ("from-env", "vllm")
    assert TelemetryConfig.from_env(env, defaults=defaults, model_name="from-code").model_name == "from-code"
    assert from_environment("OTEL_LLM_MODEL_NAME", env) == "from-env"
    assert from_environment("OTEL_LLM_MODEL_NAME", {"OTEL_LLM_MODEL_NAME": "  "}) is None


@pytest.mark.parametrize(
    "var,raw,words",
    [c for c in BAD_ENV if c[1] is not None],
    ids=[f"{v}={r!r}" for v, r, _ in BAD_ENV if r is not None],
)
def test_invalid_environment_value_fails_in_from_env_and_setup(var, raw, words):
    env = {**BASE_ENV, var: raw}
    with pytest.raises(ValueError) as info:
        TelemetryConfig.from_env(env)
    _one_clear_message(info.value, var, raw, words)
    with pytest.raises(ValueError) as info:
        setup_telemetry(environ=env)
    _one_clear_message(info.value, var, raw, words)


@pytest.mark.parametrize("var,raw,words", BAD_SETUP_ENV, ids=[f"{v}={r!r}" for v, r, _ in BAD_SETUP_ENV])
def test_invalid_exporter_variable_fails_in_setup(var, raw, words):
    with pytest.raises(ValueError) as info:
        setup_telemetry(environ={**BASE_ENV, var: raw})
    _one_clear_message(info.value, var, raw, words)


@pytest.mark.parametrize("var,raw,words", BAD_SDK_ENV, ids=[f"{v}={r!r}" for v, r, _ in BAD_SDK_ENV])
def test_invalid_sdk_variable_fails_in_setup_before_the_sdk_reads_it(var, raw, words):
    with pytest.raises(ValueError) as info:
        setup_telemetry(environ={**BASE_ENV, var: raw})
    _one_clear_message(info.value, var, raw, words)


def test_invalid_sampler_argument_fails_in_setup():
    with pytest.raises(ValueError) as info:
        setup_telemetry(environ={**BASE_ENV, **BAD_SAMPLER_ARG})
    _one_clear_message(info.value, "OTEL_TRACES_SAMPLER_ARG", "1.5", ("ratio in 0..1",))


@pytest.mark.parametrize("var", ["OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"])
def test_malformed_headers_fail_in_setup_without_showing_the_secret(var, caplog):
    caplog.set_level(logging.DEBUG)
    secret = "s3cr3t-value"
    with pytest.raises(ValueError) as info:
        setup_telemetry(environ={**BASE_ENV, var: f"x-tenant=acme,authorization=Bearer {secret};x"})
    message = str(info.value)
    assert var in message and "member 2" in message and "authorization=***" in message and "name=value" in message
    assert secret not in message and secret not in caplog.text


def test_valid_sdk_variables_are_accepted(clean_env):
    """No false alarms: values the SDK takes are taken (set in os.environ, which the SDK reads)."""
    # Fractional seconds where the OTLP exporters take them (SDK 1.28's read an integer).
    good = {
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2" if sdk_env.integer_timeouts() else "2.5",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "GZIP",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION": "none",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer abc%20def , x-tenant=acme,",
        "OTEL_METRIC_EXPORT_TIMEOUT": "5000",
        "OTEL_BSP_MAX_QUEUE_SIZE": "64",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_BSP_EXPORT_TIMEOUT": "0",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
        "OTEL_RESOURCE_ATTRIBUTES": "team=llm, region=eu-west=1",
    }
    for var, value in {**BASE_ENV, **good}.items():
        clean_env.setenv(var, value)
    handle = setup_telemetry(TelemetryConfig(model_name="m"))
    handle.shutdown()
    if sdk_env.integer_timeouts():  # then "2.5" fails in setup, naming the variable, not in the exporter
        clean_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2.5")
        with pytest.raises(ValueError, match=r"^OTEL_EXPORTER_OTLP_TIMEOUT='2.5': must be a whole number of seconds"):
            setup_telemetry(TelemetryConfig(model_name="m"))


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.parametrize(
    "var,raw",
    [
        ("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "thrift"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "ftp://x"),
        ("OTEL_BSP_MAX_QUEUE_SIZE", "abc"),
    ],
)
def test_a_failed_setup_leaves_no_listener_behind(var, raw):
    """The Prometheus endpoint must not stay bound when a later setting fails setup."""
    port = free_port()
    env = {**BASE_ENV, "OTEL_METRICS_EXPORTER": "prometheus,otlp", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port), var: raw}
    with pytest.raises(ValueError):
        setup_telemetry(environ=env)
    assert _bindable(port), f"port {port} still bound after a failed setup_telemetry"


def test_prometheus_port_taken_fails_at_setup_with_the_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as info:
            setup_telemetry(
                TelemetryConfig(metrics_exporters=("prometheus",), traces_exporters=("none",), prometheus_port=port),
                environ={},
            )
        assert f"127.0.0.1:{port}" in str(info.value)


def test_env_overrides_are_validated_and_kwargs_win_over_env():
    env = {"OTEL_LLM_NAMING": "prom"}
    assert TelemetryConfig.from_env(env, naming="semconv").naming == "semconv"  # the override replaces it
    with pytest.raises(ValueError) as info:
        TelemetryConfig.from_env({"OTEL_LLM_MAX_LABEL_VALUES": "0"})
    assert "OTEL_LLM_MAX_LABEL_VALUES" in str(info.value) and "max_label_values" in str(info.value)


EDGE_BUCKETS = [(1e-9,), (0.5,), (0.5, 1e300), tuple(float(i) for i in range(1, 1001))]


@pytest.mark.parametrize("bounds", EDGE_BUCKETS, ids=["tiny", "one", "huge", "thousand"])
@BOTH_PATHS
def test_an_accepted_config_never_fails_on_record(bounds, paths, caplog):
    caplog.set_level(logging.WARNING)
    config = TelemetryConfig(model_name="m", preemption_buckets=bounds)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=otel_llm.views(config))
    telemetry = EngineTelemetry(config, meter_provider=provider, **paths)
    for i, preemptions in enumerate((0, 1, 3, 2000)):
        rid = f"r{i}"
        events = [RequestEvent(E.ARRIVED, rid, 1.0, prompt_tokens=3), RequestEvent(E.SCHEDULED, rid, 1.0)]
        for _ in range(preemptions):
            events += [RequestEvent(E.PREEMPTED, rid, 1.0, reason="kv_cache_full"), RequestEvent(E.SCHEDULED, rid, 1.0)]
        events += [
            RequestEvent(E.TOKENS, rid, 2.0, num_tokens=1),
            RequestEvent(E.FINISHED, rid, 2.0, finish_reason="stop"),
        ]
        telemetry.on_events(events)
    data = reader.get_metrics_data()
    assert data is not None
    points = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "vllm:request_num_preemptions"
        for p in m.data.data_points
    ]
    assert len(points) == 1 and isinstance(points[0], HistogramDataPoint)
    assert points[0].count == 4 and tuple(points[0].explicit_bounds) == tuple(bounds)
    dropped = [
        p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "otel_llm.dropped_events"
        for p in m.data.data_points
    ]
    for p in dropped:
        assert isinstance(p, NumberDataPoint)  # a counter's
        assert not (attrs(p.attributes).get("reason") and p.value)
    assert not [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and "otel_llm" in r.name and "without otel_llm.views" not in r.getMessage()
    ], caplog.text
    provider.shutdown()


# Through the command, each bad value of the lists above, and the ones a new user met first.
CLI_CASES = [
    (var, raw) for var, raw, _ in [*BAD_ENV, *BAD_SETUP_ENV, *BAD_SDK_ENV, *BAD_ENTRY_POINT_ENV] if raw is not None
] + [("OTEL_EXPORTER_OTLP_ENDPOINT", "not-a-url"), ("OTEL_LLM_NAMING", "bogus")]


@pytest.mark.parametrize("var,raw", CLI_CASES, ids=[f"{v}={r!r}" for v, r in CLI_CASES])
def test_the_cli_says_a_bad_setting_in_one_line_and_exits_2(var, raw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-m", "otel_llm", "demo"], env={**env, var: raw}, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr == f"otel-llm demo: bad setting: {check_settings({var: raw})}\n"
    _one_clear_message(ValueError(done.stderr.rstrip("\n")), var, raw, ())


def test_check_settings_names_what_setup_would_reject():
    """The one check every entry point runs says what setup_telemetry would raise, word for word."""
    for var, raw, _ in [*BAD_ENV, *BAD_SETUP_ENV, *BAD_SDK_ENV]:
        if raw is not None:
            with pytest.raises(ValueError) as info:
                setup_telemetry(environ={**BASE_ENV, var: raw})
            assert check_settings({**BASE_ENV, var: raw}) == str(info.value), var
    assert check_settings(BASE_ENV) is None and check_settings({}) is None


def test_otel_llm_version():
    done = subprocess.run([sys.executable, "-m", "otel_llm", "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"otel-llm {otel_llm.__version__}\n", "")
