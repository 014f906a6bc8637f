"""otel_llm.testing, the public helpers for testing an engine's telemetry, and its pytest plugin:
the readers against known lifecycles on both metric paths, spans and log events, teardown; the
plugin's entry point, its fixtures in this session and in a pytest session of its own (the
example test file), and nothing of OpenTelemetry or torch imported at pytest start-up."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from otel_llm import TelemetryConfig, _sdk
from otel_llm.events import EventType, RequestEvent
from otel_llm.testing import InMemoryTelemetry, Preemption, in_memory_telemetry, lifecycle
from tests.support.otel_helpers import BOTH_PATHS

ROOT = Path(__file__).resolve().parents[2]
PREEMPTIONS = (0, 0, 1, 3, 7)


def feed(r: InMemoryTelemetry) -> None:
    for i, k in enumerate(PREEMPTIONS):
        r.telemetry.on_events(lifecycle(f"r{i}", 10.0 + i, preemptions=k, prompt_tokens=20))


@BOTH_PATHS
def test_histogram_by_key_or_name_with_bounds_count_and_sum(paths: dict[str, Any]) -> None:
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny"), **paths)
    feed(r)
    metrics = r.metrics()
    hist = metrics.histogram("request_num_preemptions")
    assert hist == metrics.histogram("vllm:request_num_preemptions", {"model_name": "tiny"}, engine="0")
    assert hist.bounds == (0.5, 1, 2, 3, 4, 5, 10, 20)
    assert hist.buckets == {0.5: 2, 1: 1, 2: 0, 3: 1, 4: 0, 5: 0, 10: 1, 20: 0, math.inf: 0}
    assert (hist.count, hist.sum) == (5, 11)
    assert hist.attributes == {"model_name": "tiny", "engine": "0"}
    assert metrics.counter("num_preemptions") == metrics.counter("vllm:num_preemptions") == 11
    assert metrics.counter("num_preemptions_by_reason", reason="kv_cache_full") == 11
    assert metrics.counter("num_recomputed_tokens") == sum(20 * k + k * (k - 1) // 2 for k in PREEMPTIONS)
    assert metrics.counter("request_success", finished_reason="stop") == 5
    r.shutdown()


def test_counters_histograms_and_points_per_attribute_set() -> None:
    r = in_memory_telemetry()
    assert r.counter("num_preemptions_by_reason") == 0  # in the table, no point yet: 0
    for i, reason in enumerate(("stop", "stop", "length", "abort")):
        r.telemetry.on_events(lifecycle(f"r{i}", 1.0 + i, preemptions=i, finish_reason=reason))
    r.telemetry.on_events([RequestEvent(EventType.TOKENS, "ghost", 9.0, num_tokens=1)])
    metrics = r.metrics()
    assert metrics.counter("request_success") == 4  # summed over finished_reason
    assert metrics.counter("request_success", finished_reason="stop") == 2
    assert metrics.counter("dropped_events", reason="unknown_request") == 1
    with pytest.raises(LookupError, match="vllm:typo"):
        metrics.counter("vllm:typo")
    with pytest.raises(LookupError, match="3 points match"):
        metrics.point("request_success")
    assert len(metrics.points("request_success")) == 3
    assert [h.count for h in metrics.histograms("request_num_preemptions")] == [4]
    assert "vllm:e2e_request_latency_seconds" in metrics and metrics.name("e2e_request_latency_seconds") in metrics


def test_semconv_keys_resolve_to_the_profile_names_and_dotted_attributes_go_in_a_mapping() -> None:
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", naming="semconv"))
    feed(r)
    metrics = r.metrics()
    assert metrics.name("request_num_preemptions") == "llm.server.request.num_preemptions"
    assert metrics.histogram("request_num_preemptions", {"gen_ai.request.model": "tiny"}).sum == 11
    assert metrics.counter("request_success", {"gen_ai.response.finish_reason": "stop"}) == 5


def test_without_views_keys_resolve_to_the_sdk_names() -> None:
    r = in_memory_telemetry(with_views=False)
    feed(r)
    assert r.histogram("request_num_preemptions").count == 5  # vllm.request_num_preemptions, SDK buckets


def test_an_exponential_histogram_is_named_not_misread() -> None:
    config = TelemetryConfig(model_name="tiny", histogram_aggregation="base2_exponential_bucket_histogram")
    r = in_memory_telemetry(config)
    feed(r)
    metrics = r.metrics()
    assert metrics.histogram("request_num_preemptions").count == 5  # explicit buckets always
    with pytest.raises(TypeError, match="not an explicit-bucket histogram"):
        metrics.histogram("e2e_request_latency_seconds")
    assert metrics.point("e2e_request_latency_seconds").count == 5


def test_delta_snapshots_hold_what_was_recorded_since_the_last() -> None:
    r = in_memory_telemetry(delta=True)
    r.telemetry.on_events(lifecycle("a", 1.0, preemptions=2))
    assert r.metrics().histogram("request_num_preemptions").sum == 2
    r.telemetry.on_events(lifecycle("b", 2.0, preemptions=1))
    assert r.counter("num_preemptions") == 1


@BOTH_PATHS
def test_request_span_and_its_preemption_events(paths: dict[str, Any]) -> None:
    r = in_memory_telemetry(**paths)
    feed(r)
    assert set(r.spans_by_request()) == {f"r{i}" for i in range(len(PREEMPTIONS))}
    span = r.span("r3")
    assert span.name == "llm_request" and dict(span.attributes or {})["llm.request.num_preemptions"] == 3
    preemptions = r.preemptions("r3")
    assert [(p.ordinal, p.num_computed_tokens, p.reason) for p in preemptions] == [
        (1, 20, "kv_cache_full"),
        (2, 21, "kv_cache_full"),
        (3, 22, "kv_cache_full"),
    ]
    assert sorted(p.time_ns for p in preemptions) == [p.time_ns for p in preemptions]
    assert r.preemptions("r0") == []
    with pytest.raises(LookupError, match="'nobody'"):
        r.span("nobody")


@pytest.mark.skipif(not _sdk.holds("log_events"), reason="this SDK's Logs API has no log-based events")
def test_preemption_log_events_match_the_span_events() -> None:
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", preemption_events="both"))
    feed(r)
    assert r.logger_provider is not None and len(r.log_records()) == sum(PREEMPTIONS)
    for i, k in enumerate(PREEMPTIONS):
        logged = r.log_preemptions(f"r{i}")
        assert [Preemption(p.ordinal, p.num_computed_tokens, p.reason, 0) for p in logged] == [
            Preemption(p.ordinal, p.num_computed_tokens, p.reason, 0) for p in r.preemptions(f"r{i}")
        ]
        assert len(logged) == k
    assert in_memory_telemetry().log_records() == []  # span events only: no LoggerProvider


def test_shutdown_ends_open_spans_and_is_idempotent_in_a_with_block() -> None:
    with in_memory_telemetry() as r:
        r.telemetry.on_events(lifecycle("open", 1.0)[:3])  # arrived, queued, scheduled
        assert r.spans_by_request() == {}
    r.shutdown()
    (span,) = r.span_exporter.get_finished_spans()
    attributes = dict(span.attributes or {})
    assert attributes["gen_ai.request.id"] == "open" and attributes["llm.request.incomplete"] == "shutdown"


# -- the pytest plugin -------------------------------------------------------------------


def test_the_plugin_is_registered_for_pytest() -> None:
    [ep] = [ep for ep in entry_points(group="pytest11") if ep.name == "otel_llm"]
    assert ep.value == "otel_llm.testing.plugin"


def test_the_plugin_imports_no_opentelemetry_sdk_nor_torch() -> None:
    code = (
        "import sys, otel_llm.testing.plugin; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('opentelemetry', 'torch', 'engine_stub')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_fixtures_in_this_session(otel_llm_telemetry: InMemoryTelemetry, otel_llm_config: TelemetryConfig) -> None:
    assert otel_llm_telemetry.config is otel_llm_config
    otel_llm_telemetry.telemetry.on_events(lifecycle("a", 1.0, preemptions=1))
    assert otel_llm_telemetry.histogram("request_num_preemptions").buckets[1] == 1


# Imported after the plugins that pytest loads at start-up (pytest11 entry points), before any test.
CONFTEST = """
import sys

assert not [m for m in sys.modules if m.split(".")[0] in ("opentelemetry", "torch")], "imported at start-up"
"""

SESSION = """
from otel_llm import TelemetryConfig
from otel_llm.testing import lifecycle

made = []


def test_factory(otel_llm_telemetry_factory):
    made.append(otel_llm_telemetry_factory())
    made.append(otel_llm_telemetry_factory(TelemetryConfig(model_name="x", naming="semconv")))
    made[1].telemetry.on_events(lifecycle("a", 1.0, preemptions=2))
    assert made[1].counter("num_preemptions") == 2


def test_the_factory_shut_its_telemetries_down():
    assert [m.span_exporter.export(()).name for m in made] == ["FAILURE", "FAILURE"]  # a stopped exporter
"""


def run_pytest(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A pytest session of its own in ``tmp_path`` (no rootdir config, conftest or cache of ours)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "-c",
            os.devnull,
            *args,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_a_pytest_session_with_the_plugin_and_the_example(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_session.py").write_text(SESSION)
    shutil.copy(ROOT / "examples" / "test_engine_telemetry.py", tmp_path)
    out = run_pytest(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "5 passed" in out.stdout


def test_without_plugin_autoload_it_loads_by_name(tmp_path: Path) -> None:
    (tmp_path / "test_one.py").write_text(
        "def test_fixture(otel_llm_telemetry):\n    assert otel_llm_telemetry.counter('num_preemptions') == 0\n"
    )
    out = run_pytest(tmp_path, "-p", "otel_llm", env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout
