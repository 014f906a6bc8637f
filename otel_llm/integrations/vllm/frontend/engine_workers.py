"""In ``vllm serve``'s process, under the Rust frontend: with several local engines, each engine
after the first recorded in a process of its own (:mod:`.engine_worker`), so that the recording's
CPU grows with the engines instead of one thread serving them all (docs/performance.md).

Where vLLM launches its local engine cores (``CoreEngineProcManager``, which knows their count and
first index), each worker's socket is bound and its process started before any engine core
starts: an engine core finds its own socket (:func:`.stream_channel.engine_socket`) at its first
connection. The first engine stays on the serve's own consumer thread, which owns the one
Prometheus endpoint: each worker's families are asked for on each scrape (at most
:data:`COLLECT_TIMEOUT_S`; one that does not answer contributes nothing, said once). A worker that
ends early is said once and its socket removed: its engine core's next connection goes to the
serve's consumer, which takes the engine over (what was sent meanwhile counted lost). Where the
launch point is not found, or a worker cannot start, its engines are recorded on the serve's
thread as with one engine, said once; never an exception into vLLM. When the serve is asked to
stop (:mod:`.serve_stop`), each worker is told before vLLM stops the engine cores, as the serve's
own consumer is.
"""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Iterable, Iterator, Optional

from otel_llm.export.handle import SHUTDOWN_TIMEOUT_MILLIS
from otel_llm.integrations.vllm.channels import stream_channel
from otel_llm.integrations.vllm.frontend import engine_worker

_log = logging.getLogger("otel_llm.integrations.vllm")

COLLECT_TIMEOUT_S = 2.0  # a scrape waits this long at most for a worker's families
# A worker's end waits for its flush: two export stages, each bounded by the handle's timeout.
CLOSE_WAIT_S = 2 * SHUTDOWN_TIMEOUT_MILLIS / 1000 + 5

_installed: list[tuple[type, str, Any]] = []  # (class, name, vLLM's own): what install replaced


class EngineWorker:
    """One engine's recording process, and the serve's end of it: a Prometheus collector (for the
    serve's registry), :meth:`check` (from the consumer's thread), :meth:`tell_close` then
    :meth:`wait_closed` (at the serve's exit)."""

    def __init__(self, folder: str, engine: int, instance_id: str) -> None:
        self.engine = engine
        self.path = stream_channel.engine_socket(folder, engine)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        ours, theirs = socket.socketpair()
        try:
            listener.bind(self.path)
            listener.listen(64)
            fds = (listener.fileno(), theirs.fileno())
            self.process = subprocess.Popen(
                [sys.executable, "-m", engine_worker.__name__, folder, *map(str, fds), str(engine), instance_id],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a signal to the serve's group is the serve's to handle
            )
        except BaseException:
            ours.close()
            _unlink(self.path)
            raise
        finally:
            listener.close()  # the worker's now, not the engine cores' the serve forks next
            theirs.close()
        self._control = ours
        self._lock = threading.Lock()
        self._seq = 0
        self._replies = b""
        self._gone = False
        self._slow_said = False

    # -- the serve's Prometheus registry -------------------------------------------------

    def serve_on(self, registry: Any) -> None:
        registry.register(self)

    def collect(self) -> Iterator[Any]:
        families = self._ask(COLLECT_TIMEOUT_S)
        if families is None:
            if not self._gone and not self._slow_said:
                self._slow_said = True
                _log.warning(
                    "otel-llm: engine %d's recording process did not answer a scrape within %.0f s: its series are "
                    "left out of that scrape, and of any other it does not answer in time (said once)",
                    self.engine,
                    COLLECT_TIMEOUT_S,
                )
            return iter(())
        return iter(families)

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the worker answers within ``timeout_s`` (it answers once it is ready to decode)."""
        return self._ask(timeout_s) is not None

    def tell_stopping(self) -> None:
        """The serve was asked to stop: the worker's consumer told, and its answer waited for (at
        most :data:`COLLECT_TIMEOUT_S`), before vLLM stops any engine core."""
        self._ask(COLLECT_TIMEOUT_S, engine_worker.STOPPING)

    def _ask(self, timeout_s: float, kind: bytes = engine_worker.COLLECT) -> Optional[Any]:
        """The worker's answer (its families, for COLLECT); None when it did not answer in time,
        or is gone."""
        with self._lock:
            if self._gone:
                return None
            self._seq += 1
            try:
                self._control.sendall(engine_worker.REQUEST.pack(kind, self._seq))
                return self._reply(self._seq, time.monotonic() + timeout_s)
            except (OSError, EOFError, pickle.UnpicklingError) as exc:
                self._ended(f"its channel failed: {exc!r}")
                return None

    def _reply(self, seq: int, deadline: float) -> Any:
        """The families answering request ``seq`` (older answers, to scrapes that gave up, are
        skipped); None past the deadline."""
        while True:
            while len(self._replies) >= engine_worker.REPLY.size:
                number, size = engine_worker.REPLY.unpack_from(self._replies)
                end = engine_worker.REPLY.size + size
                if len(self._replies) < end:
                    break
                payload, self._replies = self._replies[engine_worker.REPLY.size : end], self._replies[end:]
                if number == seq:
                    return pickle.loads(payload)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._control], [], [], left)[0]:
                return None
            chunk = self._control.recv(1 << 20)
            if not chunk:
                raise EOFError("the worker closed it")
            self._replies += chunk

    # -- its life ------------------------------------------------------------------------

    def check(self) -> None:
        """Whether the worker ended before the serve told it to."""
        code = self.process.poll()
        if code is not None and not self._gone:
            with self._lock:
                self._ended(f"exit code {code}")

    def _ended(self, why: str) -> None:
        if self._gone:
            return
        self._gone = True
        _unlink(self.path)  # its engine core's next connection goes to the serve's consumer
        self._control.close()
        _log.warning(
            "otel-llm: engine %d's recording process (pid %d) ended (%s): its engine core hands its stream over "
            "to this process from its next connection, what it sent meanwhile counted lost (said once)",
            self.engine,
            self.process.pid,
            why,
        )

    def tell_close(self) -> None:
        """Tell the worker to end its requests in flight, flush and exit (it also ends on the
        end of this channel: closed here at once)."""
        with self._lock:
            if not self._gone:
                self._gone = True
                try:
                    self._control.sendall(engine_worker.REQUEST.pack(engine_worker.CLOSE, 0))
                except OSError:
                    pass
                self._control.close()

    def wait_closed(self) -> None:
        try:
            self.process.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            _log.warning(
                "otel-llm: engine %d's recording process did not end in %.0f s: killed", self.engine, CLOSE_WAIT_S
            )
            self.process.kill()
            self.process.wait()
        _unlink(self.path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def start_workers(consumer: Any, engines: Iterable[int]) -> None:
    """A process of its own for each of ``engines``, its families served by ``consumer``'s
    endpoint; an engine whose worker cannot start is recorded by ``consumer`` (said once)."""
    from otel_llm.config.settings import TelemetryConfig
    from otel_llm.export import resource as resources

    instance_id = str(resources.resource(TelemetryConfig.from_env()).attributes["service.instance.id"])
    for engine in engines:
        try:
            worker = EngineWorker(consumer.folder, engine, instance_id)
        except Exception as exc:  # noqa: BLE001 - never into vLLM: this process records that engine
            _log.warning("otel-llm: engine %d is recorded in this process: its own could not start (%r)", engine, exc)
            continue
        consumer.add_worker(worker)
        _log.info("otel-llm: engine %d's stream is recorded in its own process (pid %d)", engine, worker.process.pid)


def install(consumer: Any) -> bool:
    """Start the workers where vLLM launches its local engine cores; False, said once, where that
    point is not found (every engine recorded on ``consumer``'s thread)."""
    try:
        from vllm.v1.engine.utils import CoreEngineProcManager

        launch = CoreEngineProcManager.__init__
        signature = inspect.signature(launch)
        missing = {"local_engine_count", "start_index"} - set(signature.parameters)
        if missing:
            raise LookupError(f"it takes no {', '.join(sorted(missing))}")
    except Exception as exc:  # noqa: BLE001 - any vLLM that differs: one thread records every engine
        _log.warning(
            "otel-llm: vLLM's CoreEngineProcManager(local_engine_count, start_index, ...) not usable (%s): every "
            "engine's stream is recorded in this process, on one thread",
            exc,
        )
        return False

    def launch_engines(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            arguments = signature.bind(self, *args, **kwargs).arguments
            count, start = int(arguments["local_engine_count"]), int(arguments["start_index"])
            if count > 1:
                start_workers(consumer, range(start + 1, start + count))
        except Exception as exc:  # noqa: BLE001 - never into vLLM's launch
            _log.warning("otel-llm: starting the engines' recording processes failed (%r): this one records them", exc)
        launch(self, *args, **kwargs)

    _installed.append((CoreEngineProcManager, "__init__", launch))
    CoreEngineProcManager.__init__ = launch_engines
    return True


def uninstall() -> None:
    """Restore vLLM's methods (tests)."""
    for owner, name, original in reversed(_installed):
        setattr(owner, name, original)
    _installed.clear()
