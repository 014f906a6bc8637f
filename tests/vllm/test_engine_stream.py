"""The engine-core stream under a frontend that calls no stat-logger plugin (the Rust frontend),
on vLLM's own classes: ``EngineCoreOutputs`` encoded by vLLM's ``MsgpackEncoder`` as its engine
core does, sent over the stream channel by an engine core's sender to a real consumer (a thread
on Unix sockets), decoded by structs shaped from vLLM's classes and recorded: exact preemption times,
ordinals and causes, the histogram, the counters, the cut-short requests of a dead engine core."""

from __future__ import annotations

import tempfile
import time
from typing import Any, Iterator

import pytest
from samples import otel_samples

from otel_llm.events import CAUSE_REQUEST, CAUSE_SELF
from otel_llm.integrations.vllm.channels import cause_channel, stream_channel
from otel_llm.integrations.vllm.channels.cause_channel import CauseRecord
from otel_llm.integrations.vllm.engine_core import engine_tap
from otel_llm.integrations.vllm.frontend import serve_stop
from otel_llm.integrations.vllm.frontend.stream_consumer import StreamConsumer
from tests.support.backends import wait_until

QUEUED, SCHEDULED, PREEMPTED = 1, 2, 3


@pytest.fixture
def stream(otel: Any) -> Iterator[Any]:
    """A consumer on in-memory readers, and an engine core's sender to it."""
    folder = tempfile.mkdtemp(prefix="otel-llm-stream-")
    o = otel()
    consumer = StreamConsumer(folder, handle=o.handle).start()
    sender = stream_channel.Sender(folder)
    causes = cause_channel.Sender(folder)
    o.folder, o.consumer, o.sender, o.causes = folder, consumer, sender, causes
    yield o
    sender.close()
    consumer.close()


def _encode(outputs: Any) -> bytes:
    from vllm.v1.serial_utils import MsgpackEncoder

    return stream_channel.outputs_frame(MsgpackEncoder().encode(outputs))


def _out(rid: str, tokens: int = 0, events: tuple = (), finish: Any = None, prompt: int = 0) -> Any:
    from vllm.v1.engine import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput
    from vllm.v1.metrics.stats import PrefillStats

    return EngineCoreOutput(
        request_id=rid,
        new_token_ids=list(range(tokens)),
        finish_reason=finish,
        events=[EngineCoreEvent(EngineCoreEventType(kind), ts) for kind, ts in events] or None,
        prefill_stats=PrefillStats(num_prompt_tokens=prompt) if prompt else None,
    )


def _outputs(ts: float, *outs: Any, finished: Any = None, running: int = 0, waiting: int = 0) -> Any:
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats

    return EngineCoreOutputs(
        engine_index=0,
        outputs=list(outs),
        timestamp=ts,
        finished_requests=finished,
        scheduler_stats=SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting),
    )


def _spans(o: Any) -> dict[str, Any]:
    return {s.attributes["gen_ai.request.id"]: s for s in o.spans.get_finished_spans()}


def test_a_load_with_preemptions_is_recorded_exactly(stream: Any) -> None:
    from vllm.v1.engine import FinishReason

    t = time.monotonic()
    wall = time.time()
    o = stream
    o.sender.send(stream_channel.json_frame(stream_channel.HELLO, {"engine": 0, "model": "tiny"}))
    o.sender.send(
        stream_channel.json_frame(
            stream_channel.REQUESTS, [["a", wall - 0.5, 12, 8, None], ["b", wall - 0.4, 7, 8, None]]
        )
    )
    frames = [
        _outputs(
            t + 1.0,
            _out("a", 1, ((QUEUED, t + 0.1), (SCHEDULED, t + 0.2))),
            _out("b", 1, ((QUEUED, t + 0.15), (SCHEDULED, t + 0.3))),
        ),
        _outputs(t + 2.0, _out("a", 0, ((PREEMPTED, t + 1.5),)), _out("b", 1)),
        _outputs(
            t + 3.0,
            _out("a", 1, ((SCHEDULED, t + 2.5), (PREEMPTED, t + 2.6), (SCHEDULED, t + 2.8))),
            _out("b", 1, finish=FinishReason.LENGTH),
        ),
        _outputs(t + 4.0, _out("a", 2, finish=FinishReason.STOP)),
    ]
    # The engine core writes each preemption's cause inside schedule(), before that step's outputs.
    o.causes.send(CauseRecord("a", 1, CAUSE_REQUEST, ("b",)))
    o.sender.send(_encode(frames[0]) + _encode(frames[1]))
    o.causes.send(CauseRecord("a", 2, CAUSE_SELF, ("a",)))
    o.sender.send(_encode(frames[2]) + _encode(frames[3]))
    wait_until(lambda: len(o.spans.get_finished_spans()) == 2, 30, what="both request spans")
    spans = _spans(o)
    a, b = spans["a"], spans["b"]
    events = [e for e in a.events if e.name == "preempted"]
    assert [e.attributes["ordinal"] for e in events] == [1, 2]
    assert [e.attributes["cause"] for e in events] == ["request", "self"]
    assert list(events[0].attributes["cause_request_ids"]) == ["b"]
    assert a.attributes["llm.request.num_preemptions"] == 2 and b.attributes["llm.request.num_preemptions"] == 0
    assert b.attributes["llm.request.num_preemptions_caused"] == 1
    assert a.attributes["gen_ai.usage.input_tokens"] == 12 and a.attributes["gen_ai.usage.output_tokens"] == 4
    assert b.attributes["gen_ai.response.finish_reasons"] == ("length",)
    # Preempted 1.0 s after it was scheduled, the second 0.1 s after the first resume.
    assert (events[1].timestamp - events[0].timestamp) == pytest.approx(1.1e9, abs=2e6)
    samples = otel_samples(o.reader, {"vllm:request_num_preemptions", "vllm:num_preemptions", "vllm:request_success"})
    labels = frozenset({"model_name": o.handle.config.model_name, "engine": "0"}.items())
    assert samples[("vllm:request_num_preemptions_count", labels)] == 2
    assert samples[("vllm:request_num_preemptions_sum", labels)] == 2
    assert samples[("vllm:request_num_preemptions_bucket", labels | {("le", 0.5)})] == 1  # b, never preempted
    assert samples[("vllm:num_preemptions_total", labels)] == 2
    by_reason = {dict(k[1])["finished_reason"]: v for k, v in samples.items() if k[0] == "vllm:request_success_total"}
    assert by_reason == {"stop": 1, "length": 1}


def test_a_dead_engine_core_cuts_its_requests_short(stream: Any) -> None:
    t = time.monotonic()
    o = stream
    o.sender.send(stream_channel.json_frame(stream_channel.HELLO, {"engine": 0, "model": "tiny"}))
    o.sender.send(_encode(_outputs(t, _out("x", 1, ((QUEUED, t - 0.2), (SCHEDULED, t - 0.1)), prompt=5))))
    o.sender.close()  # no goodbye: the engine core died
    wait_until(lambda: len(o.spans.get_finished_spans()) == 1, 30, what="the cut-short span")
    (span,) = o.spans.get_finished_spans()
    assert span.attributes["llm.request.incomplete"] == "engine_dead"
    assert span.status.status_code.name == "ERROR" and span.attributes["gen_ai.request.id"] == "x"


def test_the_engine_core_hand_over_attaches_to_this_vllm() -> None:
    assert engine_tap.shape_problem() is None


def test_a_frontend_that_sends_trace_headers_parents_the_span(stream: Any) -> None:
    """vllm-rs 0.32 sends none; a frontend that does (the request's ``trace_headers``) gets its
    request span parented by them."""
    from vllm.v1.engine import FinishReason

    t, o = time.monotonic(), stream
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    o.sender.send(stream_channel.json_frame(stream_channel.HELLO, {"engine": 0, "model": "tiny"}))
    o.sender.send(
        stream_channel.json_frame(stream_channel.REQUESTS, [["p", time.time(), 3, 4, {"traceparent": parent}]])
    )
    o.sender.send(
        _encode(_outputs(t + 0.5, _out("p", 4, ((QUEUED, t + 0.1), (SCHEDULED, t + 0.2)), FinishReason.LENGTH)))
    )
    wait_until(lambda: len(o.spans.get_finished_spans()) == 1, 30, what="the request span")
    (span,) = o.spans.get_finished_spans()
    assert format(span.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert span.parent is not None and format(span.parent.span_id, "016x") == "b7ad6b7169203331"


def test_a_consumer_that_starts_late_counts_what_it_missed_and_says_so_once(otel: Any, caplog: Any) -> None:
    import logging

    from vllm.v1.engine import FinishReason

    folder = tempfile.mkdtemp(prefix="otel-llm-stream-")
    sender = stream_channel.Sender(folder)
    hello = stream_channel.json_frame(stream_channel.HELLO, {"engine": 0, "model": "tiny"})
    t = time.monotonic()
    for _ in range(3):  # nobody listens yet: lost, counted by the engine core
        sender.send(hello + _encode(_outputs(t)))
    o = otel()
    consumer = StreamConsumer(folder, handle=o.handle).start()
    try:
        with caplog.at_level(logging.WARNING, logger="otel_llm.integrations.vllm"):
            sender.send(
                hello
                + _encode(_outputs(t + 1, _out("late", 2, ((QUEUED, t), (SCHEDULED, t + 0.5)), FinishReason.LENGTH)))
            )
            wait_until(lambda: len(o.spans.get_finished_spans()) == 1, 30, what="the request after the start")
        samples = otel_samples(o.reader, {"otel_llm.dropped_events"})
        lost = {dict(k)["reason"]: v for (n, k), v in samples.items() if n == "otel_llm.dropped_events_total"}
        assert lost["engine_stream_lost"] == 3
        [line] = [r.getMessage() for r in caplog.records if "before this connection" in r.getMessage()]
        assert "3 messages" in line
    finally:
        sender.close()
        consumer.close()


def test_data_parallel_engines_each_export_as_an_instance_of_their_own(monkeypatch: Any) -> None:
    """Providers from the environment, as in ``vllm serve``: each of 2 engine cores gets its own
    ``service.instance.id`` (the serve's, ``-engine-N``), and one Prometheus endpoint serves both.
    The hello carries no data-parallel size: vLLM tells each engine core of a non-MoE model that
    it is the only one."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    from vllm.v1.engine import FinishReason

    from tests.support.backends import free_port

    port = free_port()
    for key, value in {
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
        "OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=serve-3",
    }.items():
        monkeypatch.setenv(key, value)
    folder = tempfile.mkdtemp(prefix="otel-llm-stream-")
    consumer = StreamConsumer(folder).start()
    senders = [stream_channel.Sender(folder) for _ in range(2)]
    t = time.monotonic()
    try:
        for engine, sender in enumerate(senders):
            hello = stream_channel.json_frame(stream_channel.HELLO, {"engine": engine, "model": "tiny"})
            outs = [
                _out(f"e{engine}-{i}", 2, ((QUEUED, t), (SCHEDULED, t + 0.1)), FinishReason.LENGTH)
                for i in range(engine + 1)
            ]
            sender.send(hello + _encode(_outputs(t + 0.5, *outs)))

        def scraped() -> Any:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
            success = families.get("vllm:request_success")
            done = success is not None and sum(s.value for s in success.samples if s.name.endswith("_total")) == 3
            return families if done else None

        families = wait_until(scraped, 30, interval=0.1, what="both engines' requests on /metrics")
        by_engine = {
            s.labels["engine"]: s.value for s in families["vllm:request_success"].samples if s.name.endswith("_total")
        }
        assert by_engine == {"0": 1, "1": 2}
        ids = sorted(s.labels["service_instance_id"] for s in families["target_info"].samples)
        assert ids == ["serve-3-engine-0", "serve-3-engine-1"]
    finally:
        for sender in senders:
            sender.close()
        consumer.close()


def test_a_taken_prometheus_port_is_said_once_for_every_engine(monkeypatch: Any, caplog: Any) -> None:
    """The first engine's endpoint cannot bind its port: one warning, and the other engines'
    providers do not try the port again (each would warn once more)."""
    import logging
    import socket

    from tests.support.backends import free_port

    port = free_port()
    for key, value in {
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
    }.items():
        monkeypatch.setenv(key, value)
    folder = tempfile.mkdtemp(prefix="otel-llm-stream-")
    taken = socket.socket()
    taken.bind(("127.0.0.1", port))
    taken.listen()
    consumer = StreamConsumer(folder).start()
    senders = [stream_channel.Sender(folder) for _ in range(3)]
    try:
        with caplog.at_level(logging.WARNING, logger="otel_llm"):
            for engine, sender in enumerate(senders):
                sender.send(stream_channel.json_frame(stream_channel.HELLO, {"engine": engine, "model": "tiny"}))
            wait_until(lambda: len(consumer._handles) == 3, 30, interval=0.05, what="three engines' providers")
        said = [r for r in caplog.records if "no /metrics endpoint in this process" in r.getMessage()]
        assert len(said) == 1
        assert [h.prometheus for h in consumer._handles] == [None, None, None]
        assert [h.config.metrics_exporters for h in consumer._handles[1:]] == [("none",), ("none",)]
    finally:
        for sender in senders:
            sender.close()
        consumer.close()
        taken.close()


def test_a_cause_record_read_ahead_of_its_requests_is_credited_when_they_come(stream: Any) -> None:
    """The cause channel is a socket of its own: a record can be read before the given rows that
    name its victim and cause. It is kept and credited once they are known, before the cause
    finishes (here in the same output), so the victim's later event still counts it once."""
    from vllm.v1.engine import FinishReason

    t, wall, o = time.monotonic(), time.time(), stream
    o.causes.send(CauseRecord("v", 1, CAUSE_REQUEST, ("c",)))
    hello = stream_channel.json_frame(stream_channel.HELLO, {"engine": 0, "model": "tiny"})
    given_x = stream_channel.json_frame(stream_channel.REQUESTS, [["x", wall, 4, 4, None]])
    # x's output has events: the record is drained here, before v and c are known.
    o.sender.send(hello + given_x + _encode(_outputs(t + 0.1, _out("x", 1, ((QUEUED, t), (SCHEDULED, t + 0.05))))))
    given = stream_channel.json_frame(stream_channel.REQUESTS, [["v", wall, 4, 8, None], ["c", wall, 4, 1, None]])
    o.sender.send(
        given
        + _encode(
            _outputs(
                t + 0.2,
                _out("v", 1, ((QUEUED, t + 0.1), (SCHEDULED, t + 0.15))),
                _out("c", 1, ((QUEUED, t + 0.1), (SCHEDULED, t + 0.15)), FinishReason.LENGTH),
            )
        )
        + _encode(_outputs(t + 0.3, _out("v", 0, ((PREEMPTED, t + 0.25),))))
        + _encode(_outputs(t + 0.4, _out("v", 1, ((SCHEDULED, t + 0.35),), FinishReason.LENGTH)))
        + _encode(_outputs(t + 0.5, _out("x", 1, finish=FinishReason.LENGTH)))
    )
    wait_until(lambda: len(o.spans.get_finished_spans()) == 3, 30, what="the three request spans")
    spans = _spans(o)
    assert spans["c"].attributes["llm.request.num_preemptions_caused"] == 1
    [event] = [e for e in spans["v"].events if e.name == "preempted"]
    assert list(event.attributes["cause_request_ids"]) == ["c"]


def test_outputs_of_a_shape_not_foreseen_are_decoded_by_vllms_own_decoder(
    otel: Any, monkeypatch: Any, caplog: Any
) -> None:
    """The consumer's own decoder rejects outputs of another vLLM's shape: it says so once and
    decodes with vLLM's decoder from then on, nothing lost. This vLLM's outputs all decode, so
    the decoder is replaced by one that rejects them (the fault cannot be caused otherwise)."""
    import logging

    import msgspec
    from vllm.v1.engine import FinishReason

    from otel_llm.integrations.vllm.translation import stream_translate

    monkeypatch.setattr(stream_translate, "decoder", lambda reader: msgspec.msgpack.Decoder(list[str]).decode)
    folder = tempfile.mkdtemp(prefix="otel-llm-stream-")
    o = otel()
    consumer = StreamConsumer(folder, handle=o.handle).start()
    sender = stream_channel.Sender(folder)
    t = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="otel_llm.integrations.vllm"):
            sender.send(stream_channel.json_frame(stream_channel.HELLO, {"engine": 0, "model": "tiny"}))
            for i in range(2):
                events = ((QUEUED, t), (SCHEDULED, t + 0.1))
                sender.send(_encode(_outputs(t + 1 + i, _out(f"r{i}", 3, events, FinishReason.LENGTH, prompt=4))))
            wait_until(lambda: len(o.spans.get_finished_spans()) == 2, 30, what="both request spans")
        assert sorted(_spans(o)) == ["r0", "r1"]
        assert {s.attributes["gen_ai.usage.output_tokens"] for s in _spans(o).values()} == {3}
        assert len([r for r in caplog.records if "vLLM's own decoder" in r.getMessage()]) == 1
    finally:
        sender.close()
        consumer.close()


def test_an_engine_core_that_died_just_before_the_serve_stopped_cuts_its_requests_short(stream: Any) -> None:
    """The serve stops (its exit) right after an engine core died: the consumer's last read finds
    the connection ended without a goodbye, so its requests end ``engine_dead``, not ``shutdown``."""
    t, o = time.monotonic(), stream
    o.sender.send(stream_channel.json_frame(stream_channel.HELLO, {"engine": 0, "model": "tiny"}))
    o.sender.send(_encode(_outputs(t, _out("y", 1, ((QUEUED, t - 0.2), (SCHEDULED, t - 0.1)), prompt=5))))
    wait_until(lambda: o.consumer._engines, 30, what="the engine core's hello read")
    o.sender.close()  # no goodbye: the engine core died
    o.consumer.close()  # at once: the serve's exit
    (span,) = o.spans.get_finished_spans()
    assert span.attributes["llm.request.incomplete"] == "engine_dead"


def test_an_engine_core_the_serve_stops_without_its_goodbye_ends_its_requests_shutdown(stream: Any) -> None:
    """vLLM was asked to stop and kills an engine core that is held or slow (its shutdown timeout
    is 0 by default), so no goodbye comes: its requests end ``shutdown``, not ``engine_dead``."""
    t, o = time.monotonic(), stream
    o.sender.send(stream_channel.json_frame(stream_channel.HELLO, {"engine": 0, "model": "tiny"}))
    o.sender.send(_encode(_outputs(t, _out("z", 1, ((QUEUED, t - 0.2), (SCHEDULED, t - 0.1)), prompt=5))))
    wait_until(lambda: o.consumer._engines, 30, what="the engine core's hello read")
    o.consumer.serve_stopping()
    o.sender.close()  # killed by vLLM's shutdown
    wait_until(lambda: len(o.spans.get_finished_spans()) == 1, 30, what="the cut-short span")
    (span,) = o.spans.get_finished_spans()
    assert span.attributes["llm.request.incomplete"] == "shutdown"


@pytest.mark.parametrize(("timeout", "told"), [(0.0, 1), (None, 0)])
def test_vllms_engine_managers_tell_a_stop_only_when_vllm_was_asked_to_stop(
    monkeypatch: Any, timeout: Any, told: int
) -> None:
    """vLLM passes its managers' ``shutdown`` a timeout only after SIGTERM or SIGINT; without one,
    an engine core or the frontend died. The manager is vLLM's own, its processes already gone
    (Ray's manager, wrapped the same way, needs Ray to stop: not installed here)."""
    import threading
    import weakref

    from vllm.v1.engine import utils

    managers = [getattr(utils, name) for name in serve_stop.MANAGERS]
    for cls in managers:
        monkeypatch.setattr(cls, "shutdown", cls.shutdown)  # the wrappers are undone after the test
    calls: list[None] = []
    assert serve_stop.watch(lambda: calls.append(None))
    assert serve_stop.watch(lambda: calls.append(None))  # a second watch does not wrap again
    assert all(getattr(cls.shutdown, "__wrapped__", None) is not None for cls in managers)
    manager = utils.CoreEngineProcManager.__new__(utils.CoreEngineProcManager)
    manager.manager_stopped = threading.Event()
    finalizer = weakref.finalize(manager, lambda: None)
    finalizer.detach()  # its processes already stopped: vLLM's shutdown has nothing left to stop
    manager._finalizer = finalizer
    manager.shutdown(timeout=timeout)
    assert manager.manager_stopped.is_set() and len(calls) == told
