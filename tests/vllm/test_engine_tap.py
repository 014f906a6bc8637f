"""The engine-core stream through the real tap: vLLM's own ``EngineCoreProc`` methods (its output
thread ``process_output_sockets`` encoding and sending on a real zmq socket, ``add_request``,
``abort_requests``) wrapped by ``engine_tap`` on an engine core whose scheduler is vLLM's real
``Scheduler`` (:mod:`scheduler_load`: the model is the only stand-in), handed over to a real
consumer. Off the happy path: a utility call before the first request, requests its frontend
aborts (a client gone, a stop string found by the frontend), an engine core gone idle after an
abort, a frame that cannot be decoded, outputs after the goodbye."""

from __future__ import annotations

import queue
import tempfile
import threading
import time
from typing import Any, Iterator

import pytest
from samples import otel_samples
from scheduler_load import Spec, build_scheduler, make_request, model_output

from otel_llm.catalogue.metrics import BY_KEY
from otel_llm.integrations.vllm.engine_core import engine_tap
from otel_llm.integrations.vllm.frontend.stream_consumer import StreamConsumer
from tests.support.backends import wait_until


class Engine:
    """vLLM's ``EngineCoreProc`` with its real request, abort and output-thread methods (wrapped by
    the tap) over a real scheduler; not started (no model, no input thread): the test steps it."""

    def __init__(self, model_dir: str, num_blocks: int = 64) -> None:
        from vllm.v1.engine.core import EngineCoreProc

        scheduler = build_scheduler(
            model_dir, num_blocks=num_blocks, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512
        )
        self.core = EngineCoreProc.__new__(EngineCoreProc)
        self.core.scheduler = scheduler
        self.core.vllm_config = scheduler.vllm_config
        self.core.output_queue = queue.Queue()
        self.frontend_path = f"ipc://{tempfile.mkdtemp(prefix='otel-llm-zmq-')}/out"
        self.received = 0  # messages vLLM sent its frontend
        self.put_count = 0  # messages put on its output queue
        self._frontend = threading.Thread(target=self._receive, daemon=True)
        self._frontend.start()
        self._thread = threading.Thread(
            target=self.core.process_output_sockets, args=([self.frontend_path], None, 0), daemon=True
        )
        self._thread.start()
        wait_until(lambda: engine_tap._state["tap"].hello is not None, 30, what="the output thread's start")

    def _receive(self) -> None:
        import zmq

        with zmq.Context() as ctx, ctx.socket(zmq.PULL) as pull:
            pull.bind(self.frontend_path)
            while True:
                if pull.recv_multipart() == [b"stop"]:
                    return
                self.received += 1

    def add(self, rid: str, prompt: int, max_tokens: int) -> None:
        request = make_request(Spec(rid, list(range(3, 3 + prompt)), max_tokens, 0))
        request.arrival_time = time.time()  # vLLM's frontend stamps it on the wall clock
        self.core.add_request(request)

    def step(self) -> Any:
        scheduler = self.core.scheduler
        output = scheduler.schedule()
        outputs = scheduler.update_from_output(output, model_output(scheduler, output))
        for client, eco in outputs.items():
            self.core.output_queue.put_nowait((client, eco))
            self.put_count += 1
        return outputs

    def put(self, eco: Any) -> None:
        self.core.output_queue.put_nowait((0, eco))
        self.put_count += 1

    def all_sent(self) -> None:
        """Wait until vLLM's output thread sent every message put to its frontend (the tap's
        hand-over runs right after each)."""
        count = self.put_count
        wait_until(lambda: self.received >= count, 30, what=f"{count} messages to the frontend")

    def stop(self) -> None:
        import zmq
        from vllm.v1.engine.core import EngineCoreProc

        self.core.output_queue.put_nowait(EngineCoreProc.ENGINE_CORE_DEAD)
        self._thread.join(timeout=10)
        with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as push:
            push.connect(self.frontend_path)
            push.send(b"stop")
        self._frontend.join(timeout=10)


@pytest.fixture
def tapped(otel: Any, model_dir: str) -> Iterator[Any]:
    folder = tempfile.mkdtemp(prefix="otel-llm-tap-")
    o = otel()
    o.consumer = StreamConsumer(folder, handle=o.handle).start()
    assert engine_tap.install(folder)
    o.engine = Engine(model_dir)
    o.spans_by_id = lambda: {s.attributes["gen_ai.request.id"]: s for s in o.spans.get_finished_spans()}
    yield o
    o.engine.stop()
    engine_tap.uninstall()
    o.consumer.close()


def _utility_output() -> Any:
    from vllm.v1.engine import EngineCoreOutputs, UtilityOutput

    return EngineCoreOutputs(utility_output=UtilityOutput(call_id=1))


def _run_until_finished(engine: Engine, count: int, max_steps: int = 400) -> None:
    """Step until ``count`` requests finished."""
    finished = 0
    for _ in range(max_steps):
        for eco in engine.step().values():
            finished += sum(o.finish_reason is not None for o in eco.outputs)
        if finished >= count:
            return
    raise AssertionError(f"{count - finished} requests unfinished after {max_steps} steps")


def test_a_utility_call_before_the_first_request_loses_nothing(tapped: Any) -> None:
    """``POST /reset_prefix_cache`` (or a LoRA load, a profiler start) before any request: its
    result is the first output message; every request after it is recorded."""
    o, engine = tapped, tapped.engine
    engine.put(_utility_output())
    engine.all_sent()
    for i in range(4):
        engine.add(f"r{i}", prompt=20, max_tokens=6)
    _run_until_finished(engine, 4)
    engine.all_sent()
    wait_until(lambda: len(o.spans.get_finished_spans()) == 4, 30, what="4 request spans")
    spans = o.spans_by_id()
    assert sorted(spans) == ["r0", "r1", "r2", "r3"]
    assert {s.attributes["gen_ai.usage.output_tokens"] for s in spans.values()} == {6}
    assert {s.attributes["gen_ai.response.finish_reasons"] for s in spans.values()} == {("length",)}


def test_a_request_its_frontend_aborts_ends_while_the_server_runs(tapped: Any) -> None:
    """A client gone, or a stop string the frontend found: vLLM aborts it in the engine core and
    sends nothing for it. Its span ends ``abort`` with the tokens it had, the others run on."""
    o, engine = tapped, tapped.engine
    engine.add("gone", prompt=20, max_tokens=50)
    engine.add("stays", prompt=20, max_tokens=12)
    for _ in range(5):  # prefill, then tokens 1..4 of each
        engine.step()
    engine.core.abort_requests(["gone"])
    engine.core.abort_requests(["gone", "never-added"])  # again, and one it never had: nothing more
    _run_until_finished(engine, 1)
    engine.all_sent()
    wait_until(lambda: len(o.spans.get_finished_spans()) == 2, 30, what="both request spans")
    spans = o.spans_by_id()
    assert spans["gone"].attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert spans["gone"].attributes["gen_ai.usage.output_tokens"] == 5
    assert spans["stays"].attributes["gen_ai.response.finish_reasons"] == ("length",)
    samples = otel_samples(o.reader, {"vllm:request_success"})
    by_reason = {dict(k[1])["finished_reason"]: v for k, v in samples.items() if k[0] == "vllm:request_success_total"}
    assert by_reason == {"abort": 1, "length": 1}


def test_an_abort_on_an_idle_engine_core_ends_its_request(tapped: Any) -> None:
    """The last request aborted: the engine core has nothing more to send, the request still ends
    (within the consumer's settling time), not at the serve's exit."""
    o, engine = tapped, tapped.engine
    engine.add("last", prompt=10, max_tokens=100)
    for _ in range(3):
        engine.step()
    engine.all_sent()
    engine.core.abort_requests(["last"])
    wait_until(lambda: len(o.spans.get_finished_spans()) == 1, 30, what="the aborted request's span")
    (span,) = o.spans.get_finished_spans()
    assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert span.attributes["gen_ai.usage.output_tokens"] == 3


def test_an_abort_raced_by_outputs_made_before_it_counts_them_all(tapped: Any) -> None:
    """Outputs made before the abort are still in vLLM's output queue when the busy loop tells the
    abort (its output thread lags): the request ends after them, with every token."""
    o, engine = tapped, tapped.engine
    engine.add("slow", prompt=10, max_tokens=100)
    engine.add("other", prompt=10, max_tokens=8)
    held = queue.Queue()
    engine.core.output_queue, real = held, engine.core.output_queue  # the output thread waits on `real`
    for _ in range(4):
        engine.step()
    engine.core.abort_requests(["slow"])  # told at once; its 4 outputs are still held
    while not held.empty():
        real.put_nowait(held.get_nowait())
    engine.core.output_queue = real
    _run_until_finished(engine, 1)
    engine.all_sent()
    wait_until(lambda: len(o.spans.get_finished_spans()) == 2, 30, what="both spans")
    spans = o.spans_by_id()
    assert spans["slow"].attributes["gen_ai.usage.output_tokens"] == 4
    assert spans["slow"].attributes["gen_ai.response.finish_reasons"] == ("abort",)
    dropped = otel_samples(o.reader, {"otel_llm.dropped_events"})
    assert not [v for v in dropped.values() if v], dropped  # no event after its finish


def test_a_frame_that_cannot_be_decoded_is_skipped_and_counted(tapped: Any) -> None:
    """A message the consumer cannot decode mid-stream: skipped and counted, said once; the
    connection, its requests and what follows go on."""
    from vllm.v1.engine import EngineCoreOutputs

    o, engine = tapped, tapped.engine
    engine.add("a", prompt=10, max_tokens=6)
    engine.step()
    engine.put(EngineCoreOutputs(timestamp="not a time"))  # type: ignore[arg-type]
    _run_until_finished(engine, 1)
    engine.all_sent()
    wait_until(lambda: len(o.spans.get_finished_spans()) == 1, 30, what="the span after the bad frame")
    (span,) = o.spans.get_finished_spans()
    assert span.attributes["gen_ai.usage.output_tokens"] == 6
    dropped = otel_samples(o.reader, {"otel_llm.dropped_events"})
    by_reason = {dict(k[1])["reason"]: v for k, v in dropped.items() if k[0] == "otel_llm.dropped_events_total"}
    assert by_reason["engine_stream_unreadable"] == 1
    assert o.consumer.unreadable == 1


def test_repetition_is_vllms_own_finish_reason(tapped: Any) -> None:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.metrics.stats import SchedulerStats

    o, engine = tapped, tapped.engine
    engine.add("loops", prompt=10, max_tokens=50)
    engine.step()
    loops = EngineCoreOutput("loops", [7], finish_reason=FinishReason.REPETITION)
    engine.put(EngineCoreOutputs(outputs=[loops], scheduler_stats=SchedulerStats()))
    engine.all_sent()
    wait_until(lambda: len(o.spans.get_finished_spans()) == 1, 30, what="the span")
    (span,) = o.spans.get_finished_spans()
    assert span.attributes["gen_ai.response.finish_reasons"] == ("repetition",)


def test_nothing_is_sent_after_the_goodbye(tapped: Any) -> None:
    """An output after the engine core said goodbye does not connect again (no second hello)."""
    o, engine = tapped, tapped.engine
    engine.add("a", prompt=10, max_tokens=3)
    _run_until_finished(engine, 1)
    engine.all_sent()
    wait_until(lambda: len(o.spans.get_finished_spans()) == 1, 30, what="the span")
    tap = engine_tap._state["tap"]
    tap.bye()
    engine.put(_utility_output())
    engine.put(_utility_output())  # sent after the first one's hand-over is done
    engine.all_sent()
    assert not tap.sender.connected
    wait_until(lambda: not o.consumer._by_index, 30, what="the engine core's goodbye read")


def test_the_hello_carries_the_engines_settings(tapped: Any, monkeypatch: Any) -> None:
    """The consumer resolves an engine's settings as the stat-logger path does: the served model's
    name, its ``max_model_len`` (the request token buckets stop there), vLLM's custom histogram
    buckets and the provider ``vllm``."""
    import json

    hello = json.loads(engine_tap._state["tap"].hello[5:])  # after the kind and the length
    assert hello == {
        "engine": 0,
        "model": tapped.engine.core.vllm_config.model_config.served_model_name,
        "max_model_len": 512,
        "custom_histogram_buckets": {},
    }
    for var in ("OTEL_LLM_MAX_MODEL_LEN", "OTEL_LLM_MODEL_NAME", "OTEL_LLM_PROVIDER_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    consumer = StreamConsumer(tempfile.mkdtemp(prefix="otel-llm-hello-")).start()
    try:
        telemetry = consumer._new_telemetry(3, hello)
        assert telemetry.config.max_model_len == 512 and telemetry.config.provider_name == "vllm"
        assert telemetry.config.model_name == hello["model"] and telemetry.config.engine == "3"
        # vLLM's --custom-histogram-buckets, read in the engine core, bound the same series here.
        observability = tapped.engine.core.vllm_config.observability_config
        monkeypatch.setattr(
            observability,
            "custom_histogram_buckets",
            {"request_latency": [1.0, 10.0], "request_num_preemptions": [1, 3]},
        )
        custom = json.loads(engine_tap._hello(tapped.engine.core, 4)[5:])
        assert custom["custom_histogram_buckets"] == {
            "request_latency": [1.0, 10.0],
            "request_num_preemptions": [1.0, 3.0],
        }
        config = consumer._new_telemetry(4, custom).config
        assert config.preemption_buckets == (1.0, 3.0)
        assert (
            BY_KEY["e2e_request_latency_seconds"].boundaries(config)
            == BY_KEY["request_queue_time_seconds"].boundaries(config)
            == (1.0, 10.0)
        )
        assert BY_KEY["time_to_first_token_seconds"].boundaries(config) == BY_KEY[
            "time_to_first_token_seconds"
        ].boundaries(telemetry.config)  # not a family set
    finally:
        consumer.close()
