"""The benchmark suite runs (``python -m bench --tiny``) and writes every section with finite numbers.

No timing assertions: these machines are shared and noisy; the suite reports ratios, it does not
judge them here. This only keeps bench/ from rotting.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("per_event", "throughput", "memory", "export", "outage")


def _numbers(value, path="$"):
    """Every number in a JSON value, with its path."""
    if isinstance(value, bool):
        return
    if value is None:  # the suite writes NaN/inf as null
        yield path, math.nan
    elif isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{path}[{i}]")


def test_bench_tiny_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "results-tiny.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--tiny", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["tiny"] is True
    for section in SECTIONS:
        data = results.get(section)
        assert isinstance(data, dict), f"missing section {section}"
        assert "error" not in data, f"{section}: {data.get('error')}"
        numbers = list(_numbers(data))
        assert numbers, f"{section} has no numbers"
        for path, value in numbers:
            assert math.isfinite(value), f"{section}{path[1:]} = {value}"

    pe = results["per_event"]
    assert pe["sanity"]["ok"], pe["sanity"]["mismatches"]
    assert pe["proposals"]["equal_totals"]
    for name in ("ours", "ours_spans", "floor", "prometheus_client", "naive_otel"):
        assert pe["ns_per_event"][name] > 0
    for key in ("ours/prometheus_client", "ours/floor", "naive_otel/prometheus_client"):
        assert pe["ratios"][key] > 0
    tp = results["throughput"]
    assert tp["same_schedule"] and tp["preemptions"] > 0
    assert set(tp["tokens_per_s"]) >= {"off", "metrics", "full"}
    mem = results["memory"]
    assert mem["rss_after_finished"]["finished_counted"] >= mem["rss_after_finished"]["requests"]
    assert set(results["export"]["by_engines"]) == {"1", "8", "64"}
    outage = results["outage"]
    requests = outage["requests"]
    assert outage["spans_delivered"] == {"healthy": requests, "outage": 0, "outage_no_backoff": 0}
    assert outage["spans_dropped"] == {"healthy": 0, "outage": requests, "outage_no_backoff": requests}
    assert "profile" in results and results["profile"]["ours"]["top_cumulative"]
    assert "1. per-event cost" in proc.stdout  # the table
