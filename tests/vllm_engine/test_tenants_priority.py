"""Tenants by priority class on vLLM's real engine (CPU build), under either frontend: with
``--scheduling-policy priority`` and ``OTEL_LLM_TENANT=priority``, a load of three priority classes
under KV pressure. Who suffered and who caused it, by class, against the engine core's own record
(tests/vllm_engine/preemption_truth, which now writes the victim's and the cause's priority as the
scheduler holds them): the tenant matrix, each class's ``request_num_preemptions``, and their sums
against vLLM's own /metrics (the Rust frontend's under it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from engine_record import Samples, by_label, matrix, read_record, recording_env, scrape_once_counted, total

from otel_llm.testing.vllm.server import ADD_MODE, Load, VllmServer, run_load, rust_frontend_missing
from tests.support.backends import require_backend

CLASSES = 3
LOAD = Load(requests=48, concurrency=48, max_tokens=96, seed=5, traced=False, priorities=CLASSES)


@dataclass
class Run:
    truth: list[dict[str, Any]]  # the engine core's preemptions, with both priorities
    ours: Samples  # otel-llm's /metrics, every request counted
    theirs: Samples  # vLLM's own /metrics (the Rust frontend's under it)
    rust: bool  # under the Rust frontend


@pytest.fixture(scope="module", params=["python", "rust"])
def run(request: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    rust = request.param == "rust"
    if rust and (missing := rust_frontend_missing()) is not None:
        require_backend("vllm-rs", missing)
    truth_file = tmp_path_factory.mktemp("tenant-truth") / "preemptions.jsonl"
    server = VllmServer(
        tiny_model,
        env={
            "OTEL_LLM_TENANT": "priority",
            **recording_env(truth_file),
            **ADD_MODE,
        },
        args=("--scheduling-policy", "priority"),
        rust_frontend=rust,
    )
    with server:
        completions = run_load(server.url, LOAD)
        assert [c.status for c in completions] == [200] * LOAD.requests, server.log_tail()
        theirs = scrape_once_counted(server.url + "/metrics", LOAD.requests)
        ours = scrape_once_counted(server.metrics_url, LOAD.requests)
        yield Run(read_record(truth_file), ours, theirs, rust)


def test_the_tenant_matrix_is_the_engine_cores_record(run: Run) -> None:
    truth = Counter((str(t["victim_priority"]), str(t["cause_priority"])) for t in run.truth if t["cause"])
    assert sum(truth.values()) == len(run.truth) >= 20  # every preemption made room for a request
    assert any(victim != cause for victim, cause in truth), truth  # some crossed classes
    ours = matrix(run.ours)
    assert ours == dict(truth)


def test_each_class_has_its_own_preemption_histogram_summing_to_vllms(run: Run) -> None:
    per_class = Counter(str(t["victim_priority"]) for t in run.truth)
    sums = by_label(run.ours, "vllm:request_num_preemptions_sum", "tenant")
    counts = by_label(run.ours, "vllm:request_num_preemptions_count", "tenant")
    assert {k: v for k, v in sums.items() if v} == dict(per_class)
    # (Beside them, the empty series made at start, as vLLM makes its own, count nothing.)
    assert {k: v for k, v in counts.items() if v} == {str(c): LOAD.requests / CLASSES for c in range(CLASSES)}
    for name in ("vllm:request_num_preemptions_sum", "vllm:request_num_preemptions_count"):
        assert total(run.ours, name) == total(run.theirs, name), name


def test_each_class_has_its_own_latencies_and_tokens_summing_to_vllms(run: Run) -> None:
    """Time to first token, inter-token latency and the token counters, per class: one first token
    per request of the class, every observation under a class, and summed over the classes,
    vLLM's own: bucket by bucket under the Python frontend, whose values they are; the counts
    under the Rust frontend, whose values come from the engine core's stream, on its clock."""
    ttft, itl = "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"
    counts = by_label(run.ours, ttft + "_count", "tenant")
    assert {k: v for k, v in counts.items() if v} == {str(c): LOAD.requests / CLASSES for c in range(CLASSES)}
    for name in (ttft + "_count", itl + "_count", "vllm:generation_tokens_total", "vllm:prompt_tokens_total"):
        assert all("tenant" in dict(labels) for (n, labels), v in run.ours.items() if n == name and v), name
        assert total(run.ours, name) == total(run.theirs, name) > 0, name
    if not run.rust:
        for name in (ttft + "_bucket", itl + "_bucket"):
            assert by_label(run.ours, name, "le") == by_label(run.theirs, name, "le"), name
