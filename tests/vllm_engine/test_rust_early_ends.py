"""vLLM's Rust frontend off the happy path, on the real CPU engine: a utility call before the first
request, a frame that fails to translate, clients that drop their streams, requests the frontend
stops on a stop string. Each request gets its span while the server runs, with its reason.

One server for the module (``VLLM_SERVER_DEV_MODE=1`` for ``POST /reset_prefix_cache``), in this
order: the utility call; one request of :data:`TOKENS` tokens alone, the third frame of whose
outputs fails to translate (a fault injected in the consumer: tests/vllm_engine/stream_fault); a
load of :data:`LOAD` requests; :data:`DROPPED` streams their clients close after two chunks (the
engine core held and run in bursts meanwhile); a
probe, then :data:`STOPPED` requests that stop on a string of the probe's text. vllm-rs forwards
no trace context: the spans are known by the engine core's request id, the client's completion id
with a suffix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from otel_llm.testing.span_receiver import span_attributes
from otel_llm.testing.vllm.server import (
    MODEL_NAME,
    Completion,
    Load,
    VllmServer,
    run_load,
    rust_frontend_missing,
    scrape,
)
from tests.support.backends import require_backend, wait_until
from tests.vllm_engine.test_faults import _burst, _engine_cores, _signal

SERVICE = "vllm-rust-early-ends"
FAULT = Path(__file__).resolve().parent / "stream_fault"
TOKENS = 16
FAIL_AT = 3  # the lone request's third output frame fails to translate
LOAD = Load(requests=8, concurrency=8, max_tokens=TOKENS, seed=3, traced=False)
DROPPED = 6
DROPPED_MAX_TOKENS = 200  # far more than a stream makes before its client is gone
MAX_BURSTS = 400  # of the held engine core, until every dropped stream has had two chunks
STOPPED = 3
Samples = dict[tuple[str, frozenset], float]


@dataclass
class Run:
    reset_status: int
    lone: Completion
    load: list[Completion]
    dropped: list[str]  # the completion ids of the streams dropped
    stop: str  # the stop string
    stopped: list[dict[str, Any]]  # the stopped completions' responses
    spans: dict[str, Any]  # by the client's completion id, every span made while the server ran
    rust: Samples  # the Rust /metrics, the engine idle
    ours: Samples  # otel-llm's /metrics, the engine idle


def _post(url: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        text = response.read().decode()
        return response.status, json.loads(text) if text.strip().startswith("{") else text


def _client_id(span: Any) -> str:
    return str(span_attributes(span)["gen_ai.request.id"]).rsplit("-", 1)[0]


def _spans(sink: Any) -> dict[str, Any]:
    return {_client_id(s): s for s in sink.spans(SERVICE) if s.name == "llm_request"}


async def _drop_streams(url: str, cores: list[int], count: int) -> list[str]:
    """``count`` streams of long completions, each closed by its client after two chunks. The
    engine core is held (SIGSTOP) and let run in short bursts until every stream has had two
    chunks, so that it cannot finish them meanwhile however late this test's client runs; then
    every client closes its connection and the engine core goes on: the frontend finds each
    client gone at its next chunk."""
    import aiohttp

    responses: list[Any] = []
    ids: list[str] = []
    two_chunks = asyncio.Event()

    async def one(index: int) -> None:
        body = {
            "model": MODEL_NAME,
            "prompt": [3 + (index * 5 + k) % 50 for k in range(12)],
            "max_tokens": DROPPED_MAX_TOKENS,
            "stream": True,
            "ignore_eos": True,
        }
        response = await session.post(f"{url}/v1/completions", json=body)
        responses.append(response)
        chunks = 0
        async for line in response.content:
            if line.startswith(b"data: {"):
                chunks += 1
                if chunks == 2:
                    ids.append(json.loads(line[6:])["id"])
                    if len(ids) == count:
                        two_chunks.set()
                    return

    timeout = aiohttp.ClientTimeout(total=300)
    _signal(cores, signal.SIGSTOP)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            tasks = [asyncio.create_task(one(i)) for i in range(count)]
            for _ in range(MAX_BURSTS):
                if two_chunks.is_set():
                    break
                await _burst(cores)
                with contextlib.suppress(asyncio.TimeoutError):  # the chunks of that burst still coming
                    await asyncio.wait_for(asyncio.shield(two_chunks.wait()), 0.2)
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            for response in responses:
                response.close()  # the connection closed: the client is gone
    finally:
        _signal(cores, signal.SIGCONT)
    return ids


def _stop_string(text: str) -> str:
    """A string the probe's text holds past its start, that the same prompt meets again."""
    for start in range(len(text) // 3, len(text) - 3):
        candidate = text[start : start + 3]
        if candidate.strip() == candidate and candidate and text.find(candidate) == start:
            return candidate
    raise AssertionError(f"no stop string in the probe's text {text!r}")


def _wait_spans(sink: Any, ids: list[str], what: str) -> dict[str, Any]:
    def made() -> dict[str, Any]:
        spans = _spans(sink)
        return spans if all(i in spans for i in ids) else {}

    return wait_until(made, 120, interval=0.2, what=what)


@pytest.fixture(scope="module")
def run(tiny_model: Path, otlp_sink: Any) -> Iterator[Run]:
    missing = rust_frontend_missing()
    if missing is not None:
        require_backend("vllm-rs", missing)
    server = VllmServer(
        tiny_model,
        env={
            "OTEL_SERVICE_NAME": SERVICE,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_sink.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_LLM_VLLM_DEEP_HOOK": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(FAULT), os.environ.get("PYTHONPATH")) if p),
            "OTEL_LLM_TEST_FAIL_OUTPUTS": str(FAIL_AT),
        },
        rust_frontend=True,
    )
    with server:
        reset_status, _ = _post(server.url + "/reset_prefix_cache")
        (lone,) = run_load(server.url, Load(requests=1, concurrency=1, max_tokens=TOKENS, seed=7, traced=False))
        load = run_load(server.url, LOAD)
        cores = _engine_cores(server.proc.pid)  # type: ignore[union-attr]  # started
        assert len(cores) == 1, cores
        dropped = asyncio.run(_drop_streams(server.url, cores, DROPPED))
        prompt = [5, 9, 14, 22, 31, 40, 47, 53]
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        _, probe = _post(server.url + "/v1/completions", body)
        stop = _stop_string(probe["choices"][0]["text"])
        stopped = [_post(server.url + "/v1/completions", {**body, "stop": [stop]})[1] for _ in range(STOPPED)]
        ids = [c["id"] for c in (probe, *stopped)] + dropped
        spans = _wait_spans(otlp_sink, ids, "the spans of the dropped and stopped requests, the server running")

        def idle() -> tuple[Samples, Samples]:
            rust, ours = scrape(server.url + "/metrics"), scrape(server.metrics_url)
            done = sum(v for (n, _), v in ours.items() if n == "vllm:request_success_total")
            running = [v for (n, _), v in (*rust.items(), *ours.items()) if n == "vllm:num_requests_running"]
            return (rust, ours) if done >= 1 + LOAD.requests + DROPPED + 1 + STOPPED and not any(running) else ()

        rust, ours = wait_until(idle, 120, interval=0.2, what="the engine idle on both /metrics")
        yield Run(reset_status, lone, load, dropped, stop, stopped, spans, rust, ours)


def _finish(span: Any) -> str:
    return str(span_attributes(span)["gen_ai.response.finish_reasons"][0])


def _tokens(span: Any) -> int:
    return int(span_attributes(span)["gen_ai.usage.output_tokens"])


def test_a_utility_call_before_the_first_request_loses_nothing(run: Run) -> None:
    assert run.reset_status == 200
    assert [c.status for c in run.load] == [200] * LOAD.requests
    ids = [s for s in run.spans if s.startswith("cmpl-")]
    assert len(ids) == len(run.spans) == 1 + LOAD.requests + DROPPED + 1 + STOPPED
    ours = {dict(k[1])["finished_reason"]: v for k, v in run.ours.items() if k[0] == "vllm:request_success_total"}
    assert ours["length"] == 1 + LOAD.requests + 1  # the lone request, the load, the probe


def test_a_frame_that_fails_to_translate_is_counted_and_skipped(run: Run) -> None:
    unreadable = {k: v for k, v in run.ours.items() if "dropped_events" in k[0] and v}
    assert list(unreadable.values()) == [1], unreadable
    assert dict(next(iter(unreadable))[1])["reason"] == "engine_stream_unreadable"
    # The frame held one token of the lone request, which ran alone: that token is missing from
    # its span; every later request, on the same connection and thread, is whole.
    spans = list(run.spans.values())
    lone = [s for s in spans if _finish(s) == "length" and _tokens(s) == TOKENS - 1]
    assert len(lone) == 1 and run.lone.completion_tokens == TOKENS
    assert sum(1 for s in spans if _finish(s) == "length" and _tokens(s) == TOKENS) == LOAD.requests


def test_streams_their_clients_dropped_end_as_aborted_while_the_server_runs(run: Run) -> None:
    for completion_id in run.dropped:
        span = run.spans[completion_id]
        assert _finish(span) == "abort", completion_id
        assert "llm.request.incomplete" not in span_attributes(span)  # not cut short by a shutdown
        assert 2 <= _tokens(span) < DROPPED_MAX_TOKENS


def test_requests_stopped_on_a_stop_string_end_as_aborted_with_their_tokens(run: Run) -> None:
    # The frontend finds the stop string in its own detokenizer and aborts the request in the
    # engine core, which is told no reason: the span says abort, with the tokens made until then.
    for response in run.stopped:
        choice = response["choices"][0]
        assert choice["finish_reason"] == "stop"
        span = run.spans[response["id"]]
        assert _finish(span) == "abort"
        assert _tokens(span) >= response["usage"]["completion_tokens"]


def test_the_gauges_and_counts_agree_with_the_rust_frontend(run: Run) -> None:
    def by_reason(samples: Samples) -> dict[str, float]:
        return {
            dict(k[1])["finished_reason"]: v for k, v in samples.items() if k[0] == "vllm:request_success_total" and v
        }

    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        theirs = {k: v for k, v in run.rust.items() if k[0] == name}
        ours = {k: v for k, v in run.ours.items() if k[0] == name}
        assert sum(theirs.values()) == sum(ours.values()) == 0, name
    # The one difference: the Rust frontend counts a request it stopped on a stop string as
    # stop; its engine core, where otel-llm reads the stream, was told only to abort it.
    assert by_reason(run.rust) == {"length": 1 + LOAD.requests + 1, "abort": DROPPED, "stop": STOPPED}
    assert by_reason(run.ours) == {"length": 1 + LOAD.requests + 1, "abort": DROPPED + STOPPED}
