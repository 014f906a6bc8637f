"""`opentelemetry-instrument transformers serve --continuous-batching` end to end on a CPU: the
instrumentor loaded by its entry point, concurrent HTTP completions each with a `traceparent`,
spans over OTLP to a real receiver, metrics on the Prometheus endpoint.

What the engine reports here is what the HTTP client sees (request ids, token counts); its
evictions cannot be counted from outside the server process, so the telemetry's three views of
them (span attributes, span events, the node counter) are checked against each other, and the
exact count against the engine in test_generate_batch and test_manager."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from otel_llm.testing.models import make_tokenizer
from tests.support.backends import free_port, start_otlp_sink, wait_until

NUM_REQUESTS = 12
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    make_tokenizer(tiny_model_dir)
    command = shutil.which("opentelemetry-instrument", path=str(Path(sys.executable).parent))
    assert command is not None, "opentelemetry-instrument is not installed beside this Python"
    port, metrics_port = free_port(), free_port()
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("w+")
    with start_otlp_sink("grpc") as sink:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(
            HF_HUB_OFFLINE="1",
            OMP_NUM_THREADS="1",
            OTEL_SERVICE_NAME="transformers-serve",
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_METRICS_EXPORTER="prometheus",
            OTEL_EXPORTER_PROMETHEUS_PORT=str(metrics_port),
            OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint,
            OTEL_EXPORTER_OTLP_INSECURE="true",
            OTEL_BSP_SCHEDULE_DELAY="100",
            OTEL_LLM_MODEL_NAME="tiny",
        )
        process = subprocess.Popen(
            [
                command,
                str(Path(sys.executable).parent / "transformers"),
                "serve",
                str(tiny_model_dir),
                "--continuous-batching",
                "--cb-block-size",
                "16",
                "--cb-num-blocks",
                "6",
                "--cb-max-batch-tokens",
                "128",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            base = f"http://127.0.0.1:{port}"

            def healthy() -> bool:
                assert process.poll() is None, f"transformers serve exited: {_tail(log)}"
                with urllib.request.urlopen(base + "/health", timeout=5) as response:
                    return response.status == 200

            wait_until(healthy, 180, interval=0.5, what="transformers serve /health")
            yield {
                "model": str(tiny_model_dir),
                "base": base,
                "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
                "sink": sink,
                "log": log,
            }
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)


def _tail(log: Any) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-3000:]


def complete(server: dict[str, Any], i: int, trace_id: str) -> dict[str, Any]:
    rng = random.Random(i)
    prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(2, 6)))
    body = json.dumps({"model": server["model"], "prompt": prompt, "max_tokens": MAX_TOKENS}).encode()
    request = urllib.request.Request(
        server["base"] + "/v1/completions",
        data=body,
        headers={
            "content-type": "application/json",
            "x-request-id": f"http-{i}",
            "traceparent": f"00-{trace_id}-{i + 1:016x}-01",
        },
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return dict(json.load(response))


def attributes(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def test_serve_spans_parented_by_traceparent_and_metrics(server: dict[str, Any]) -> None:
    trace_ids = {i: f"{random.Random(100 + i).getrandbits(128):032x}" for i in range(NUM_REQUESTS)}
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        responses = list(pool.map(lambda i: complete(server, i, trace_ids[i]), range(NUM_REQUESTS)))
    assert [r["id"] for r in responses] == [f"http-{i}" for i in range(NUM_REQUESTS)]
    assert all(r["usage"]["completion_tokens"] == MAX_TOKENS for r in responses)

    sink = server["sink"]

    def request_spans() -> dict[str, Any]:
        found: dict[str, Any] = {str(attributes(s).get("gen_ai.request.id")): s for s in sink.spans()}
        return found if all(f"http-{i}" in found for i in range(NUM_REQUESTS)) else {}

    spans = wait_until(request_spans, 60, interval=0.2, what="every request span over OTLP")
    preempted_events = 0
    for i, response in enumerate(responses):
        span = spans[f"http-{i}"]
        attrs = attributes(span)
        assert span.trace_id.hex() == trace_ids[i] and span.parent_span_id.hex() == f"{i + 1:016x}"
        assert attrs["gen_ai.usage.output_tokens"] == response["usage"]["completion_tokens"]
        assert attrs["gen_ai.usage.input_tokens"] == response["usage"]["prompt_tokens"]
        assert attrs["gen_ai.provider.name"] == "transformers"
        events = [e for e in span.events if e.name == "preempted"]
        assert [attributes(e)["ordinal"] for e in events] == list(range(1, attrs["llm.request.num_preemptions"] + 1))
        preempted_events += len(events)

    def scraped() -> dict[str, float]:
        with urllib.request.urlopen(server["metrics"], timeout=10) as response:
            text = response.read().decode()
        samples = {
            s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels.get("le")
        }
        return samples if samples.get("llm_server_request_num_preemptions_count") == NUM_REQUESTS else {}

    samples = wait_until(scraped, 30, interval=0.2, what="every request on /metrics")
    assert (
        samples["llm_server_request_num_preemptions_sum"] == samples["llm_server_preemptions_total"] == preempted_events
    )
    assert preempted_events > 0  # 6 blocks of 16 tokens: the engine evicted
