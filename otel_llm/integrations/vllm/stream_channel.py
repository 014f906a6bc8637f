"""The channel that carries vLLM's engine-core stream from each engine core to the process where
the telemetry lives (:mod:`.stream_consumer`): a Unix stream socket in the serve's channel folder
(:func:`.cause_channel.folder`), length-prefixed frames.

The engine core writes from its output thread only, never blocking: past a full socket it keeps
up to :data:`MAX_PENDING` bytes, sent with the next frame; beyond, a frame is lost and counted,
and the count is told in a :data:`LOST` frame once the socket takes data again. A consumer that is
not listening (yet, or any more) loses what is sent meanwhile, counted the same way.

A frame: one kind byte, a 4-byte big-endian length, the payload. Kinds: :data:`HELLO` (JSON:
the engine's index and served model name), :data:`REQUESTS` (JSON: what the scheduler was given
per request), :data:`OUTPUTS` (vLLM's own msgpack encoding of ``EngineCoreOutputs``, as the
engine core sent it to its frontend: a count of buffers, each length-prefixed), :data:`LOST`
(JSON: frames dropped), :data:`ABORTED` (JSON: ``[time, [request ids]]``, requests the engine core
aborted: its frontend's word, which vLLM answers with no output), :data:`BYE` (the engine core
shut down cleanly).
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any, Iterator, Optional, Sequence

SOCKET_NAME = "engine-stream"  # not *.sock: the cause channel's senders connect to every one of those
HELLO, REQUESTS, OUTPUTS, LOST, ABORTED, BYE = b"H", b"R", b"O", b"L", b"A", b"B"
MAX_PENDING = 8 << 20  # bytes kept while the consumer's socket is full; more frames are lost
MAX_FRAME = 64 << 20  # a longer frame is garbage: the connection is dropped
SEND_BUFFER = 4 << 20
_HEADER = struct.Struct(">cI")
_COUNT = struct.Struct(">I")


def frame(kind: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


def json_frame(kind: bytes, value: Any) -> bytes:
    return frame(kind, json.dumps(value, separators=(",", ":")).encode())


def outputs_frame(buffers: Sequence[Any]) -> bytes:
    """vLLM's encoded buffers (bytes-like), as one frame."""
    parts = [_COUNT.pack(len(buffers))]
    for buffer in buffers:
        view = memoryview(buffer)
        parts += (_COUNT.pack(view.nbytes), view.tobytes())
    return frame(OUTPUTS, b"".join(parts))


def split_outputs(payload: bytes) -> list[memoryview]:
    view = memoryview(payload)
    (count,), offset = _COUNT.unpack_from(view), _COUNT.size
    buffers = []
    for _ in range(count):
        (size,) = _COUNT.unpack_from(view, offset)
        offset += _COUNT.size
        buffers.append(view[offset : offset + size])
        offset += size
    return buffers


class Sender:
    """The engine core's end (its output thread only)."""

    def __init__(self, folder: str) -> None:
        self.address = os.path.join(folder, SOCKET_NAME)
        self._peer: Optional[socket.socket] = None
        self._pending = b""
        self.lost = 0  # frames dropped and not yet told
        self.lost_total = 0

    @property
    def connected(self) -> bool:
        return self._peer is not None

    def send(self, data: bytes) -> None:
        """Send one or more whole frames, or lose them (counted); never blocks."""
        peer = self._peer or self._connect()
        if peer is not None and self._pending:  # what waited goes first, as far as the socket takes it
            self._pending = self._write(peer, self._pending)
            peer = self._peer
        if peer is None:
            self._lose()
            return
        if self.lost:
            data = json_frame(LOST, self.lost) + data
        if len(self._pending) + len(data) > MAX_PENDING:
            self._lose()
            return
        self.lost = 0
        self._pending = self._write(peer, self._pending + data)

    def _lose(self) -> None:
        self.lost += 1
        self.lost_total += 1

    def _connect(self) -> Optional[socket.socket]:
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            peer.setblocking(False)
            peer.connect(self.address)
        except OSError:  # no consumer listening (yet, or any more)
            peer.close()
            return None
        self._peer, self._pending = peer, b""
        return peer

    def _write(self, peer: socket.socket, data: bytes) -> bytes:
        try:
            sent = peer.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:  # the consumer went away: what was pending is lost with it
            peer.close()
            self._peer = None
            self._lose()
            return b""
        return data[sent:]

    def close(self) -> None:
        if self._peer is not None:
            self._peer.close()
            self._peer = None


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
