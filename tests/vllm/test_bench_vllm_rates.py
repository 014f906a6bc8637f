"""``python -m bench.vllm.rates`` at its smallest (8 running requests, 150 steps, one and two engine
cores, no spans exported: rotel is not in this environment): it runs the real tap, channel and
consumer and writes its section, every request the model finished recorded finished, nothing lost
at this size (8 MiB of backlog for 150 small frames). No figure of speed is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_vllm_rates_writes_its_section(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"other": 1}))
    args = ["--batches", "8", "--rates", "400", "--dp", "1", "2", "--steps", "150", "--traces", "none"]
    done = subprocess.run(
        [sys.executable, "-m", "bench.vllm.rates", *args, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["other"] == 1
    r = results["vllm_stream_rates"]
    assert [(run["batch"], run["engines"], run["steps_per_s_asked"]) for run in r["runs"]] == [(8, 1, 400), (8, 2, 400)]
    for run in r["runs"]:
        assert run["lost_frames"] == 0 and run["copied_bytes_per_step"] >= 0
        assert run["finished_recorded"] == run["finished_expected"] > 0
        assert run["send_idle"]["n"] + (run["send_backlog"] or {"n": 0})["n"] == 150 * run["engines"]
    assert set(r["highest_sustained"]) == {"8x1", "8x2"} and set(r["send_us"]) == {"8"}
    assert r["send_us"]["8"]["nothing_waiting"]["n"] + (r["send_us"]["8"]["backlog"] or {"n": 0})["n"] == 450
    assert "highest rate sustained (nothing lost, nothing left behind), batch x DP 8x1" in done.stdout


def test_bench_vllm_rates_compares_one_consumer_with_a_process_per_engine(tmp_path: Path) -> None:
    """``--consumers one per-engine`` at DP 2: both arrangements record every finish, the second
    with engine 1 in a process of its own (its CPU counted apart); the section's other keys kept."""
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"vllm_stream_rates": {"runs": ["kept"]}}))
    args = ["--batches", "8", "--rates", "400", "--dp", "2", "--steps", "150", "--traces", "none"]
    done = subprocess.run(
        [sys.executable, "-m", "bench.vllm.rates", *args, "--consumers", "one", "per-engine", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())["vllm_stream_rates"]
    assert r["runs"] == ["kept"]
    by = r["by_consumers"]
    assert sorted(by) == ["one", "per-engine"]
    for mode, processes in (("one", 1), ("per-engine", 2)):
        (run,) = by[mode]["runs"]
        assert run["consumers"] == mode and run["lost_frames"] == 0
        assert run["finished_recorded"] == run["finished_expected"] > 0
        assert len(run["consumer_cores_by_process"]) == processes
    assert by["per-engine"]["runs"][0]["consumer_cores_by_process"][1] > 0  # engine 1 recorded by its worker
