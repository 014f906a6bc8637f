"""Where the telemetry lives under a vLLM frontend that calls no stat-logger plugin (the Rust
frontend): a thread in ``vllm serve``'s own process, which outlives its engine cores; with several
local engines, each engine after the first has a process of its own running this same consumer
(:mod:`.engine_workers`), whose families the serve's endpoint serves.

It listens on the serve's stream channel (:mod:`.stream_channel`) and on its cause channel
(:mod:`.cause_channel`); each engine core connects, says who it is, and hands over what it sent
its frontend. Per engine: one ``EngineTelemetry`` (label ``engine``: its index) fed by a
:class:`.StreamTranslator`, on providers of its own that ``setup_telemetry`` builds from the
environment, with a ``service.instance.id`` of its own (the serve's, ``-engine-N``), all served on
one Prometheus endpoint, with the settings the engine core tells at its hello (its served model's
name, ``max_model_len``, vLLM's custom histogram buckets) under the environment's, resolved as the
stat-logger path resolves them (:func:`.plan.engine_config`). A tenant source reaches it only from
what the engine core has of each request (its priority, its LoRA adapter, the served model): it
sees no request header. An engine core that stops cleanly says so; one whose connection ends
otherwise died: its requests in flight end, marked ``engine_dead``. When the serve exits, those
still in flight end marked ``shutdown`` and everything is flushed.

Never an exception into vLLM, and a failure costs only what failed: a frame that cannot be decoded
or translated is skipped and counted (``engine_stream_unreadable``, said once); a connection whose
framing is broken is dropped (its engine core connects again, its requests go on); a failure of the
thread itself is logged once and the consumer stops, vLLM serves on.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import json
import logging
import os
import select
import signal
import socket
import threading
import time
from typing import Any, Callable, Optional

from otel_llm.catalogue import drops
from otel_llm.config.tenants import SOURCES_BY_ENTRY_POINT
from otel_llm.export import resource as resources
from otel_llm.integrations.vllm.channels import cause_channel, stream_channel
from otel_llm.integrations.vllm.plan import engine_config
from otel_llm.integrations.vllm.translation import stream_translate
from otel_llm.integrations.vllm.translation.fields import FieldReader
from otel_llm.integrations.vllm.translation.stream_translate import StreamTranslator
from otel_llm.summary import ENGINE_DEAD, SHUTDOWN

_log = logging.getLogger("otel_llm.integrations.vllm")

ENTRY_POINT = "vllm-engine-core"  # its tenant sources: otel_llm.config.tenants.SOURCES_BY_ENTRY_POINT

MAX_CAUSES = 65_536  # cause records kept until their preemption's output comes
MAX_UNCREDITED = 1024  # cause records kept until their victim is known, to credit its causes
UNCREDITED_TRIES = 8  # drains a cause record waits for its victim's given row, then it is let go
POLL_S = 0.5  # how often the thread looks whether it should stop, when nothing comes
# After a read, the next waits this long: the engine steps' frames meanwhile (one every few ms on
# a small model) are read and recorded together, the consumer's code and data warm for all but
# the first, instead of each after the engine's work has evicted them. Each read takes all that
# waits; meanwhile the engine core's socket buffer holds what it sends (SEND_BUFFER asked for,
# 416 KiB under a stock net.core.wmem_max), then its backlog. A read of BUSY_READ bytes or more
# means the engines send fast enough to fill that buffer within the gap: the next read follows at
# once (a gap would cap an engine at about its socket buffer per gap plus the time to record it),
# and the frames are large enough that the cold start of each read costs little per output.
READ_GAP_S = 0.05
BUSY_READ = 64 << 10
READ_SIZE = 1 << 20
# An abort ends its request once no output made before it can still be on its way: at the first
# output made after it, or this long after it (an idle engine core sends nothing more).
ABORT_SETTLE_S = 0.5


class _Engine:
    def __init__(self, index: int, telemetry: Any, translator: StreamTranslator) -> None:
        self.index = index
        self.telemetry = telemetry
        self.translator = translator
        self.clean = False  # the engine core said it shut down


class StreamConsumer:
    """``StreamConsumer(folder).start()``; :meth:`close` at exit (registered with atexit).
    ``handle``: providers already built (a ``TelemetryHandle``) for every engine, one identity;
    else ``setup_telemetry`` builds each engine's from the environment at its hello.

    In an engine's own process (:mod:`.engine_worker`): ``listener``, that engine's socket, made
    by the serve; ``serve_on``, a Prometheus endpoint that is not served (the serve asks it for
    its families); ``instance_id``, the serve's ``service.instance.id``. In the serve: the
    engines recorded in processes of their own (:meth:`add_worker`), served on its endpoint."""

    def __init__(
        self,
        folder: str,
        handle: Any = None,
        *,
        listener: Optional[socket.socket] = None,
        serve_on: Any = None,
        instance_id: Optional[str] = None,
    ) -> None:
        self.folder = folder
        if listener is None:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(os.path.join(folder, stream_channel.SOCKET_NAME))
            listener.listen(64)
        self._listener = listener
        self._serve_on = serve_on
        self._instance_id = instance_id
        self._workers: list[Any] = []  # engine_workers.EngineWorker: the engines recorded elsewhere
        self._causes = cause_channel.Receiver(folder)
        self._cause_book: dict[tuple[str, int], cause_channel.CauseRecord] = {}
        self._uncredited: list[tuple[cause_channel.CauseRecord, int]] = []  # with the drains it waited
        self._connections: dict[socket.socket, stream_channel.Connection] = {}
        self._engines: dict[socket.socket, _Engine] = {}  # by connection, from its hello
        self._by_index: dict[int, _Engine] = {}  # an engine core's, across its connections until it ends
        self._lost_before_hello: dict[socket.socket, int] = {}  # an engine core's losses told before its hello
        self._telemetry_by_index: dict[int, Any] = {}
        self._given: Any = handle
        self._handles: list[Any] = []  # built here, one per engine; the first owns the Prometheus endpoint
        self._decoder: Any = None
        self._reader = FieldReader(_log)
        self.unreadable = 0  # frames skipped: they could not be decoded or translated
        self._stop = threading.Event()
        self._serve_stopping = False  # vLLM was asked to stop: engine cores it kills did not die
        self._lock = threading.Lock()  # the thread's work and close() never interleave
        self._thread = threading.Thread(target=self._run, name="otel-llm engine stream", daemon=True)

    def start(self) -> "StreamConsumer":
        self._thread.start()
        atexit.register(self._close_at_exit)
        return self

    def _close_at_exit(self) -> None:
        """At the serve's exit: an orchestrator's second SIGTERM (after an engine core died, say)
        must not cut the final flush short, which vLLM's handler would do by raising SystemExit;
        the flush is bounded (``TelemetryHandle.shutdown``)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.close()

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([self._listener, *self._connections], [], [], POLL_S)
                read = 0
                with self._lock:
                    if self._stop.is_set():
                        return
                    for peer in ready:
                        if peer is self._listener:
                            connection, _ = self._listener.accept()
                            connection.setblocking(False)
                            self._connections[connection] = stream_channel.Connection(connection)
                        else:
                            read = max(read, self._read(peer))
                    self._settle(time.monotonic() - ABORT_SETTLE_S)
                    for worker in self._workers:
                        worker.check()
                if ready and read < BUSY_READ:
                    self._stop.wait(READ_GAP_S)
        except Exception:  # noqa: BLE001 - never into vLLM: the consumer stops, vLLM serves on
            _log.exception("otel-llm engine stream: the consumer failed and stops recording (reported once)")

    @staticmethod
    def _recv(peer: socket.socket) -> Optional[bytes]:
        """A chunk of what ``peer`` sent; b"" when its connection ended; None when nothing waits."""
        try:
            return peer.recv(READ_SIZE)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _read(self, peer: socket.socket) -> int:
        """All that ``peer`` sent and waits; its end, when its connection ended or sent garbage.
        The bytes read."""
        read = 0
        while True:
            chunk = self._recv(peer)
            if chunk is None:
                return read
            if not chunk:
                break
            read += len(chunk)
            try:
                for kind, payload in self._connections[peer].frames(chunk):
                    try:
                        self._frame(peer, kind, payload)
                    except Exception as exc:  # noqa: BLE001 - this frame only: the rest goes on
                        self._unreadable(peer, kind, exc)
            except ValueError as exc:  # its framing is broken: nothing after can be trusted
                _log.warning(
                    "otel-llm engine stream: a connection sent garbage (%s); it is dropped, its engine core "
                    "connects again",
                    exc,
                )
                self._forget(peer)
                return read
            if len(chunk) < READ_SIZE:
                return read
        self._ended(peer)
        return read

    def _unreadable(self, peer: socket.socket, kind: bytes, exc: Exception) -> None:
        self.unreadable += 1
        engine = self._engines.get(peer)
        if engine is not None:
            engine.telemetry.count_dropped(drops.ENGINE_STREAM_UNREADABLE, 1)
        if self.unreadable == 1:
            _log.warning(
                "otel-llm engine stream: a %r frame of engine %s could not be decoded or translated (%r); it is "
                "skipped and counted on otel_llm.dropped_events (reason %s), and so is any other (said once)",
                kind,
                engine.index if engine is not None else "?",
                exc,
                drops.ENGINE_STREAM_UNREADABLE,
            )

    def _frame(self, peer: socket.socket, kind: bytes, payload: bytes) -> None:
        engine = self._engines.get(peer)
        if kind == stream_channel.HELLO:
            hello = json.loads(payload)
            freeze_start_up_heap()
            engine = self._engines[peer] = self._engine(hello)
            lost = self._lost_before_hello.pop(peer, 0)
            if lost:
                engine.telemetry.count_dropped(drops.ENGINE_STREAM_LOST, lost)
                _log.warning(
                    "otel-llm engine stream: engine %s handed over nothing for %d messages before this connection "
                    "(the consumer started late, or restarted); its requests then are counted from here on",
                    hello["engine"],
                    lost,
                )
        elif engine is None:
            if kind == stream_channel.LOST:  # told before the hello that follows it
                self._lost_before_hello[peer] = self._lost_before_hello.get(peer, 0) + int(json.loads(payload))
        elif kind == stream_channel.OUTPUTS:
            engine.translator.outputs(self._decode(payload))
        elif kind == stream_channel.ABORTED:
            at, request_ids = json.loads(payload)
            engine.translator.aborted(float(at), [str(rid) for rid in request_ids])
        elif kind == stream_channel.REQUESTS:
            engine.translator.given(json.loads(payload))
            if engine.translator.lost_requests:
                engine.telemetry.count_dropped(drops.ENGINE_STREAM_LOST, engine.translator.lost_requests)
                engine.translator.lost_requests = 0
        elif kind == stream_channel.LOST:
            engine.telemetry.count_dropped(drops.ENGINE_STREAM_LOST, int(json.loads(payload)))
        elif kind == stream_channel.BYE:
            engine.clean = True

    def _decode(self, payload: bytes) -> Any:
        if self._decoder is None:
            self._decoder = stream_translate.decoder(self._reader)
        try:
            return self._decoder(payload)
        except ValueError as exc:  # msgspec's ValidationError: a field of a type not foreseen
            _log.warning(
                "otel-llm engine stream: this vLLM's outputs do not decode as expected (%s); "
                "decoding them with vLLM's own decoder from now on, at a higher cost",
                exc,
            )
            self._decoder = _vllm_decoder()
            return self._decoder(payload)

    def _drain_causes(self) -> None:
        """Each cause record kept for its victim's event, and its causes credited at once: the
        victim's event comes with its next output, maybe after a cause finished. The records are
        read ahead of the frames: one whose victim and causes are in given rows still to be read
        is credited at a later drain, unless its event came first (which credited them)."""
        book = self._cause_book
        records, self._uncredited = self._uncredited, []
        for record in self._causes.drain():
            if len(book) >= MAX_CAUSES:
                book.pop(next(iter(book)))
            book[(record.victim, record.ordinal)] = record
            records.append((record, 0))
        for record, tries in records:
            if (record.victim, record.ordinal) not in book:
                continue
            for engine in self._by_index.values():  # its victim's engine, where its causes are too
                translator = engine.translator
                if translator.knows(record.victim) or any(translator.knows(c) for c in record.causes):
                    engine.telemetry.credit_causes(record.victim, record.ordinal, record.causes)
                    break
            else:
                if tries < UNCREDITED_TRIES and len(self._uncredited) < MAX_UNCREDITED:
                    self._uncredited.append((record, tries + 1))
        if self._causes.lost:
            for engine in self._by_index.values():
                engine.telemetry.count_dropped(drops.CAUSE_RECORDS_LOST, self._causes.lost)
                break
            self._causes.lost = 0

    def _cause_of(self, victim: str, ordinal: int) -> Optional[cause_channel.CauseRecord]:
        return self._cause_book.pop((victim, ordinal), None)

    def _engine(self, hello: dict[str, Any]) -> _Engine:
        """The engine a hello names: the one already known by its index (a connection made again:
        its requests go on), else a new one."""
        index = int(hello["engine"])
        engine = self._by_index.get(index)
        if engine is not None:
            engine.clean = False
            return engine
        telemetry = self._telemetry_by_index.get(index)
        if telemetry is None:
            telemetry = self._telemetry_by_index[index] = self._new_telemetry(index, hello)
        model = str(hello.get("model") or "") or None
        translator = StreamTranslator(_publisher(telemetry), self._cause_of, self._drain_causes, self._reader, model)
        engine = self._by_index[index] = _Engine(index, telemetry, translator)
        return engine

    def _new_telemetry(self, index: int, hello: dict[str, Any]) -> Any:
        """Engine ``index``'s telemetry. Its identity is the engine core's, whatever the
        data-parallel size: an engine core of a non-MoE model is told it is the only one."""
        if self._given is not None:
            return self._given.telemetry if index == 0 else self._given.new_telemetry(engine=str(index))
        from otel_llm.export.setup import setup_telemetry, without_prometheus

        max_len = hello.get("max_model_len")
        config = engine_config(
            str(hello.get("model") or "") or None,
            int(max_len) if max_len else None,
            hello.get("custom_histogram_buckets") or {},
        )
        if self._instance_id is not None:  # the serve's, in an engine's own process
            attributes = {**config.resource_attributes, "service.instance.id": self._instance_id}
            config = dataclasses.replace(config, resource_attributes=attributes)
        config = resources.part_of_process(dataclasses.replace(config, engine=str(index)), f"engine-{index}")
        serve_on = self._serve_on or (self._handles[0].prometheus if self._handles else None)
        if self._handles and serve_on is None:
            config = without_prometheus(config)  # the first engine's endpoint is not there: none tries again
        # The engine core sees no request headers: only its own tenant facts reach the telemetry.
        handle = setup_telemetry(
            config,
            port_taken="warn",
            serve_on=serve_on,
            tenant_sources=SOURCES_BY_ENTRY_POINT[ENTRY_POINT],
            entry_point=ENTRY_POINT,
        )
        # Ours to shut down, after the requests in flight are ended (close), not before them.
        atexit.unregister(handle.shutdown)
        self._handles.append(handle)
        if len(self._handles) == 1 and handle.prometheus is not None:
            for worker in self._workers:
                worker.serve_on(handle.prometheus.registry)
        return handle.telemetry

    def add_worker(self, worker: Any) -> None:
        """An engine recorded in a process of its own (``engine_workers.EngineWorker``): its
        families served on this endpoint once there is one; told to end at :meth:`close`."""
        with self._lock:
            self._workers.append(worker)
            endpoint = self._handles[0].prometheus if self._handles else None
            if endpoint is not None:
                worker.serve_on(endpoint.registry)

    def warm(self) -> None:
        """Load what decoding the first outputs needs (vLLM's classes) now, while the engine cores
        load their model, rather than at their first outputs."""
        with self._lock:
            if self._decoder is None:
                self._decoder = stream_translate.decoder(self._reader)

    def _forget(self, peer: socket.socket) -> Optional[_Engine]:
        """Close and drop a connection, the causes its requests need credited first; its engine."""
        self._connections.pop(peer, None)
        self._drain_causes()  # the causes of its requests' last preemptions, credited before they end
        self._lost_before_hello.pop(peer, None)
        peer.close()
        return self._engines.pop(peer, None)

    def _ended(self, peer: socket.socket) -> None:
        """A connection ended: its engine core stopped (said so) or died. Its aborted requests end
        as aborted, the rest in flight as cut short."""
        engine = self._forget(peer)
        if engine is None:
            return
        self._by_index.pop(engine.index, None)
        engine.translator.settle(float("inf"))
        if engine.translator.drain():
            engine.telemetry.end_in_flight(SHUTDOWN if engine.clean or self._serve_stopping else ENGINE_DEAD)

    def _settle(self, until: float) -> None:
        for engine in self._by_index.values():
            if engine.translator.settle(until):
                engine.telemetry.flush()  # an engine core gone idle sends no step that would apply them

    # -- at exit ------------------------------------------------------------------------

    def serve_stopping(self) -> None:
        """vLLM was asked to stop (SIGTERM, SIGINT) and stops its engine cores: one that ends
        without its goodbye from now on (held, or too slow for vLLM's shutdown timeout, and
        killed) was stopped, not dead: its requests end marked ``shutdown``. The engines' own
        processes are told first, each answering once it knows."""
        for worker in list(self._workers):
            worker.tell_stopping()
        self._serve_stopping = True

    def close(self) -> None:
        """Stop; the requests still in flight end marked ``shutdown``; everything flushed."""
        self._stop.set()
        self._thread.join(timeout=2 * POLL_S)
        for worker in self._workers:  # each ends its requests and flushes, all at once
            worker.tell_close()
        for worker in self._workers:
            worker.wait_closed()
        with self._lock:
            for peer in list(self._connections):
                self._read_rest(peer)
            self._settle(float("inf"))
            for telemetry in self._telemetry_by_index.values():
                telemetry.end_in_flight(SHUTDOWN)
            for handle in reversed(self._handles):  # the Prometheus endpoint's owner last
                handle.shutdown()
            self._handles.clear()
            if self._given is not None:
                self._given.shutdown()
                self._given = None
            self._causes.close()
            self._listener.close()

    def _read_rest(self, peer: socket.socket) -> None:
        """What an engine core wrote before the serve stopped. A connection that ended meanwhile
        ends as any other (:meth:`_ended`: its engine core said goodbye, or died, maybe just
        before the serve was told to stop); one still open is closed."""
        self._read(peer)
        if peer in self._connections:
            self._forget(peer)


def freeze_start_up_heap() -> None:
    """Once an engine core is up (its hello), ``vllm serve``'s start-up heap is moved out of the
    cyclic collector's reach, as vLLM's own API server does at its start-up (under the Rust frontend
    this process runs none): otherwise each full collection scans all of it (torch, vLLM: over half
    a million objects, about 0.5 s on a small machine) under the GIL, from the consumer's thread
    mostly, at up to 1024 outputs a step (docs/performance.md). Nothing if the heap was frozen
    already (by vLLM, or a consumer before)."""
    if gc.get_freeze_count() == 0:
        gc.collect()
        gc.freeze()


def _vllm_decoder() -> Callable[[bytes], Any]:
    """vLLM's own decoder of ``EngineCoreOutputs``, for the first buffer alone: a tensor or array
    whose bytes were out of band (not sent) decodes empty, as nothing translated reads them."""
    import numpy
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder

    class FirstBufferDecoder(MsgpackDecoder):
        def _decode_ndarray(self, arr: Any) -> Any:
            return numpy.empty(0) if isinstance(arr[2], int) else super()._decode_ndarray(arr)

        def _decode_tensor(self, arr: Any) -> Any:
            import torch

            return torch.empty(0) if isinstance(arr[2], int) else super()._decode_tensor(arr)

    return FirstBufferDecoder(EngineCoreOutputs).decode


def _publisher(telemetry: Any) -> Any:
    def publish(events: list, step: Any) -> None:
        if events:
            telemetry.on_events(events)
        if step is not None:
            telemetry.on_step(step)

    return publish
