"""The GenAI semantic conventions the semconv profile and the spans follow (metrics.SEMCONV_VERSION).

Server metrics require gen_ai.operation.name and gen_ai.provider.name, gen_ai.request.model when
available, and error.type on gen_ai.server.request.duration when the request ended in an error;
spans carry the same gen_ai.* attributes and no deprecated names.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from otel_llm import TelemetryConfig
from otel_llm.catalogue.metrics import BY_KEY, ERROR_TYPE, SEMCONV_VERSION
from otel_llm.testing import in_memory_telemetry, lifecycle
from tests.support.otel_helpers import BOTH_PATHS, FAST, Paths

DURATION = BY_KEY["e2e_request_latency_seconds"].semconv
# Names the conventions replaced (gen_ai.system -> gen_ai.provider.name, prompt/completion token
# usage -> input/output tokens).
DEPRECATED = {
    "gen_ai.system",
    "gen_ai.usage.prompt_tokens",
    "gen_ai.usage.completion_tokens",
    "gen_ai.openai.request.seed",
    "gen_ai.openai.request.response_format",
}


def _run(config: TelemetryConfig, paths: Paths):
    r = in_memory_telemetry(config, **paths)
    reasons = ["stop", "error", "length", "error", "error", "abort"]
    for i, reason in enumerate(reasons):
        r.telemetry.on_events(lifecycle(f"r{i}", 1.0 + i, preemptions=i % 3, finish_reason=reason))
    return r, reasons


@BOTH_PATHS
def test_semconv_metrics_carry_the_required_attributes_and_error_type(paths):
    r, reasons = _run(TelemetryConfig(model_name="tiny", naming="semconv"), paths)
    metrics = r.metrics()
    for name, points in metrics.items():
        if name == "otel_llm.dropped_events":
            continue
        for p in points:
            assert p.attributes["gen_ai.operation.name"] == "text_completion", name
            assert p.attributes["gen_ai.provider.name"] == "self_hosted", name
            assert p.attributes["gen_ai.request.model"] == "tiny", name
    durations = {p.attributes.get("error.type"): p.count for p in metrics[DURATION]}
    assert durations == {None: 3, ERROR_TYPE: 3}
    # error.type only where the conventions ask for it: other histograms have one series
    for key in ("request_queue_time_seconds", "request_generation_tokens"):
        (point,) = metrics[BY_KEY[key].semconv]
        assert "error.type" not in point.attributes and point.count == len(reasons)


def test_vllm_profile_labels_are_unchanged():
    r, _ = _run(TelemetryConfig(model_name="tiny"), FAST)
    (point,) = r.metrics()["vllm:e2e_request_latency_seconds"]
    assert dict(point.attributes) == {"model_name": "tiny", "engine": "0"} and point.count == 6


def test_provider_name_is_settable_and_validated(clean_env):
    config = TelemetryConfig.from_env({"OTEL_LLM_PROVIDER_NAME": "vllm", "OTEL_LLM_NAMING": "semconv"})
    assert config.provider_name == "vllm"
    r, _ = _run(config, FAST)
    assert {p.attributes["gen_ai.provider.name"] for p in r.metrics()[DURATION]} == {"vllm"}
    assert {s.attributes["gen_ai.provider.name"] for s in r.finished_spans()} == {"vllm"}
    with pytest.raises(ValueError, match=r"^provider_name: '' must be a non-empty string"):
        TelemetryConfig(provider_name="")


@pytest.mark.parametrize("naming", ["vllm", "semconv"])
def test_spans_carry_current_gen_ai_attributes_and_error_type(naming):
    r, reasons = _run(TelemetryConfig(model_name="tiny", naming=naming), FAST)
    spans = r.spans_by_request()
    assert len(spans) == len(reasons)
    for i, reason in enumerate(reasons):
        attrs = spans[f"r{i}"].attributes
        assert attrs["gen_ai.operation.name"] == "text_completion"
        assert attrs["gen_ai.provider.name"] == "self_hosted"
        assert attrs["gen_ai.request.model"] == "tiny"
        assert attrs["gen_ai.response.finish_reasons"] == (reason,)
        assert isinstance(attrs["gen_ai.usage.input_tokens"], int) and isinstance(
            attrs["gen_ai.usage.output_tokens"], int
        )
        assert attrs.get("error.type") == (ERROR_TYPE if reason == "error" else None)
        assert not DEPRECATED & set(attrs)


def test_metrics_doc_names_the_conventions_version():
    text = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    assert SEMCONV_VERSION in text
