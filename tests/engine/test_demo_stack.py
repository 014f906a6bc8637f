"""`otel-llm demo --stack` (`make demo-stack`): the demo against a local Prometheus and Phoenix.

While the demo serves, every worst request and every worst evictor it prints is checked on the
stack itself: its bucket's PromQL in Prometheus holds it, its trace URL's trace in Phoenix is its
request span with its preemptions (suffered; caused, which the victims' spans in Phoenix name it
for). Then a missing Phoenix or Prometheus: one clear line, no traceback.
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
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from otel_llm.stack.phoenix import MISSING, executable
from otel_llm.stack.ports import free_port
from tests.engine.test_demo import READY_TIMEOUT, demo_command, parse_evictors, read_until_serving, sigint_not_ignored
from tests.support.backends import prometheus_binary, require_backend, wait_until
from tests.support.sdk_versions import needs_prometheus_exporter

HEADER = re.compile(r"drill-down: Prometheus (http://\S+) \(exemplar storage on\), Phoenix (http://\S+)$")
WORST_BUCKET = re.compile(r"\s+worst bucket\s+((\S+)_bucket\{le=\"([^\"]+)\"\}): (\d+) requests?$")
ROW = r"\s+(req-\d+)\s+(\d+) {}\s+(\S+\{{le=\"([^\"]+)\"\}})\s+(http://\S+/redirects/traces/([0-9a-f]{{32}}))(.*)$"
WORST, WORST_EVICTOR = re.compile(ROW.format("preemptions")), re.compile(ROW.format("caused"))
SUFFERED, CAUSED = "vllm:request_num_preemptions", "vllm:request_num_preemptions_caused"
COUNT_OF = {SUFFERED: "llm.request.num_preemptions", CAUSED: "llm.request.num_preemptions_caused"}


def get(url: str, **params: str) -> Any:
    with urllib.request.urlopen(url + ("?" + urllib.parse.urlencode(params) if params else ""), timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.backend
@needs_prometheus_exporter("0.64b0", "exemplars on the Prometheus endpoint")
def test_demo_stack_prints_the_worst_requests_and_evictors_with_their_bucket_query_and_trace_url(
    tmp_path: Path,
) -> None:
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
        worst_buckets = {m.group(2): m.groups() for line in lines if (m := WORST_BUCKET.match(line))}
        assert list(worst_buckets) == [SUFFERED, CAUSED], "\n".join(lines)
        worst = [m.groups() for line in lines if (m := WORST.match(line))]
        evictors = [m.groups() for line in lines if (m := WORST_EVICTOR.match(line))]
        assert len(worst) == len(evictors) == 5, "\n".join(lines)
        for histogram, rows in ((SUFFERED, worst), (CAUSED, evictors)):
            _check_on_the_stack(prometheus, phoenix, histogram, worst_buckets[histogram], rows, lines)

        # The worst evictors are the summary's, and the top 5 of what Phoenix holds; the victims'
        # spans there name each as their cause as often as it caused preemptions.
        assert [(r, int(c), t) for r, c, _, _, _, t, _ in evictors] == [
            (e.request_id, e.caused, e.trace_id) for e in parse_evictors(lines)
        ]
        spans = wait_until(  # Phoenix stores what it receives in batches
            lambda: _request_spans(phoenix, 60), 30, interval=0.2, what="60 llm_request spans in Phoenix"
        )
        assert len(spans) == 60
        caused = {
            s["attributes"]["gen_ai.request.id"]: s["attributes"]["llm.request.num_preemptions_caused"] for s in spans
        }
        assert [r for r, *_ in evictors] == sorted((r for r in caused if caused[r]), key=lambda r: (-caused[r], r))[:5]
        named = Counter(
            cause
            for s in spans
            for e in s["events"]
            if e["name"] == "preempted"
            for cause in e["attributes"]["cause_request_ids"]
        )
        assert {r: named[r] for r, *_ in evictors} == {r: int(c) for r, c, *_ in evictors}

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


def _request_spans(phoenix: str, at_least: int) -> list[dict[str, Any]]:
    """Phoenix's request spans, once it holds ``at_least`` of them (else none)."""
    found = get(f"{phoenix}/v1/projects/default/spans", name="llm_request", limit="1000")["data"]
    return found if len(found) >= at_least else []


def _check_on_the_stack(
    prometheus: str,
    phoenix: str,
    histogram: str,
    worst_bucket: tuple[str, ...],
    rows: list[tuple[str, ...]],
    lines: list[str],
) -> None:
    """The worst bucket named is ``histogram``'s highest non-empty one; each row's bucket is its
    request's, and its trace in Phoenix is that request's span with the count printed."""
    _, _, worst_le, worst_count = worst_bucket
    buckets = get(prometheus + "/api/v1/query", query=f"sum by (le) ({histogram}_bucket)")
    cumulative = sorted((float(r["metric"]["le"]), float(r["value"][1])) for r in buckets["data"]["result"])
    bounds = [le for le, _ in cumulative]
    per_bucket = dict(zip(bounds, (c - b for (_, c), b in zip(cumulative, [0.0] + [c for _, c in cumulative]))))
    assert [le for le, n in per_bucket.items() if n][-1] == float(worst_le)
    assert per_bucket[float(worst_le)] == int(worst_count)

    exemplar_marks = 0
    for request_id, count, bucket, le, url, trace_id, marks in rows:
        # The bucket named is the request's: the lowest bound at or above its count.
        assert bucket.startswith(f"{histogram}_bucket{{")
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
        assert span["attributes"][COUNT_OF[histogram]] == int(count)
        if histogram == SUFFERED:
            assert sum(e["name"] == "preempted" for e in span["events"]) == int(count)
    assert exemplar_marks >= 1, "\n".join(lines)
    assert [int(c) for _, c, *_ in rows] == sorted((int(c) for _, c, *_ in rows), reverse=True)


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
