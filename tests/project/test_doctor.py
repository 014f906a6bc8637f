"""`otel-llm doctor` outside any engine: it says so and exits cleanly; a bad setting exits 2
naming it; an OTLP endpoint that is set is tried for real (a loopback receiver, a closed port)."""

from __future__ import annotations

import io
import socket
import subprocess
import sys

from otel_llm.cli.doctor import doctor
from tests.support.backends import start_otlp_sink

BASE = {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_TRACES_EXPORTER": "otlp"}


def run(environ: dict[str, str]) -> tuple[int, str]:
    out = io.StringIO()
    return doctor(out, environ), out.getvalue()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_outside_any_engine_it_says_so_and_exits_cleanly() -> None:
    with start_otlp_sink("grpc") as sink:
        env = {**BASE, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}
        status, text = run({**env, "OTEL_LLM_NAMING": "semconv", "OTEL_LLM_PREEMPTION_BUCKETS": "1,5,50"})
    assert status == 0, text
    assert "no serving engine installed (vLLM, transformers): nothing to attach to here" in text
    assert "naming semconv" in text and "buckets 1, 5, 50" in text
    assert text.rstrip().endswith("everything asked for attaches")


def test_a_bad_setting_exits_2_naming_it() -> None:
    status, text = run({**BASE, "OTEL_LLM_PREEMPTION_BUCKETS": "0,1"})
    assert status == 2 and "OTEL_LLM_PREEMPTION_BUCKETS" in text, text
    status, text = run({**BASE, "OTEL_LLM_VLLM_DEEP_HOOK": "maybe"})
    assert status == 2 and "OTEL_LLM_VLLM_DEEP_HOOK='maybe'" in text, text


def test_the_otlp_endpoint_set_is_tried() -> None:
    with start_otlp_sink("grpc") as sink:
        status, text = run({**BASE, "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint})
    assert status == 0 and f"  OTLP grpc {sink.endpoint}: answers (metrics, traces)\n" in text, text
    dead = f"http://127.0.0.1:{_closed_port()}"
    status, text = run({**BASE, "OTEL_EXPORTER_OTLP_ENDPOINT": dead, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert status == 1, text
    assert f"  OTLP http/protobuf {dead}/v1/metrics: does not answer (Connection refused) (metrics)\n" in text
    assert f"  OTLP http/protobuf {dead}/v1/traces: does not answer (Connection refused) (traces)\n" in text
    assert text.rstrip().endswith(
        "not attached or not reachable: OTLP endpoint of the metrics, OTLP endpoint of the traces"
    )


def test_a_dead_endpoint_of_the_traces_alone_exits_1_naming_them() -> None:
    """Metrics on our /metrics, traces over OTLP to a port where nothing listens: the spans would
    be lost, so the doctor fails, through the command as a user runs it."""
    dead = f"http://127.0.0.1:{_closed_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "otel_llm", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin",
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": dead,
        },
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"  OTLP grpc {dead}: does not answer (Connection refused) (traces)\n" in done.stdout
    assert done.stdout.rstrip().endswith("not attached or not reachable: OTLP endpoint of the traces")


def test_the_tenant_source_and_where_it_reaches() -> None:
    local = {"OTEL_METRICS_EXPORTER": "none", "OTEL_TRACES_EXPORTER": "none"}  # no endpoint to try
    status, text = run({**local, "OTEL_LLM_TENANT": "priority", "OTEL_LLM_TENANT_MAX_VALUES": "8"})
    assert status == 0, text
    assert "  tenant priority (at most 8 values): reaches engine_stub\n" in text
    status, text = run({**local, "OTEL_LLM_TENANT": "header:X-Team"})
    assert status == 1, text
    assert (
        "  tenant header:x-team (at most 20 values): reaches none of the entry points here; refused by "
        "engine_stub hands over priority, lora, model, baggage\n"
    ) in text
    assert text.rstrip().endswith("not attached or not reachable: tenant source")
    status, text = run({**local})
    assert "  tenant: none (OTEL_LLM_TENANT unset: no tenant label)\n" in text
    status, text = run({**local, "OTEL_LLM_TENANT": "cookie:x"})
    assert status == 2 and "OTEL_LLM_TENANT='cookie:x'" in text, text


def test_python_dash_m_otel_llm_doctor() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "otel_llm", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "prometheus"},
    )
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.startswith("otel-llm doctor: otel-llm ")
        and "Prometheus endpoint http://127.0.0.1:9464" in done.stdout
    )


def test_a_tenant_source_one_engine_here_takes_fails_nothing() -> None:
    """An environment serving with vLLM and with transformers' instrumentor, which takes no
    priority: a priority source reaches vLLM's frontends, and the doctor passes; one that no
    engine here takes fails it."""
    from otel_llm.cli.doctor import tenant_reach
    from otel_llm.config.settings import TelemetryConfig

    engines = ["vllm", "vllm-engine-core", "transformers serve", "transformers generate_batch"]
    line, unreached = tenant_reach(TelemetryConfig(tenant="priority"), engines)
    assert not unreached
    assert line == (
        "tenant priority (at most 20 values): reaches vllm, vllm-engine-core; refused by transformers serve "
        "hands over model, header, baggage; transformers generate_batch hands over model"
    )
    _, unreached = tenant_reach(TelemetryConfig(tenant="lora"), engines[2:])
    assert unreached
