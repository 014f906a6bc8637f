"""The channel that carries vLLM's engine-core stream from each engine core to the process where
the telemetry lives (:mod:`.stream_consumer`): a Unix stream socket in the serve's channel folder
(:func:`.cause_channel.folder`), length-prefixed frames.

The engine core writes from its output thread only, never blocking, each send costing O(its own
frame) whatever waits: what the socket takes goes straight from the caller's buffers
(``sendmsg``); past a full socket, the rest of the frame is copied once into a backlog of at most
:data:`MAX_PENDING` bytes, sent ahead of the next frames; a frame the backlog cannot take (one
larger than the bound, always) is lost and counted, and the count is told in a :data:`LOST` frame
once the backlog takes frames again. A consumer that is not listening (yet, or any more) loses
what is sent meanwhile, counted the same way. Nothing of the caller's buffers is kept after a send
returns (vLLM reuses its encoding buffer).

A frame: one kind byte, a 4-byte big-endian length, the payload. Kinds: :data:`HELLO` (JSON:
the engine's index and served model name), :data:`REQUESTS` (JSON: what the scheduler was given
per request), :data:`OUTPUTS` (vLLM's own msgpack encoding of ``EngineCoreOutputs``, as the
engine core sent it to its frontend: its first buffer only; the out-of-band buffers of tensors,
logprobs or pooling outputs, are not sent, the consumer reads none of them), :data:`LOST` (JSON:
frames dropped), :data:`ABORTED` (JSON: ``[time, [request ids]]``, requests the engine core
aborted: its frontend's word, which vLLM answers with no output), :data:`BYE` (the engine core
shut down cleanly).
"""

from __future__ import annotations

import collections
import json
import os
import select
import socket
import struct
import time
from typing import Any, Iterator, Optional, Sequence

SOCKET_NAME = "engine-stream"  # not *.sock: the cause channel's senders connect to every one of those
HELLO, REQUESTS, OUTPUTS, LOST, ABORTED, BYE = b"H", b"R", b"O", b"L", b"A", b"B"
MAX_PENDING = 8 << 20  # bytes kept while the consumer's socket is full; more frames are lost
MAX_FRAME = 64 << 20  # a longer frame is garbage: the connection is dropped
# Asked for; the kernel caps it at net.core.wmem_max (208 KiB by default): the backlog covers the rest.
SEND_BUFFER = 4 << 20
MAX_PARTS = 16  # buffers per sendmsg: enough for the room a read makes, few to build (far below IOV_MAX)
_HEADER = struct.Struct(">cI")


def frame(kind: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


def json_frame(kind: bytes, value: Any) -> bytes:
    return frame(kind, json.dumps(value, separators=(",", ":")).encode())


def outputs_parts(buffers: Sequence[Any]) -> tuple[bytes, Any]:
    """The frame of one output message vLLM encoded into ``buffers``: its header and vLLM's first
    buffer, not copied (:meth:`Sender.send` takes both)."""
    first = buffers[0]
    return _HEADER.pack(OUTPUTS, memoryview(first).nbytes), first


def outputs_frame(buffers: Sequence[Any]) -> bytes:
    """The same frame as one bytes (to build streams with)."""
    header, first = outputs_parts(buffers)
    return header + bytes(first)


class Sender:
    """The engine core's end (one thread at a time)."""

    def __init__(self, folder: str) -> None:
        self.address = os.path.join(folder, SOCKET_NAME)
        self._peer: Optional[socket.socket] = None
        self._pending: collections.deque[bytes] = collections.deque()  # frames, or their rests, in order
        self._offset = 0  # bytes of the first pending item already sent
        self.pending_bytes = 0  # what the backlog holds, at most MAX_PENDING
        self.copied = 0  # bytes ever copied into the backlog (each frame's at most once)
        self.lost = 0  # frames dropped and not yet told
        self.lost_total = 0

    @property
    def connected(self) -> bool:
        return self._peer is not None

    def send(self, *parts: Any) -> bool:
        """Send whole frames, ``parts`` (bytes-like) in order, or lose them (counted); never
        blocks. True when they were sent or kept in the backlog."""
        peer = self._peer or self._connect()
        if peer is not None and self._pending:
            peer = self._drain(peer)
        if peer is None:
            return self._lose()
        if self.lost:
            parts = (json_frame(LOST, self.lost), *parts)
        size = sum(memoryview(part).nbytes for part in parts)
        if self.pending_bytes + size > MAX_PENDING:
            return self._lose()
        sent = 0
        if not self._pending:  # nothing waits ahead: straight from the caller's buffers
            sent = self._sendmsg(peer, parts)
            if sent < 0:  # counted, with the losses it was to tell
                return False
        self.lost = 0
        if sent < size:
            self._keep(parts, sent)
        return True

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the backlog to be sent; True when it was (False when
        the consumer went away meanwhile: the backlog is lost with it, counted)."""
        deadline = time.monotonic() + timeout
        while self._pending and self._peer is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                select.select([], [self._peer], [], left)
            except (OSError, ValueError):
                break
            self._drain(self._peer)
        return not self._pending and self._peer is not None

    def _lose(self) -> bool:
        self.lost += 1
        self.lost_total += 1
        return False

    def _keep(self, parts: Sequence[Any], sent: int) -> None:
        """The rest of ``parts`` after their first ``sent`` bytes, copied once into the backlog."""
        views = []
        for part in parts:
            view = memoryview(part).cast("B")
            if sent >= view.nbytes:
                sent -= view.nbytes
                continue
            views.append(view[sent:] if sent else view)
            sent = 0
        rest = b"".join(views)
        self._pending.append(rest)
        self.pending_bytes += len(rest)
        self.copied += len(rest)

    def _drain(self, peer: socket.socket) -> Optional[socket.socket]:
        """Send what the backlog holds, as far as the socket takes it; the peer, None if it went."""
        pending = self._pending
        while pending:
            views = [memoryview(pending[0])[self._offset :]]
            views += [memoryview(pending[i]) for i in range(1, min(len(pending), MAX_PARTS))]
            sent = self._sendmsg(peer, views)
            if sent < 0:
                return None
            self.pending_bytes -= sent
            wanted = sum(v.nbytes for v in views)
            done = self._offset + sent
            while pending and done >= len(pending[0]):
                done -= len(pending.popleft())
            self._offset = done
            if sent < wanted:  # the socket is full
                break
        return peer

    def _sendmsg(self, peer: socket.socket, parts: Sequence[Any]) -> int:
        """Bytes the socket took of ``parts`` (0 when full); -1 when the consumer went away."""
        try:
            return peer.sendmsg(parts)
        except BlockingIOError:
            return 0
        except OSError:  # the consumer went away: what was pending is lost with it
            self.close()
            self._lose()
            return -1

    def _connect(self) -> Optional[socket.socket]:
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            peer.setblocking(False)
            peer.connect(self.address)
        except OSError:  # no consumer listening (yet, or any more)
            peer.close()
            return None
        self._peer = peer
        return peer

    def close(self) -> None:
        if self._peer is not None:
            self._peer.close()
            self._peer = None
        self._pending.clear()
        self._offset = self.pending_bytes = 0


class Connection:
    """The consumer's end of one engine core's connection: frames as they complete."""

    def __init__(self, peer: socket.socket) -> None:
        self.peer = peer
        self._data = bytearray()

    def frames(self, chunk: bytes) -> Iterator[tuple[bytes, bytes]]:
        """The frames ``chunk`` completes; raises ValueError on a frame too long."""
        self._data += chunk
        while len(self._data) >= _HEADER.size:
            kind, size = _HEADER.unpack_from(self._data)
            if size > MAX_FRAME:
                raise ValueError(f"a frame of {size} bytes")
            end = _HEADER.size + size
            if len(self._data) < end:
                return
            payload = bytes(self._data[_HEADER.size : end])
            del self._data[:end]
            yield kind, payload
