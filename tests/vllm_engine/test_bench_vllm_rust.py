"""``python -m bench.vllm.rust`` at its smallest (one pair of small loads, one start of each
server: 80–90 s here): its section of the results is written whole. Nothing timed is asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from bench.vllm.rust import KEY
from bench.vllm.rust.__main__ import ARMS, RATIOS, TARGETS
from otel_llm.testing.vllm.server import rust_frontend_missing
from tests.support.backends import require_backend

ROOT = Path(__file__).resolve().parents[2]
ARGS = ("--pairs", "1", "--blocks", "1", "--requests", "8", "--max-tokens", "16", "--settle", "1")


def test_the_smallest_run_writes_its_section(tmp_path: Path) -> None:
    missing = rust_frontend_missing()
    if missing is not None:
        require_backend("vllm-rs", missing)
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"other": {"kept": True}}))
    done = subprocess.run(
        [sys.executable, "-m", "bench.vllm.rust", *ARGS, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert results["other"] == {"kept": True}
    r = results[KEY]
    assert set(r["ratios"]) == set(RATIOS)
    for measure in r["ratios"].values():
        for key in ("stock", "otel", "ratio_of_medians", "ratio_paired_median"):
            assert math.isfinite(measure[key]) and measure[key] > 0, measure
        assert len(measure["ratio_by_pair"]) == 1 and len(measure["ratio_by_block"]) == 1
    assert len(r["targets"]) == len(TARGETS)
    assert [len(r["rounds"][arm]) for arm in ARMS] == [1, 1]
    assert {"vllm serve", "VLLM::EngineCore", "VLLM::Worker", "vllm-rs"} <= set(r["cpu_us_per_token_by_process"])
    assert r["step_methods"] == ["step"]  # vLLM's CPU engine: no batch queue
    assert all(round_["steps"] > 0 for arm in ARMS for round_ in r["rounds"][arm])
    [checks] = r["checks_by_block"]
    assert checks["stock"] == {"consumer_line_in_log": False, "plugin_endpoint_answers": False}
    assert checks["otel"]["consumer_line_in_log"] and checks["otel"]["plugin_endpoint_answers"]
    assert checks["otel"]["counts"]["equal"], checks["otel"]["counts"]
    assert r["otel"]["spans_received_all"]
