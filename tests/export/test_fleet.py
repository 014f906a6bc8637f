"""A fleet: 8 engine_stub processes (``python -m engine_stub``, the plugin loaded by its entry
point) push OTLP/gRPC to one collector (rotel), which forwards to a loopback receiver.

Each process exports with its own ``service.instance.id``: the receiver keeps the processes'
series apart, and the sums over processes are exact — requests, preemptions, the
``request_num_preemptions`` histogram's count, sum and buckets (checked bucket by bucket against
the spans' own counts) — with one span per request. Every process exits after its run:
shutdown flushes, nothing is lost. Cumulative and delta temporality.
"""

from __future__ import annotations

import bisect
import os
import re
import socket
import subprocess
import sys
from collections import Counter, defaultdict
from typing import Any

import pytest

from otel_llm.config.buckets import REQUEST_NUM_PREEMPTIONS
from tests.support.backends import rotel_to_sink, wait_until

pytestmark = pytest.mark.backend

PROCESSES = 8
REQUESTS = 20  # per process


def _instance(resource: Any) -> str:
    return next(a.value.string_value for a in resource.attributes if a.key == "service.instance.id")


def _per_process(sink: Any, name: str, delta: bool) -> dict[str, dict[frozenset, Any]]:
    """{instance id: {point attributes: value}}: the last cumulative point, or the sum of deltas.
    A histogram's value is (count, sum, bucket counts)."""
    out: dict[str, dict[frozenset, Any]] = defaultdict(dict)
    with sink.lock:
        requests = list(sink.metrics)
    for request in requests:
        for rm in request.resource_metrics:
            instance = _instance(rm.resource)
            for m in (m for sm in rm.scope_metrics for m in sm.metrics if m.name == name):
                kind = m.WhichOneof("data")
                for p in getattr(m, kind).data_points:
                    key = frozenset((a.key, a.value.string_value) for a in p.attributes)
                    previous = out[instance].get(key) if delta else None
                    if kind == "histogram":
                        value: Any = (p.count, p.sum, tuple(p.bucket_counts))
                        if previous is not None:
                            value = (
                                previous[0] + value[0],
                                previous[1] + value[1],
                                tuple(a + b for a, b in zip(previous[2], value[2])),
                            )
                    else:
                        value = (p.as_int or p.as_double) + (previous or 0)
                    out[instance][key] = value
    return out


def _ground_truth(stdout: str) -> tuple[int, int]:
    requests = re.search(r"^requests\s+(\d+)", stdout, re.M)
    preemptions = re.search(r"^preemptions\s+(\d+)", stdout, re.M)
    assert requests and preemptions, stdout
    return int(requests.group(1)), int(preemptions.group(1))


def _fleet_env(rotel: Any, **settings: str) -> dict[str, str]:
    """The environment of an engine_stub process with the plugin pushing OTLP/gRPC to ``rotel``:
    none of the caller's OTEL_* variables, then ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        ENGINE_STUB_PLUGINS="otel",
        OTEL_METRICS_EXPORTER="otlp",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{rotel.grpc_port}",
        OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
    )
    env.update(settings)
    return env


def _run_engines(env: dict[str, str], seeds: range) -> list[tuple[str, str]]:
    """(stdout, stderr) of one ``python -m engine_stub`` per seed, run side by side to the end."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "engine_stub", "--requests", str(REQUESTS), "--seed", str(i), "--kv-blocks", "24"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in seeds
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
        outputs.append((out, err))
    return outputs


def _totals(sink: Any, delta: bool) -> list[tuple[int, int]]:
    """Each process's (requests, preemptions) at the receiver, sorted."""
    success = _per_process(sink, "vllm:request_success", delta)
    preemptions = _per_process(sink, "vllm:num_preemptions", delta)
    return sorted((int(sum(success[i].values())), int(sum(preemptions.get(i, {}).values()))) for i in success)


@pytest.mark.parametrize("temporality", ["cumulative", "delta"])
def test_a_fleet_of_engine_processes_adds_up_exactly_at_the_collector(clean_env, temporality):
    delta = temporality == "delta"
    with rotel_to_sink() as (sink, rotel):
        env = _fleet_env(
            rotel,
            OTEL_METRIC_EXPORT_INTERVAL="500",
            OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE=temporality,
            # Eight processes flush at once on two cores: an export acknowledged after the default
            # 10 s would be sent again (the exporters retry a timed-out export), counted twice.
            OTEL_EXPORTER_OTLP_TIMEOUT="60",
        )
        truths = [_ground_truth(out) for out, _ in _run_engines(env, range(PROCESSES))]
        total_requests = sum(r for r, _ in truths)
        total_preemptions = sum(p for _, p in truths)
        assert total_requests == PROCESSES * REQUESTS and total_preemptions > 0
        # Every process has exited (its shutdown flushed); rotel forwards within its 50 ms batches.
        wait_until(lambda: len(sink.spans()) >= total_requests, 60, interval=0.1, what="every request span")

        # Each process flushed at exit; its last exports cross rotel within its 50 ms batches.
        # Kept apart: each process's own totals are one of the ground truths.
        try:
            wait_until(lambda: _totals(sink, delta) == sorted(truths), 60, interval=0.1, what="every process's totals")
        except TimeoutError:
            assert _totals(sink, delta) == sorted(truths)

        spans = sink.spans()
        assert len(spans) == total_requests
        assert (
            len({next(a.value.string_value for a in s.attributes if a.key == "gen_ai.request.id") for s in spans})
            == REQUESTS
        )  # request ids repeat across processes: one span per request each

        histogram = _per_process(sink, "vllm:request_num_preemptions", delta)
        assert len(histogram) == PROCESSES
        # Summed over processes, exact: count, sum and every bucket.
        counts = [sum(v[0] for v in histogram[i].values()) for i in histogram]
        assert sum(counts) == total_requests
        assert sum(v[1] for i in histogram for v in histogram[i].values()) == total_preemptions
        buckets = [sum(col) for col in zip(*(v[2] for i in histogram for v in histogram[i].values()))]
        per_span = Counter(
            bisect.bisect_left(
                REQUEST_NUM_PREEMPTIONS,
                next(a.value.int_value for a in s.attributes if a.key == "llm.request.num_preemptions"),
            )
            for s in spans
        )
        assert buckets == [per_span.get(i, 0) for i in range(len(REQUEST_NUM_PREEMPTIONS) + 1)]


def test_engine_processes_sharing_a_taken_prometheus_port_still_push_everything(clean_env):
    """Two engine_stub processes (the plugin loaded by its entry point) told to serve /metrics on
    a port another process holds: each says so in one line and serves none, and every request
    still reaches the collector over OTLP, each process's totals exact."""
    with rotel_to_sink() as (sink, rotel), socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        env = _fleet_env(
            rotel,
            OTEL_METRICS_EXPORTER="prometheus,otlp",
            OTEL_EXPORTER_PROMETHEUS_PORT=str(port),
            OTEL_METRIC_EXPORT_INTERVAL="500",
        )
        truths = []
        for out, err in _run_engines(env, range(2)):
            said = [line for line in err.splitlines() if "no /metrics endpoint in this process" in line]
            assert len(said) == 1 and f"127.0.0.1:{port}" in said[0] and "OTEL_LLM_PROMETHEUS_PORTS" in said[0], err
            truths.append(_ground_truth(out))
        wait_until(lambda: len(sink.spans()) >= 2 * REQUESTS, 60, interval=0.1, what="every request span")
        try:
            wait_until(lambda: _totals(sink, False) == sorted(truths), 60, interval=0.1, what="every process's totals")
        except TimeoutError:
            assert _totals(sink, False) == sorted(truths)
        assert len(sink.spans()) == 2 * REQUESTS


def test_a_process_killed_mid_export_leaves_the_survivors_totals_exact(clean_env):
    """One of three processes is killed (SIGKILL) after its first exports reached the collector;
    the other two finish: their totals at the receiver are exactly theirs."""
    with rotel_to_sink() as (sink, rotel):
        env = _fleet_env(rotel, OTEL_METRIC_EXPORT_INTERVAL="200")
        victim = subprocess.Popen(
            [sys.executable, "-m", "engine_stub", "--requests", "100000", "--seed", "9"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(
                lambda: len(_per_process(sink, "vllm:request_success", False)) == 1,
                120,
                interval=0.1,
                what="the victim's first export",
            )
            (victim_id,) = _per_process(sink, "vllm:request_success", False)
            survivors = [
                subprocess.Popen(
                    [sys.executable, "-m", "engine_stub", "--requests", str(REQUESTS), "--seed", str(i)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for i in range(2)
            ]
            victim.kill()  # mid-run, between or during exports
            victim.wait(30)
            truths = []
            for proc in survivors:
                out, err = proc.communicate(timeout=600)
                assert proc.returncode == 0, err[-2000:]
                truths.append(_ground_truth(out))
        finally:
            if victim.poll() is None:
                victim.kill()

        def survivors_totals() -> list[tuple[int, int]]:
            success = _per_process(sink, "vllm:request_success", False)
            preemptions = _per_process(sink, "vllm:num_preemptions", False)
            return sorted(
                (int(sum(success[i].values())), int(sum(preemptions.get(i, {}).values())))
                for i in success
                if i != victim_id
            )

        # The survivors flushed at exit; their last exports cross rotel within its 50 ms batches.
        try:
            wait_until(lambda: survivors_totals() == sorted(truths), 60, interval=0.1, what="the survivors' totals")
        except TimeoutError:
            assert survivors_totals() == sorted(truths)
