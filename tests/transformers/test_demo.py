"""`otel-llm demo --engine transformers` (`make demo-transformers`): `make demo`'s summary on
transformers' real continuous batching, and the telemetry equals the engine's own eviction count."""

from __future__ import annotations

import pytest

from otel_llm.cli.main import main


def test_demo_on_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--engine", "transformers", "--requests", "16", "--prometheus-port", "0"]) == 0
    out = capsys.readouterr().out
    assert "otel-llm demo: transformers continuous batching, 6 KV blocks" in out
    assert "ground truth   telemetry equals the engine" in out
    assert "requests per preemption count (llm.server.request.num_preemptions)" in out
    assert "worst requests" in out and "trace_id " in out
