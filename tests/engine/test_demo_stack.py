"""`otel-llm demo --stack` (`make demo-stack`): the demo against a local Prometheus and Phoenix.

While the demo serves, every worst request it prints is checked on the stack itself: its bucket's
PromQL in Prometheus holds it, its trace URL's trace in Phoenix is its request span with its
preemptions. Then a missing Phoenix or Prometheus: one clear line, no traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from otel_llm.stack.phoenix import MISSING, executable
from otel_llm.stack.ports import free_port
from tests.engine.test_demo import READY_TIMEOUT, demo_command, read_until_serving, sigint_not_ignored
from tests.support.backends import prometheus_binary, require_backend
from tests.support.sdk_versions import needs_prometheus_exporter

HEADER = re.compile(r"drill-down: Prometheus (http://\S+) \(exemplar storage on\), Phoenix (http://\S+)$")
WORST_BUCKET = re.compile(r"\s+worst bucket\s+(\S+_bucket\{le=\"([^\"]+)\"\}): (\d+) requests?$")
WORST = re.compile(
    r"\s+(req-\d+)\s+(\d+) preemptions\s+(\S+\{le=\"([^\"]+)\"\})\s+(http://\S+/redirects/traces/([0-9a-f]{32}))(.*)$"
)


def get(url: str, **params: str) -> Any:
    with urllib.request.urlopen(url + ("?" + urllib.parse.urlencode(params) if params else ""), timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.backend
@needs_prometheus_exporter("0.64b0", "exemplars on the Prometheus endpoint")
def test_demo_stack_prints_the_worst_requests_with_their_bucket_query_and_trace_url(tmp_path: Path) -> None:
    if prometheus_binary() is None or executable() is None:
        require_backend("prometheus and phoenix", f"apt-get install prometheus; {MISSING}")
    args = [
        "--stack",
        "--requests",
        "60",
        "--prometheus-port",
        str(free_port()),
        "--serve-seconds",
        "300",
        "--no-progress",
    ]
    stderr = tmp_path / "stderr.txt"
    with sigint_not_ignored():
        proc = subprocess.Popen(demo_command() + args, stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True)
    try:
        lines, _ = read_until_serving(proc)
        [(prometheus, phoenix)] = [m.groups() for line in lines if (m := HEADER.match(line))]
        [(worst_bucket, worst_le, worst_count)] = [m.groups() for line in lines if (m := WORST_BUCKET.match(line))]
        worst = [m.groups() for line in lines if (m := WORST.match(line))]
        assert len(worst) == 5, "\n".join(lines)

        buckets = get(prometheus + "/api/v1/query", query="sum by (le) (vllm:request_num_preemptions_bucket)")
        cumulative = sorted((float(r["metric"]["le"]), float(r["value"][1])) for r in buckets["data"]["result"])
        bounds = [le for le, _ in cumulative]
        per_bucket = dict(zip(bounds, (c - b for (_, c), b in zip(cumulative, [0.0] + [c for _, c in cumulative]))))
        assert [le for le, n in per_bucket.items() if n][-1] == float(worst_le)
        assert per_bucket[float(worst_le)] == int(worst_count)

        exemplar_marks = 0
        for request_id, count, bucket, le, url, trace_id, marks in worst:
            # The bucket named is the request's: the lowest bound at or above its count.
            assert float(le) == next(b for b in bounds if int(count) <= b)
            [series] = get(prometheus + "/api/v1/query", query=bucket)["data"]["result"]
            assert series["metric"]["le"] == le
            if "an exemplar" in marks:
                exemplar_marks += 1
                held = get(prometheus + "/api/v1/query_exemplars", query=bucket, start="0", end="9999999999")
                assert trace_id in {e["labels"]["trace_id"] for s in held["data"] for e in s["exemplars"]}
            assert "NOT in Phoenix" not in marks
            assert url == f"{phoenix}/redirects/traces/{trace_id}"
            [span] = get(f"{phoenix}/v1/projects/default/spans", trace_id=trace_id)["data"]
            assert span["attributes"]["gen_ai.request.id"] == request_id
            assert span["attributes"]["llm.request.num_preemptions"] == int(count)
            assert sum(e["name"] == "preempted" for e in span["events"]) == int(count)
        assert exemplar_marks >= 1, "\n".join(lines)
        assert [int(c) for _, c, *_ in worst] == sorted((int(c) for _, c, *_ in worst), reverse=True)

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, stderr.read_text()
    finally:
        if proc.poll() is None:  # a failure above: SIGINT lets the demo stop its stack
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for url in (prometheus + "/-/ready", phoenix + "/healthz"):  # the stack stopped with the demo
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url, timeout=5)


@pytest.mark.parametrize("missing", ["phoenix", "prometheus"])
def test_demo_stack_names_what_is_missing_in_one_line(missing: str, tmp_path: Path) -> None:
    env = dict(os.environ, OTEL_LLM_PHOENIX=str(tmp_path / "no-such-phoenix"))
    if missing == "prometheus":
        env["PATH"] = str(tmp_path)  # no prometheus on it
    run = subprocess.run(
        demo_command() + ["--stack", "--requests", "5", "--prometheus-port", "0", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=READY_TIMEOUT,
        env=env,
    )
    expected = {
        "phoenix": f"otel-llm demo --stack: Phoenix is not installed: {MISSING}",
        "prometheus": "otel-llm demo --stack: Prometheus is not installed: apt-get install prometheus",
    }[missing]
    assert (run.returncode, run.stderr.strip()) == (2, expected)
