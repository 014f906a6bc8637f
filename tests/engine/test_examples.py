"""Every example runs, and prints what it should (so the examples cannot rot)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.backends import backend, start_otlp_sink

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(name: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_export_otlp_with_nothing_listening_says_what_was_not_delivered(protocol):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again at the block's end: nothing listens there
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_TIMEOUT": "1",  # the exporters' retries give up after it
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_TRACES_EXPORTER": "otlp",
    }
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "export_otlp.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert (out.returncode, out.stdout) == (1, ""), out.stderr
    [said] = [line for line in out.stderr.splitlines() if line.startswith("recorded 3 requests")]
    assert re.fullmatch(
        r"recorded 3 requests; NOT delivered: metric_points_export_failed=\d+, spans_export_failed=3", said
    )


def test_record_lifecycle():
    out = run("record_lifecycle.py")
    assert "vllm:request_num_preemptions: count=1 sum=1" in out
    assert "  le=0.5: 0\n  le=1.0: 1\n" in out
    assert (
        "event preempted {'ordinal': 1, 'num_computed_tokens': 12, 'reason': 'kv_cache_full', 'cause': 'self', "
        "'cause_request_ids': ('req-1',)}"
    ) in out


def test_hand_written_engine_loop():
    out = run("hand_written_engine_loop.py").splitlines()
    engine = int(out[0].split(": ")[1])
    assert engine > 0
    assert out[1] == f"vllm:num_preemptions: {engine}"
    assert out[2].startswith(f"vllm:request_num_preemptions: count=5 sum={engine} ")


@pytest.mark.backend
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_export_otlp(protocol):
    with backend("otlp sink"), start_otlp_sink(protocol) as sink:
        out = run(
            "export_otlp.py",
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                "OTEL_METRICS_EXPORTER": "otlp",
                "OTEL_TRACES_EXPORTER": "otlp",
            },
        )
        points = sum(len(sink.metric_points(name)) for name in sink.metric_names())
        assert out == f"exported 3 requests: 3 spans, {points} metric points\n"
        _, point = sink.metric_points("vllm:request_num_preemptions")[-1]  # cumulative: the last is the total
        assert list(point.bucket_counts) == [1, 1, 0, 1, 0, 0, 0, 0, 0]  # 0, 1 and 3 preemptions
        assert len(sink.spans()) == 3
