"""The engine core's sender through the real tap (vLLM's own output thread encoding each message
into its reused buffer, :mod:`test_engine_tap`'s engine core over vLLM's real ``Scheduler``) to a
real consumer, behind a socket buffer set explicitly small (the kernel caps what the sender asks
for at net.core.wmem_max, 208 KiB by default): a consumer that falls behind costs each send only
its own frame, the backlog stays bounded and what it could not keep is counted; tensors' buffers
are not sent; a frame over the bound is lost and counted; the goodbye comes after the backlog."""

from __future__ import annotations

import tempfile
import threading
from typing import Any, Iterator

import pytest
from samples import otel_samples
from test_engine_tap import Engine, _run_until_finished

from otel_llm.integrations.vllm.channels import stream_channel
from otel_llm.integrations.vllm.engine_core import engine_tap
from otel_llm.integrations.vllm.frontend.stream_consumer import StreamConsumer
from otel_llm.integrations.vllm.translation import stream_translate
from tests.support.backends import wait_until

BOUND = 16 << 10  # the backlog's bound in these tests


@pytest.fixture
def tapped(otel: Any, model_dir: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The real tap to a real consumer; each send the tap makes recorded as (bytes handed, bytes
    copied into the backlog, backlog after, kept)."""
    monkeypatch.setattr(stream_channel, "SEND_BUFFER", 4096)
    monkeypatch.setattr(stream_channel, "MAX_PENDING", BOUND)
    monkeypatch.setattr(engine_tap, "BYE_FLUSH_S", 60.0)  # bounded by the consumer's reading here, not a time
    folder = tempfile.mkdtemp(prefix="otel-llm-send-")
    o = otel()
    o.consumer = StreamConsumer(folder, handle=o.handle).start()
    assert engine_tap.install(folder)
    o.engine = Engine(model_dir)
    o.tap = engine_tap._state["tap"]
    o.sends = []
    sender, send = o.tap.sender, o.tap.sender.send

    def recorded(*parts: Any) -> bool:
        copied = sender.copied
        kept = send(*parts)
        o.sends.append((sum(memoryview(p).nbytes for p in parts), sender.copied - copied, sender.pending_bytes, kept))
        return kept

    sender.send = recorded
    yield o
    o.engine.stop()
    engine_tap.uninstall()
    o.consumer.close()


def _dropped(o: Any) -> dict[str, float]:
    samples = otel_samples(o.reader, {"otel_llm.dropped_events"})
    return {dict(k[1])["reason"]: v for k, v in samples.items() if k[0] == "otel_llm.dropped_events_total"}


def _all_forwarded(o: Any) -> None:
    """Every message put to vLLM's output thread handed to the sender (the hand-over follows
    vLLM's own send)."""
    count = o.engine.put_count
    wait_until(lambda: len(o.sends) >= count, 30, what=f"{count} hand-overs")


def _bye_read(o: Any) -> None:
    """The goodbye (it waits for its backlog to be read), and the consumer's reading of it."""
    bye = threading.Thread(target=o.tap.bye)
    bye.start()
    bye.join(60)
    wait_until(lambda: not o.consumer._by_index, 30, what="the goodbye read")


def test_a_consumer_behind_costs_each_send_its_own_frame_bounded_and_counted(tapped: Any) -> None:
    o, engine = tapped, tapped.engine
    with o.consumer._lock:  # the consumer's thread reads nothing meanwhile
        for i in range(32):
            engine.add(f"r{i}", prompt=20, max_tokens=40)
        _run_until_finished(engine, 32)
        _all_forwarded(o)
        sender = o.tap.sender
        lost = sender.lost_total
        assert lost > 0
        told = len(stream_channel.json_frame(stream_channel.LOST, lost))
        for handed, copied, backlog, kept in o.sends:
            assert copied <= handed + told and backlog <= BOUND  # never the backlog ahead copied again
            assert kept or copied == 0
        assert sum(not kept for *_, kept in o.sends) == lost
    _bye_read(o)
    assert sender.lost_total == lost  # the goodbye was sent, after the count of what was lost
    assert _dropped(o)["engine_stream_lost"] == lost


def test_the_goodbye_comes_after_the_backlog(tapped: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer behind when the engine core shuts down: the backlog is read, then the goodbye,
    so the requests still in flight end ``shutdown`` (the old sender dropped its backlog with the
    goodbye: they ended ``engine_dead``)."""
    o, engine = tapped, tapped.engine
    monkeypatch.setattr(o.tap.sender, "max_pending", 1 << 20)  # all kept
    with o.consumer._lock:
        for i in range(8):
            engine.add(f"r{i}", prompt=20, max_tokens=100)
        for _ in range(40):
            engine.step()
        _all_forwarded(o)
        assert o.tap.sender.pending_bytes > 0 and o.tap.sender.lost_total == 0
        bye = threading.Thread(target=o.tap.bye)
        bye.start()
    bye.join(60)
    wait_until(lambda: len(o.spans.get_finished_spans()) == 8, 30, what="the 8 spans")
    assert {s.attributes["llm.request.incomplete"] for s in o.spans.get_finished_spans()} == {"shutdown"}
    assert {s.attributes["gen_ai.usage.output_tokens"] for s in o.spans.get_finished_spans()} == {40}
    assert _dropped(o)["engine_stream_lost"] == 0


def _with_tensors(rid: str) -> Any:
    """A finishing output carrying a pooling tensor and logprobs, 64 KiB each: vLLM encodes them
    into buffers of their own, after the first."""
    import numpy
    import torch
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.outputs import LogprobsLists

    logprobs = LogprobsLists(
        numpy.zeros((1, 8192), dtype=numpy.int64), numpy.zeros((1, 16384), dtype=numpy.float32), numpy.zeros(1)
    )
    output = EngineCoreOutput(
        rid,
        [7],
        new_logprobs=logprobs,
        pooling_output=torch.zeros(16384),
        finish_reason=FinishReason.LENGTH,
    )
    return EngineCoreOutputs(outputs=[output], scheduler_stats=SchedulerStats())


@pytest.mark.parametrize("decoder", ["the consumer's", "vLLM's own"])
def test_tensor_buffers_are_not_sent_and_the_output_still_reads(
    tapped: Any, monkeypatch: pytest.MonkeyPatch, decoder: str
) -> None:
    """Only the first of vLLM's buffers goes (the consumer decodes nothing else); vLLM's own
    decoder, the fallback, decodes it too (it would look for the tensors' buffers). The fallback
    is taken by a decoder that rejects every message: this vLLM's all decode."""
    import msgspec

    o, engine = tapped, tapped.engine
    if decoder == "vLLM's own":
        monkeypatch.setattr(stream_translate, "decoder", lambda reader: msgspec.msgpack.Decoder(list[str]).decode)
    engine.add("t", prompt=10, max_tokens=50)
    engine.step()
    engine.put(_with_tensors("t"))
    _all_forwarded(o)
    handed = o.sends[-1][0]
    assert handed < 1024  # the tensors, 64 KiB each, stayed behind
    wait_until(lambda: len(o.spans.get_finished_spans()) == 1, 30, what="the span")
    (span,) = o.spans.get_finished_spans()
    assert span.attributes["gen_ai.usage.output_tokens"] == 2
    assert span.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert o.consumer.unreadable == 0


def test_a_frame_over_the_bound_is_lost_and_counted(tapped: Any) -> None:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats

    o, engine = tapped, tapped.engine
    engine.add("a", prompt=10, max_tokens=6)
    engine.step()
    big = EngineCoreOutput("a", list(range(300, 300 + BOUND // 2)))  # 3 bytes a token
    engine.put(EngineCoreOutputs(outputs=[big], scheduler_stats=SchedulerStats()))
    _all_forwarded(o)
    handed, copied, backlog, kept = o.sends[-1]
    assert handed > BOUND and (copied, backlog, kept) == (0, 0, False)
    assert o.tap.sender.lost_total == 1
    _run_until_finished(engine, 1)  # the next send tells the loss
    wait_until(lambda: _dropped(o).get("engine_stream_lost") == 1, 30, what="the loss counted")


def test_the_start_up_heap_is_frozen_once_an_engine_core_says_hello(tapped: Any) -> None:
    """As vLLM's own API server does at its start-up: the serve's heap out of the collector's
    reach once its first engine core is up (the consumer reads the hello), not before."""
    import gc

    from vllm.v1.engine import EngineCoreOutputs, UtilityOutput

    o, engine = tapped, tapped.engine
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    engine.put(EngineCoreOutputs(utility_output=UtilityOutput(call_id=1)))  # the first send: the hello with it
    wait_until(lambda: o.consumer._engines, 30, what="the hello read")
    assert gc.get_freeze_count() > 0
