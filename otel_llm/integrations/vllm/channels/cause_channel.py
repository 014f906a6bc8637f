"""The channel that carries the cause of each preemption from vLLM's engine-core processes, where
the scheduler preempts, to its API servers, where the request spans are made.

vLLM's own output carries no cause (``EngineCoreEvent`` is a type and a timestamp), so the
engine core writes one line per preemption on a Unix stream socket that each API server listens
on, in a folder of the serve's (:data:`ENV`, made by the first process that loads the plugin and
inherited by the processes it starts, 0700). A line is written inside ``schedule()``, before the
step's outputs leave the engine core: once an API server has those outputs, the line is in its
socket's queue, so draining it (non-blocking) before the outputs' finished requests are
translated finds every cause they need. Nothing is written or read while nobody is preempted;
the engine core never blocks on it (it writes as it writes the engine-core stream, through a
:class:`~.socket_writer.SocketWriter` per API server: past a full socket it keeps up to
:data:`MAX_PENDING` bytes, sent with its next line; beyond, it drops records and tells their
count), and an API server never waits for it.

A line is JSON: ``["p", victim, ordinal, kind, [cause, ...]]`` (vLLM's internal request ids; the
victim's preemption ordinal, counting from 1) or ``["lost", n]``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import shutil
import socket
import tempfile
import time
from typing import Iterator, NamedTuple, Optional

from otel_llm.integrations.vllm.channels.socket_writer import SocketWriter

_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs

ENV = "OTEL_LLM_VLLM_CAUSE_CHANNEL"  # set by the plugin itself for the processes a serve starts
SUFFIX = ".sock"
SEND_BUFFER = 1 << 20  # bytes a receiver may fall behind before lines wait in the sender
MAX_PENDING = 1 << 20  # bytes kept per receiver while its socket is full; more are lost (counted)
MAX_LINE = 1 << 16  # a longer line is garbage: dropped with what is buffered
RESCAN_S = 5.0  # a sender looks for new receivers at most this often, only when it sends
OWNER = "owner"  # in the folder: the pid of the process that made it


class CauseRecord(NamedTuple):
    victim: str  # vLLM's internal request id
    ordinal: int  # the victim's preemption, from 1
    kind: str  # otel_llm.events.CAUSE_*
    causes: tuple[str, ...]  # internal request ids


def folder(create: bool = False) -> Optional[str]:
    """The serve's channel folder (None when there is none and ``create`` is false)."""
    path = os.environ.get(ENV)
    if path or not create:
        return path or None
    path = tempfile.mkdtemp(prefix="otel-llm-vllm-causes-")
    os.environ[ENV] = path  # the engine cores and API servers started from here inherit it
    owner = os.getpid()
    with open(os.path.join(path, OWNER), "w") as file:
        file.write(str(owner))

    def remove() -> None:
        if os.getpid() == owner:  # not in a forked child
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    return path


def maker_alive(path: str) -> bool:
    """The process that made the folder ``path`` runs: the folder is the serve's, not one left in
    an environment by a serve that has ended."""
    try:
        with open(os.path.join(path, OWNER)) as file:
            pid = int(file.read())
        os.kill(pid, 0)
    except PermissionError:  # it runs, as another user
        return True
    except (OSError, ValueError):
        return False
    return True


def encode(record: CauseRecord) -> bytes:
    return (json.dumps(["p", record.victim, record.ordinal, record.kind, list(record.causes)]) + "\n").encode()


class Sender:
    """The engine core's end: a line to every API server of the serve, each through a
    :class:`~.socket_writer.SocketWriter` of its own (its losses told in a ``["lost", n]`` line)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._writers: dict[str, SocketWriter] = {}  # per receiver's socket name
        self._scanned = -RESCAN_S

    def send(self, record: CauseRecord) -> None:
        line = encode(record)
        now = time.monotonic()
        if now - self._scanned >= RESCAN_S:
            self._scanned = now
            self._connect_new()
        for name, writer in list(self._writers.items()):
            writer.send(line)
            if not writer.connected:  # that API server is gone: forgotten (a new one is found by name)
                del self._writers[name]

    def _connect_new(self) -> None:
        try:
            names = [n for n in os.listdir(self.path) if n.endswith(SUFFIX) and n not in self._writers]
        except OSError:
            return
        for name in names:
            writer = SocketWriter(
                os.path.join(self.path, name),
                send_buffer=SEND_BUFFER,
                max_pending=MAX_PENDING,
                lost_message=_lost_line,
            )
            if writer.connect():  # else not listening (any more), or its backlog is full: the next scan
                self._writers[name] = writer


def _lost_line(count: int) -> bytes:
    return (json.dumps(["lost", count]) + "\n").encode()


class Receiver:
    """An API server's end: listens in the serve's folder; :meth:`drain` takes what has come."""

    def __init__(self, path: str) -> None:
        self.address = os.path.join(path, f"{os.getpid()}{SUFFIX}")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(16)
        self._listener.setblocking(False)
        self._peers: dict[socket.socket, bytes] = {}  # connection -> a line received in part
        self.lost = 0  # records the senders dropped, as they told
        self.garbage = 0  # lines that were not records
        owner = os.getpid()

        def close_at_exit() -> None:
            if os.getpid() == owner:  # not in a forked child
                self.close()

        self._at_exit = close_at_exit
        atexit.register(close_at_exit)

    def drain(self) -> list[CauseRecord]:
        """Every record received so far, in order per engine core; never waits."""
        records: list[CauseRecord] = []
        try:
            ready, _, _ = select.select([self._listener, *self._peers], [], [], 0)
        except (OSError, ValueError):  # closed
            return records
        # A connection accepted now holds what its engine core wrote before its first output.
        fresh = self._accept() if self._listener in ready else []
        for peer in [*(r for r in ready if r is not self._listener), *fresh]:
            records.extend(self._read(peer))
        return records

    def _accept(self) -> list[socket.socket]:
        accepted: list[socket.socket] = []
        while True:
            try:
                peer, _ = self._listener.accept()
            except OSError:  # none left (BlockingIOError), or closed
                return accepted
            peer.setblocking(False)
            self._peers[peer] = b""
            accepted.append(peer)

    def _read(self, peer: socket.socket) -> Iterator[CauseRecord]:
        data, closed = self._peers[peer], False
        while True:
            try:
                chunk = peer.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:  # the engine core closed it (stopped, or died: a line cut short is dropped)
                closed = True
                break
            data += chunk
        *lines, rest = data.split(b"\n")
        if closed:
            del self._peers[peer]
            peer.close()
        elif len(rest) > MAX_LINE:
            self.garbage += 1
            self._peers[peer] = b""
        else:
            self._peers[peer] = rest
        for line in lines:
            record = self._parse(line)
            if record is not None:
                yield record

    def _parse(self, line: bytes) -> Optional[CauseRecord]:
        try:
            item = json.loads(line)
            if item[0] == "lost" and type(item[1]) is int:
                self.lost += item[1]
                return None
            _, victim, ordinal, kind, causes = item
            if (
                type(victim) is str
                and type(ordinal) is int
                and type(kind) is str
                and all(type(c) is str for c in causes)
            ):
                return CauseRecord(victim, ordinal, kind, tuple(causes))
        except (ValueError, TypeError, IndexError):
            pass
        self.garbage += 1
        return None

    def close(self) -> None:
        atexit.unregister(self._at_exit)  # closed: nothing left for the exit, nor kept alive for it
        for peer in self._peers:
            peer.close()
        self._peers.clear()
        self._listener.close()
        try:
            os.unlink(self.address)
        except OSError:
            pass
