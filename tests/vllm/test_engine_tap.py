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
from collections import Counter
from contextlib import ExitStack
from typing import Any, Iterator

import pytest
from samples import otel_samples
from scheduler_load import Record, Spec, build_scheduler, make_request, model_output, seeded_load

from otel_llm.catalogue.metrics import BY_KEY
from otel_llm.integrations.vllm.engine_core import engine_tap
from otel_llm.integrations.vllm.frontend.stream_consumer import StreamConsumer
from tests.support.backends import wait_until


class Engine:
    """vLLM's ``EngineCoreProc`` with its real request, abort and output-thread methods (wrapped by
    the tap) over a real scheduler; not started (no model, no input thread): the test steps it."""

    def __init__(
        self, model_dir: str, num_blocks: int = 64, policy: str = "fcfs", batched_tokens: int = 256, index: int = 0
    ) -> None:
        from vllm.v1.engine.core import EngineCoreProc

        scheduler = build_scheduler(
            model_dir,
            num_blocks=num_blocks,
            max_num_seqs=8,
            max_num_batched_tokens=batched_tokens,
            max_model_len=512,
            policy=policy,
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
            target=self.core.process_output_sockets, args=([self.frontend_path], None, index), daemon=True
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
        self.add_spec(Spec(rid, list(range(3, 3 + prompt)), max_tokens, 0))

    def add_spec(self, spec: Spec) -> None:
        request = make_request(spec)
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
    assert not [s for s in spans.values() if "llm.tenant" in s.attributes]  # no tenant source: no tenant


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
    # The consumer held until every output is in its socket, so that the abort's settling time
    # cannot run out first, however slow this machine is: the frames decide, not the clock.
    with o.consumer._lock:
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


# 24 requests in three priority classes on 20 blocks of 16 tokens: the priority policy preempts
# the lowest class first, and the classes preempt each other.
TENANT_BLOCKS = 20
TENANT_SEED = 2
TENANT_STEPS = 2000


def _tenant_specs() -> list[Spec]:
    specs = seeded_load(TENANT_SEED, 24, prompt=(8, 48), output=(32, 128), spread=10)
    return [s._replace(priority=int(s.request_id[-2:]) % 3) for s in specs]


def _by_tenant(samples: dict[Any, float], name: str) -> dict[tuple[str, Any], float]:
    """``{(tenant, le or None): value}`` of one sample name."""
    return {(dict(k[1])["tenant"], dict(k[1]).get("le")): v for k, v in samples.items() if k[0] == name}


def test_per_tenant_preemptions_and_the_matrix_are_the_schedulers_own(
    otel: Any, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the priority policy, with OTEL_LLM_TENANT=priority: each priority class's
    request_num_preemptions (every bucket) and the tenant matrix equal the record taken by
    wrapping vLLM's own scheduler methods (who preempted whom)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from otel_llm.config.tenants import SOURCES_BY_ENTRY_POINT
    from otel_llm.integrations.vllm.channels import cause_channel
    from otel_llm.integrations.vllm.engine_core import engine_core
    from otel_llm.integrations.vllm.frontend import deep_hook
    from otel_llm.integrations.vllm.frontend.stream_consumer import ENTRY_POINT

    folder = tempfile.mkdtemp(prefix="otel-llm-tap-")
    monkeypatch.setenv(cause_channel.ENV, folder)  # the engine core's cause reports go to this consumer
    monkeypatch.setattr(engine_core, "_sender", [])
    o = otel(tenant_sources=SOURCES_BY_ENTRY_POINT[ENTRY_POINT], tenant="priority")
    consumer = StreamConsumer(folder, handle=o.handle).start()
    record = Record()
    with ExitStack() as stack:
        stack.callback(consumer.close)
        stack.callback(engine_tap.uninstall)
        assert engine_tap.install(folder)
        stack.callback(record.install(Scheduler))
        stack.callback(deep_hook.uninstall)
        deep_hook._install_cause_reports()
        engine = Engine(model_dir, num_blocks=TENANT_BLOCKS, policy="priority", batched_tokens=128)
        stack.callback(engine.stop)
        record.watch(engine.core.scheduler)
        specs = _tenant_specs()
        pending, finished = list(specs), 0
        for step in range(TENANT_STEPS):
            while pending and pending[0].arrives <= step:
                engine.add_spec(pending.pop(0))
            finished += sum(out.finish_reason is not None for eco in engine.step().values() for out in eco.outputs)
            if not pending and finished == len(specs):
                break
        engine.all_sent()
        wait_until(lambda: len(o.spans.get_finished_spans()) == len(specs), 30, what="every request span")

    tenant = {s.request_id: str(s.priority) for s in specs}
    suffered = Counter(p.victim for p in record.preemptions)
    matrix = Counter((tenant[p.victim], tenant[p.cause]) for p in record.preemptions if p.cause is not None)
    assert all(p.where == "schedule" and p.cause is not None for p in record.preemptions)
    assert {v for v, c in matrix if v != c} and len(record.preemptions) >= 20  # the classes hurt each other
    samples = otel_samples(o.reader, {"vllm:num_preemptions_by_tenant", "vllm:request_num_preemptions"})
    assert {
        (dict(k[1])["tenant"], dict(k[1])["cause_tenant"]): v
        for k, v in samples.items()
        if k[0] == "vllm:num_preemptions_by_tenant_total"
    } == dict(matrix)
    histogram = _by_tenant(samples, "vllm:request_num_preemptions_bucket")
    bounds = sorted({le for _, le in histogram})
    assert histogram == {
        (t, le): sum(suffered[rid] <= le for rid in tenant if tenant[rid] == t)
        for t in ("0", "1", "2")
        for le in bounds
    }
    assert _by_tenant(samples, "vllm:request_num_preemptions_sum") == {
        (t, None): sum(suffered[rid] for rid in tenant if tenant[rid] == t) for t in ("0", "1", "2")
    }
    spans = {s.attributes["gen_ai.request.id"]: s for s in o.spans.get_finished_spans()}
    assert {rid: s.attributes["llm.tenant"] for rid, s in spans.items()} == tenant


def test_the_adapter_is_the_tenant_and_a_base_model_request_the_served_model(
    otel: Any, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from otel_llm.config.tenants import SOURCES_BY_ENTRY_POINT
    from otel_llm.integrations.vllm.frontend.stream_consumer import ENTRY_POINT

    folder = tempfile.mkdtemp(prefix="otel-llm-tap-")
    o = otel(tenant_sources=SOURCES_BY_ENTRY_POINT[ENTRY_POINT], tenant="lora")
    consumer = StreamConsumer(folder, handle=o.handle).start()
    with ExitStack() as stack:
        stack.callback(consumer.close)
        stack.callback(engine_tap.uninstall)
        assert engine_tap.install(folder)
        engine = Engine(model_dir)
        stack.callback(engine.stop)
        for rid, lora in (("a", "team-a"), ("b", "team-b"), ("base", None), ("a2", "team-a")):
            engine.add_spec(Spec(rid, list(range(3, 13)), 4, 0, lora=lora))
        _run_until_finished(engine, 4)
        engine.all_sent()
        wait_until(lambda: len(o.spans.get_finished_spans()) == 4, 30, what="4 request spans")
    served = engine.core.vllm_config.model_config.served_model_name
    spans = {s.attributes["gen_ai.request.id"]: s for s in o.spans.get_finished_spans()}
    assert {rid: s.attributes["llm.tenant"] for rid, s in spans.items()} == {
        "a": "team-a",
        "b": "team-b",
        "base": served,
        "a2": "team-a",
    }
    samples = otel_samples(o.reader, {"vllm:generation_tokens"})
    assert _by_tenant(samples, "vllm:generation_tokens_total") == {
        ("team-a", None): 8.0,
        ("team-b", None): 4.0,
        (served, None): 4.0,
    }


def test_a_source_the_engine_core_does_not_see_is_refused_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Under the Rust frontend the engine core sees no request header nor baggage: such a source
    is refused with one warning, and the engine's telemetry runs without a tenant; its own
    facts (priority, adapter, model) are kept."""
    hello = {"engine": 0, "model": "served", "max_model_len": 512, "custom_histogram_buckets": {}}
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    consumer = StreamConsumer(tempfile.mkdtemp(prefix="otel-llm-refuse-")).start()
    try:
        for source, kept in (("header:x-team", None), ("baggage:team", None), ("lora", "lora"), ("model", "model")):
            monkeypatch.setenv("OTEL_LLM_TENANT", source)
            caplog.clear()
            assert consumer._new_telemetry(0, hello).config.tenant == kept
            refusals = [r.getMessage() for r in caplog.records if "does not reach" in r.getMessage()]
            assert refusals == (
                []
                if kept
                else [
                    f"otel_llm: OTEL_LLM_TENANT={source} does not reach vllm-engine-core, which hands over "
                    "priority, lora, model: no tenant label on any series"
                ]
            )
    finally:
        consumer.close()
