"""Replace mode on vLLM's real engine, the plugin's default (``OTEL_LLM_VLLM_METRICS`` unset):
vLLM builds no Prometheus logger of its own and its /metrics route is answered by the plugin.
One server for the module (deep hook on, spans over OTLP to a loopback sink); vLLM's /metrics
scraped while it is up (it answers from then on), after 64 concurrent completions with real
preemptions."""

from __future__ import annotations

import ast
import json
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from otel_llm.testing.vllm.server import Load, VllmServer, run_load, scrape
from tests.support.backends import wait_until

LOAD = Load(requests=64, concurrency=64, max_tokens=96, seed=3)
Samples = dict[tuple[str, frozenset], float]


@dataclass
class Run:
    server: VllmServer
    start_statuses: set[int]
    start: Samples
    after: Samples
    text: str
    spans: list[Any]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0  # not listening yet


@pytest.fixture(scope="module")
def run(tiny_model: Path, otlp_sink: Any) -> Run:
    server = VllmServer(
        tiny_model,
        env={
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_sink.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_LLM_VLLM_DEEP_HOOK": "1",
        },
    )
    with server:
        # start() waited for /health: vLLM's /metrics answers from then on, never with a 500.
        statuses = {_status(server.url + "/metrics") for _ in range(5)}
        start = scrape(server.url + "/metrics")
        completions = run_load(server.url, LOAD)
        failed = [c for c in completions if c.status != 200]
        assert not failed, f"{len(failed)} failed, e.g. {failed[0]}\n{server.log_tail()}"
        wait_until(lambda: len(otlp_sink.spans()) >= LOAD.requests, 120, interval=0.5, what="every request span")
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        return Run(server, statuses, start, scrape(server.url + "/metrics"), text, list(otlp_sink.spans()))


def _total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def test_vllm_builds_no_logger_of_its_own(run: Run) -> None:
    assert "runs as add" not in run.server.log_path.read_text(errors="replace")
    assert run.start_statuses == {200}
    # Created at start at zero, as vLLM creates them, with our never-preempted bucket beside.
    assert _total(run.start, "vllm:generation_tokens_total") == 0
    assert any(n == "vllm:request_num_preemptions_bucket" and ("le", "0.5") in ls for n, ls in run.start)


def test_values_after_a_load_with_real_preemptions(run: Run) -> None:
    tokens = LOAD.requests * LOAD.max_tokens
    assert _total(run.after, "vllm:generation_tokens_total") == tokens
    assert _total(run.after, "vllm:request_success_total", finished_reason="length") == LOAD.requests
    assert _total(run.after, "vllm:request_num_preemptions_count") == LOAD.requests
    preemptions = _total(run.after, "vllm:num_preemptions_total")
    assert preemptions > 0, "no preemption: the KV pressure did not hold"
    assert _total(run.after, "vllm:request_num_preemptions_sum") == preemptions
    events = sum(1 for s in run.spans for e in s.events if e.name == "preempted")
    assert events == preemptions


def test_vllms_own_expected_metrics_list_passes_on_vllms_route(run: Run, vllm_sdist: Path) -> None:
    source = (vllm_sdist / "tests/entrypoints/serve/instrumentator/test_metrics.py").read_text()
    expected = next(
        ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EXPECTED_METRICS_V1" for t in node.targets)
    )
    assert len(expected) > 40
    absent = [name for name in expected if name not in run.text]
    assert not absent, absent
    info = [dict(labels) for (name, labels) in run.after if name == "vllm:cache_config_info"]
    assert info and all(i.get("kv_cache_size_tokens") not in (None, "None", "") for i in info)


def test_every_series_vllms_example_dashboards_query_is_served(run: Run, vllm_sdist: Path) -> None:
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    names: set[str] = set()
    for path in sorted((vllm_sdist / "examples/observability").rglob("*.json")):
        text = json.dumps(json.loads(path.read_text()))
        for expr in re.findall(r'"expr": "((?:[^"\\]|\\.)*)"', text):
            names.update(re.findall(r"vllm:[a-zA-Z0-9_:]+", expr))
    assert len(names) > 10
    # What vLLM 0.32 still exports (its dashboards also query names it dropped): the names its own
    # logger's code creates, read from the class's source.
    import inspect

    from vllm.v1.metrics import loggers

    created = set(re.findall(r'"(vllm:[a-zA-Z0-9_:]+)"', inspect.getsource(loggers)))
    assert PrometheusStatLogger.__module__ == loggers.__name__
    served = {name for name, _ in run.after}
    queried = {n for n in names if n in created or n.removesuffix("_total") in created}
    for suffix in ("_bucket", "_sum", "_count"):
        queried |= {n for n in names if n.endswith(suffix) and n.removesuffix(suffix) in created}
    assert len(queried) > 10
    absent = sorted(queried - served)
    assert not absent, absent
