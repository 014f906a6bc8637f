"""Who evicted whom on vLLM's real engine (CPU build): every preemption attributed, link by link,
against vLLM's own preemption point in the engine-core process.

One server for the module, the deep hook on, its spans to a loopback OTLP sink. The ground
truth is recorded inside vLLM's engine core by a recorder of the test's own
(tests/vllm_engine/preemption_truth/sitecustomize.py: which request's block allocation each
preemption made room for, from vLLM's calls, not from otel-llm's frame reading). The run: 64
concurrent completions under KV pressure (many preemptions, by other requests and by
themselves), then a streamed completion during which the prefix cache is reset with the running
requests (vLLM's dev endpoint): preemptions whose cause is no request.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from engine_record import Samples, read_record, recording_env

from otel_llm.testing.span_receiver import span_attributes
from otel_llm.testing.vllm.server import ADD_MODE, MODEL_NAME, Load, VllmServer, run_load, scrape
from tests.support.backends import wait_until
from tests.vllm_engine.test_faults import _burst, _engine_cores, _signal

LOAD = Load(requests=64, concurrency=64, max_tokens=96, seed=1)
RESET_TRIES = 3
RESET_BURST_S = 0.005  # the engine core runs this long at a time while the reset is on its way


@dataclass
class Run:
    truth: list[dict[str, Any]]  # the engine core's preemptions, in order
    spans: dict[str, Any]  # our llm_request spans by gen_ai.request.id (vLLM's external id)
    ours: Samples
    vllm: Samples
    reset_success: bool
    resets: int  # streamed completions sent with a reset (the load's requests aside)
    tmp: Path  # the serve's TMPDIR
    channel_made: bool


async def _stream_with_a_cache_reset(url: str, cores: list[int]) -> bool:
    """A streamed completion; once it is running, the prefix cache reset with the running
    requests (which preempts them all, this one included). The engine core (``cores``) is held
    (SIGSTOP) from before the request until the reset is answered, and runs in bursts of
    RESET_BURST_S: however slow this client is to read the first token and to ask for the reset,
    the engine can have made only a few tokens meanwhile, not the request's 200."""
    import aiohttp

    body = {"model": MODEL_NAME, "prompt": [11] * 40, "max_tokens": 200, "stream": True, "ignore_eos": True}
    running = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def stream() -> None:
            async with session.post(f"{url}/v1/completions", json=body) as response:
                async for _line in response.content:
                    running.set()  # a token came: the request runs

        async def reset() -> bool:
            async with session.post(f"{url}/reset_prefix_cache?reset_running_requests=true") as response:
                return bool((await response.json())["success"])

        _signal(cores, signal.SIGSTOP)
        try:
            streamed = asyncio.create_task(stream())
            while not (running.is_set() or streamed.done()):
                await _burst(cores, RESET_BURST_S)
            answered = asyncio.create_task(reset())
            while not answered.done():
                await _burst(cores, RESET_BURST_S)
        finally:
            _signal(cores, signal.SIGCONT)
        await streamed
        return await answered


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _external(internal_id: str) -> str:
    """vLLM's external request id (the client's, and our spans'): the internal one less its suffix."""
    return internal_id.rsplit("-", 1)[0]


@pytest.fixture(scope="module")
def run(tiny_model: Path, otlp_sink: Any, tmp_path_factory: pytest.TempPathFactory) -> Run:
    truth_file = tmp_path_factory.mktemp("truth") / "preemptions.jsonl"
    tmp = tmp_path_factory.mktemp("serve-tmp")
    server = VllmServer(
        tiny_model,
        env={
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_sink.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_LLM_VLLM_DEEP_HOOK": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            **recording_env(truth_file),
            "TMPDIR": str(tmp),
            **ADD_MODE,
        },
    )
    with server:
        completions = run_load(server.url, LOAD)
        assert [c.status for c in completions] == [200] * LOAD.requests, server.log_tail()
        # Tried again, at most RESET_TRIES times, until vLLM preempted on the reset.
        assert server.proc is not None
        cores, resets, reset_success = _engine_cores(server.proc.pid), 0, False
        assert cores, "no engine-core process found"
        while resets < RESET_TRIES and not (reset_success and '"where": "reset"' in _read(truth_file)):
            reset_success = asyncio.run(_stream_with_a_cache_reset(server.url, cores))
            resets += 1
        channel_made = bool(list(tmp.glob("otel-llm-vllm-causes-*/*.sock")))
        wait_until(
            lambda: len(otlp_sink.spans()) >= LOAD.requests + resets, 120, interval=0.5, what="every request span"
        )
        vllm, ours = scrape(server.url + "/metrics"), scrape(server.metrics_url)
        spans = {span_attributes(s)["gen_ai.request.id"]: s for s in otlp_sink.spans() if s.name == "llm_request"}
    truth = read_record(truth_file)
    return Run(truth, spans, ours, vllm, reset_success, resets, tmp, channel_made)


def _links(span: Any) -> list[tuple[int, str, str]]:
    return [
        (span_attributes(link)["llm.preemption.ordinal"], link.trace_id.hex(), link.span_id.hex())
        for link in span.links
    ]


def _events(span: Any) -> list[dict[str, Any]]:
    return [span_attributes(e) for e in span.events if e.name == "preempted"]


def test_the_load_preempts_for_every_kind_of_cause(run: Run) -> None:
    labels = frozenset({"model_name": MODEL_NAME, "engine": "0"}.items())
    assert len(run.truth) == run.vllm[("vllm:num_preemptions_total", labels)]  # the recorder sees them all
    kinds = Counter(
        "cache_reset" if t["where"] == "reset" else "self" if t["cause"] == t["victim"] else "request"
        for t in run.truth
    )
    assert kinds["request"] >= 10 and kinds["self"] >= 1, kinds
    assert run.reset_success and kinds["cache_reset"] >= 1, kinds
    assert len(run.spans) == LOAD.requests + run.resets


def test_every_preemption_names_its_cause_and_links_to_it_as_the_engine_core_recorded(run: Run) -> None:
    by_victim: dict[str, list[dict[str, Any]]] = {}
    for t in run.truth:
        by_victim.setdefault(_external(t["victim"]), []).append(t)
    assert set(by_victim) <= set(run.spans)
    for rid, span in run.spans.items():
        truth = sorted(by_victim.get(rid, []), key=lambda t: t["ordinal"])
        assert [t["ordinal"] for t in truth] == list(range(1, len(truth) + 1)), rid
        events = _events(span)
        assert len(events) == len(truth), rid
        expected_links = []
        for event, t in zip(events, truth):
            if t["where"] == "reset":
                assert event["cause"] == "cache_reset" and "cause_request_ids" not in event, rid
                continue
            cause = _external(t["cause"])
            assert event["cause"] == ("self" if t["cause"] == t["victim"] else "request"), rid
            assert event["cause_request_ids"] == [cause], rid
            if cause != rid:
                target = run.spans[cause]
                expected_links.append((t["ordinal"], target.trace_id.hex(), target.span_id.hex()))
        assert _links(span) == expected_links, rid


def test_each_request_counts_the_preemptions_it_caused(run: Run) -> None:
    caused = Counter(_external(t["cause"]) for t in run.truth if t["where"] == "schedule")
    for rid, span in run.spans.items():
        assert span_attributes(span)["llm.request.num_preemptions_caused"] == caused.get(rid, 0), rid
    labels = frozenset({"model_name": MODEL_NAME, "engine": "0"}.items())
    assert run.ours[("vllm:request_num_preemptions_caused_sum", labels)] == sum(caused.values())
    assert run.ours[("vllm:request_num_preemptions_caused_count", labels)] == LOAD.requests + run.resets
    never = run.ours[("vllm:request_num_preemptions_caused_bucket", labels | {("le", "0.5")})]
    assert never == LOAD.requests + run.resets - len(caused)


def test_preemptions_by_cause_add_up_to_vllms_preemptions(run: Run) -> None:
    labels = {"model_name": MODEL_NAME, "engine": "0"}
    kinds = Counter(
        "cache_reset" if t["where"] == "reset" else "self" if t["cause"] == t["victim"] else "request"
        for t in run.truth
    )
    for kind in ("request", "self", "cache_reset", "unknown"):
        key = ("vllm:num_preemptions_by_cause_total", frozenset({**labels, "cause": kind}.items()))
        assert run.ours.get(key, 0) == kinds.get(kind, 0), kind
    dropped = {k: v for k, v in run.ours.items() if "dropped_events" in k[0] and v}
    assert not dropped, dropped


def test_the_cause_channel_goes_with_the_serve(run: Run) -> None:
    """The channel folder was made in the serve's temporary folder and is gone once it stopped."""
    assert run.channel_made and not list(run.tmp.glob("otel-llm-vllm-causes-*"))
