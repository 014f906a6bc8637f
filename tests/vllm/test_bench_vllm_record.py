"""``python -m bench.vllm.record`` runs in vLLM's environment and writes its section: every
variant timed, finite numbers, and the plugin's logger really at work (one span per request of
every run that had it). No timing is judged here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPS, REQUESTS, TOKENS = 3, 4, 6


def test_bench_vllm_record_writes_its_section(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"kept": 1}))
    args = ["--reps", str(REPS), "--requests", str(REQUESTS), "--tokens", str(TOKENS), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.vllm.record", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["kept"] == 1
    r = results["vllm_record"]
    assert r["load"]["output_tokens"] == REQUESTS * TOKENS
    assert {name: len(runs) for name, runs in r["seconds_by_rep"].items()} == dict.fromkeys(
        ("none", "vllm", "otel", "vllm+otel"), REPS
    )
    # The two variants with our logger, in the warm-up and every repetition: one span per request.
    assert r["spans_exported"] == 2 * (1 + REPS) * REQUESTS
    assert not any(r["losses_counted"].values())
    for value in (*r["ms_per_stream"].values(), *r["us_per_step"].values(), r["otel_over_vllm_logger"]):
        assert math.isfinite(value)
    assert "7. vLLM's frontend stats path" in proc.stdout


def test_bench_vllm_record_rejects_bad_arguments(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.vllm.record", "--reps", "1", "--out", str(tmp_path / "r.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--reps: at least 3" in proc.stderr
    assert not (tmp_path / "r.json").exists()
