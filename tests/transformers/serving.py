"""`opentelemetry-instrument transformers serve --continuous-batching` on a CPU, for the serve test
modules: the tiny Llama with 6 KV blocks of 16 tokens (about one eviction per request under
concurrency), spans over OTLP to a real receiver, metrics on the Prometheus endpoint."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from prometheus_client.parser import text_string_to_metric_families

from otel_llm.testing.models import make_tokenizer
from tests.support.backends import OtlpSink, free_port, start_otlp_sink, wait_until

MAX_TOKENS = 40


@dataclass
class Server:
    model: str
    base: str
    metrics: str
    sink: OtlpSink
    log: Any

    def log_text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return str(self.log.read())

    def samples(self) -> list[Any]:
        """Every sample on the Prometheus endpoint now."""
        with urllib.request.urlopen(self.metrics, timeout=10) as response:
            text = response.read().decode()
        return [s for family in text_string_to_metric_families(text) for s in family.samples]


@contextmanager
def serve(model_dir: Path, log_path: Path, env: Mapping[str, str] = {}) -> Iterator[Server]:
    """The server, healthy, with the OTEL_* settings of the suite and ``env`` on top."""
    make_tokenizer(model_dir)
    command = shutil.which("opentelemetry-instrument", path=str(Path(sys.executable).parent))
    assert command is not None, "opentelemetry-instrument is not installed beside this Python"
    port, metrics_port = free_port(), free_port()
    log = log_path.open("w+")
    with start_otlp_sink("grpc") as sink:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        environ.update(
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
        environ.update(env)
        process = subprocess.Popen(
            [
                command,
                str(Path(sys.executable).parent / "transformers"),
                "serve",
                str(model_dir),
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
            env=environ,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        server = Server(
            str(model_dir), f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", sink, log
        )
        try:

            def healthy() -> bool:
                assert process.poll() is None, f"transformers serve exited: {server.log_text()[-3000:]}"
                with urllib.request.urlopen(server.base + "/health", timeout=5) as response:
                    return response.status == 200

            wait_until(healthy, 180, interval=0.5, what="transformers serve /health")
            yield server
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)


def complete(server: Server, i: int, trace_id: str, headers: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """Completion ``http-{i}`` of a seeded prompt, MAX_TOKENS long, with a ``traceparent`` in
    ``trace_id`` (parent span id ``i + 1``) and ``headers`` on top."""
    rng = random.Random(i)
    prompt = " ".join(rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(2, 6)))
    body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS}).encode()
    request = urllib.request.Request(
        server.base + "/v1/completions",
        data=body,
        headers={
            "content-type": "application/json",
            "x-request-id": f"http-{i}",
            "traceparent": f"00-{trace_id}-{i + 1:016x}-01",
            **(headers or {}),
        },
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return dict(json.load(response))


def trace_id(i: int) -> str:
    return f"{random.Random(100 + i).getrandbits(128):032x}"


def attributes(item: Any) -> dict[str, Any]:
    """An OTLP span's or span event's attributes as Python values (arrays as tuples)."""
    out = {}
    for kv in item.attributes:
        out[kv.key] = _value(kv.value)
    return out


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, kind)


def request_spans(server: Server, request_ids: list[str]) -> dict[str, Any]:
    """The request spans by request id, once every one of ``request_ids`` arrived over OTLP."""

    def arrived() -> dict[str, Any]:
        found: dict[str, Any] = {str(attributes(s).get("gen_ai.request.id")): s for s in server.sink.spans()}
        return found if all(rid in found for rid in request_ids) else {}

    return dict(wait_until(arrived, 60, interval=0.2, what="every request span over OTLP"))
