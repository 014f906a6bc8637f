"""One scripted engine-core stream through both of otel-llm's vLLM paths, compared: the Python
frontend's (vLLM's real OutputProcessor and StatLoggerManager, the deep hook on) and the engine-core
stream's (encoded by vLLM's MsgpackEncoder, sent by an engine core's sender to a real consumer).
Every request span and every per-request series must agree; where the two read a fact from a
different clock (the frontend's iteration timestamp against the engine core's output timestamp,
scripted 0.5 ms apart), the values agree to that.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import pytest
from conftest import VLLM_PREEMPTION_BUCKETS
from samples import otel_samples, plugin_manager

from otel_llm.integrations.vllm.channels import stream_channel
from otel_llm.integrations.vllm.frontend.stream_consumer import StreamConsumer
from otel_llm.testing.vllm.stream import (
    Script,
    build,
    default_specs,
    engine_core_output,
    run,
    scheduler_stats,
)
from tests.support.backends import wait_until

CLOCKS_APART_S = 0.0005  # the script's iteration timestamp is 0.5 ms after its output timestamp
SLACK_S = CLOCKS_APART_S + 0.005  # plus reading the wall and monotonic clocks apart, once per path
ANCHORS_APART_S = 0.001  # each telemetry reads the wall clock of a monotonic time once, at its start

EXACT = {  # the same value on both paths, sample by sample
    "vllm:request_num_preemptions",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_max_tokens",
}
TIMED = {  # durations: the same count per series, sums within the clocks' slack per observation
    "vllm:e2e_request_latency_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
}


def _stream_path(script: Script, o: Any, model: str, max_len: int) -> None:
    """The script as an engine core's tap sends it: a hello, each step's arrivals (the REQUESTS
    rows) and its outputs."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackEncoder

    folder = tempfile.mkdtemp(prefix="otel-llm-two-paths-")
    consumer = StreamConsumer(folder, handle=o.handle).start()
    sender = stream_channel.Sender(folder)
    try:
        encoder = MsgpackEncoder()
        send = sender.send
        send(stream_channel.json_frame(stream_channel.HELLO, {"engine": 0, "model": model, "max_model_len": max_len}))
        specs = {s.rid: s for s in script.specs}
        for step in range(script.last_step + 1):
            rows = [
                [s.rid, script.w0 + step * 0.1, s.prompt, s.max_tokens or 0, None, s.priority, s.lora]
                for s in script.specs
                if s.arrive == step
            ]
            if rows:
                send(stream_channel.json_frame(stream_channel.REQUESTS, rows))
            outs = script.outputs.get(step, [])
            sched = scheduler_stats(script, step, outs) if step % 5 != 2 or not outs else None
            if not outs and sched is None:
                continue
            eco = EngineCoreOutputs(
                engine_index=0,
                outputs=[engine_core_output(specs[x.rid], x) for x in outs],
                timestamp=script.output_ts(step),
                scheduler_stats=sched,
            )
            send(stream_channel.outputs_frame(encoder.encode(eco)))
        # The engine core gone idle: its last stats, nothing running or waiting.
        idle = EngineCoreOutputs(engine_index=0, timestamp=script.output_ts(script.last_step + 1))
        idle.scheduler_stats = SchedulerStats()
        send(stream_channel.outputs_frame(encoder.encode(idle)))
        wait_until(lambda: len(o.spans.get_finished_spans()) == len(script.specs), 30, what="every request's span")
    finally:
        sender.close()
        consumer.close()


def _spans(o: Any) -> dict[str, Any]:
    return {s.attributes["gen_ai.request.id"]: s for s in o.spans.get_finished_spans()}


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def _facts(span: Any) -> dict[str, Any]:
    """What a span says, but its times."""
    return {
        "name": span.name,
        "status": span.status.status_code,
        "attributes": {k: v for k, v in span.attributes.items() if "time" not in k and "latency" not in k},
        "events": [(e.name, dict(e.attributes)) for e in span.events],
    }


def _both_paths(otel: Any, vllm_config: Any, specs: list[Any], **config: Any) -> tuple[Any, Any, Script]:
    model = vllm_config.model_config.served_model_name
    max_len = vllm_config.model_config.max_model_len
    # The script is sent at once: its steps are set in the past, as if each had been sent as it
    # happened (an arrival is never later than the moment it is read).
    past = 10.0
    script = build(specs, time.monotonic() - past, time.time() - past)
    assert script.output_ts(script.last_step + 1) < time.monotonic()
    streamed = otel(preemption_buckets=VLLM_PREEMPTION_BUCKETS, **config)
    _stream_path(script, streamed, model, max_len)
    frontend = otel(preemption_buckets=VLLM_PREEMPTION_BUCKETS, **config)  # the plugin's handle from here on
    manager, _ = plugin_manager(vllm_config, [0])
    run(manager, {0: script})
    return frontend, streamed, script


@pytest.fixture
def two_paths(otel: Any, vllm_config: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Script]:
    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    return _both_paths(otel, vllm_config, default_specs())


def test_every_span_says_the_same_on_both_paths(two_paths: tuple[Any, Any, Script]) -> None:
    frontend, streamed, script = two_paths
    ours, theirs = _spans(frontend), _spans(streamed)
    assert sorted(ours) == sorted(theirs) == sorted(s.rid for s in script.specs)
    for rid, span in ours.items():
        other = theirs[rid]
        assert _facts(span) == _facts(other), rid
        # Preemptions and resumptions at the engine core's own timestamps (exact on each path,
        # apart by how each telemetry reads its clocks); the first token at the step's timestamp,
        # on each path's clock.
        assert [e.name for e in span.events] == [e.name for e in other.events], rid
        for mine, theirs_ in zip(span.events, other.events):
            apart = SLACK_S if mine.name == "first_token" else ANCHORS_APART_S
            assert mine.timestamp / 1e9 == pytest.approx(theirs_.timestamp / 1e9, abs=apart), (rid, mine.name)
        expected = _gaps(script.preempted_at[rid])
        for path in (span, other):
            assert _gaps([e.timestamp / 1e9 for e in path.events if e.name == "preempted"]) == pytest.approx(
                expected, abs=1e-6
            ), rid
        assert span.start_time / 1e9 == pytest.approx(other.start_time / 1e9, abs=SLACK_S), rid
        assert span.end_time / 1e9 == pytest.approx(other.end_time / 1e9, abs=SLACK_S), rid


def test_every_per_request_series_says_the_same_on_both_paths(two_paths: tuple[Any, Any, Script]) -> None:
    frontend, streamed, _ = two_paths
    exact_ours, exact_theirs = otel_samples(frontend.reader, EXACT), otel_samples(streamed.reader, EXACT)
    # The stat logger makes a zero series per finish reason at start, as vLLM's Python frontend
    # does; the stream path makes a series when it first counts one.
    zeros = {k for k, v in exact_ours.items() if v == 0 and k not in exact_theirs}
    assert {dict(k[1])["finished_reason"] for k in zeros} == {"error", "repetition"}
    assert {k: v for k, v in exact_ours.items() if k not in zeros} == exact_theirs
    assert len(exact_theirs) > 50
    timed_ours, timed_theirs = otel_samples(frontend.reader, TIMED), otel_samples(streamed.reader, TIMED)
    assert set(timed_ours) == set(timed_theirs)
    for key, value in timed_ours.items():
        if key[0].endswith("_count"):
            assert value == timed_theirs[key], key
        elif key[0].endswith("_sum"):
            count = timed_ours[(key[0][: -len("_sum")] + "_count", key[1])]
            assert value == pytest.approx(timed_theirs[key], abs=SLACK_S * count), key


# The request-scoped series both paths label by tenant: a request's summary at its finish, and
# the per-step latencies and tokens (split by the request each came from on the stat-logger path).
PER_TENANT = {
    "vllm:request_num_preemptions",
    "vllm:request_success",
    "vllm:num_preemptions_by_tenant",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
}
# Read from the two clocks apart (TIMED): a value on a bucket's boundary may fall on either side.
CLOCKED = {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"}


@pytest.mark.parametrize("source", ["priority", "lora"])
def test_both_paths_give_each_request_the_same_tenant(
    source: str, otel: Any, vllm_config: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same priorities and adapters, handed over by the engine core's tap on one path and
    by vLLM's output processor on the other: the same tenant on each span, the same counts per
    tenant, the per-step latencies and tokens included (no cause record here: every cause is
    ``none`` on both)."""
    monkeypatch.setenv("OTEL_LLM_VLLM_DEEP_HOOK", "1")
    specs = default_specs()
    for i, spec in enumerate(specs):
        spec.priority, spec.lora = i % 3, f"adapter-{i % 2}" if i % 3 else None
    sources = ("priority", "lora", "model")
    frontend, streamed, script = _both_paths(otel, vllm_config, specs, tenant=source, tenant_sources=sources)
    served = vllm_config.model_config.served_model_name
    expected = {s.rid: str(s.priority) if source == "priority" else s.lora or served for s in specs}
    for o in (frontend, streamed):
        assert {rid: span.attributes["llm.tenant"] for rid, span in _spans(o).items()} == expected
    ours, theirs = otel_samples(frontend.reader, PER_TENANT), otel_samples(streamed.reader, PER_TENANT)
    labelled = {k: v for k, v in ours.items() if "tenant" in dict(k[1])}
    for key, value in labelled.items():
        name = key[0]
        if name.endswith("_sum"):
            count = labelled[(name[: -len("_sum")] + "_count", key[1])]
            assert value == pytest.approx(theirs[key], abs=SLACK_S * count), key
        elif not (name.endswith("_bucket") and name[: -len("_bucket")] in CLOCKED):
            assert value == theirs[key], key
    assert {k for k in theirs if "tenant" in dict(k[1])} == set(labelled)
    matrix = {dict(k[1])["tenant"]: v for k, v in labelled.items() if k[0] == "vllm:num_preemptions_by_tenant_total"}
    assert sum(matrix.values()) == sum(s.num_preemptions for s in script.specs) == 11
