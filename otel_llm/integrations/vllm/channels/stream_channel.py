"""The channel that carries vLLM's engine-core stream from each engine core to the process where
the telemetry lives (:mod:`.stream_consumer`): a Unix stream socket in the serve's channel folder
(:func:`.cause_channel.folder`), length-prefixed frames.

The engine core writes from its output thread only, through a
:class:`~.socket_writer.SocketWriter`: never blocking, each send costing O(its own frame) whatever
waits, a backlog of at most :data:`MAX_PENDING` bytes, a frame it cannot take lost and counted,
the count told in a :data:`LOST` frame. A consumer that is not listening (yet, or any more) loses
what is sent meanwhile, counted the same way.

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

import json
import os
import socket
import struct
from typing import Any, Iterator, Sequence

from otel_llm.integrations.vllm.channels.socket_writer import SocketWriter

SOCKET_NAME = "engine-stream"  # not *.sock: the cause channel's senders connect to every one of those
HELLO, REQUESTS, OUTPUTS, LOST, ABORTED, BYE = b"H", b"R", b"O", b"L", b"A", b"B"
MAX_PENDING = 8 << 20  # bytes kept while the consumer's socket is full; more frames are lost
MAX_FRAME = 64 << 20  # a longer frame is garbage: the connection is dropped
# Asked for; the kernel caps it at net.core.wmem_max (208 KiB by default): the backlog covers the rest.
SEND_BUFFER = 4 << 20
_HEADER = struct.Struct(">cI")


def engine_socket(folder: str, engine: int) -> str:
    """Where engine ``engine``'s own consumer listens, when it has a process of its own (a serve
    with several local engines); else nothing is there and the engine core uses :data:`SOCKET_NAME`."""
    return os.path.join(folder, f"{SOCKET_NAME}-{engine}")


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


class Sender(SocketWriter):
    """The engine core's end (one thread at a time): whole frames, their losses told in a
    :data:`LOST` frame. Once its engine is known (:attr:`engine`), each connection goes to that
    engine's own consumer if it has one (:func:`engine_socket`), else to the serve's."""

    def __init__(self, folder: str) -> None:
        self._folder = folder
        self.engine: int | None = None
        super().__init__(
            os.path.join(folder, SOCKET_NAME),
            send_buffer=SEND_BUFFER,
            max_pending=MAX_PENDING,
            lost_message=lambda n: json_frame(LOST, n),
        )

    def _connect(self) -> socket.socket | None:
        own = engine_socket(self._folder, self.engine) if self.engine is not None else None
        # Gone once its process ended: the serve's own consumer takes the engine over.
        self.address = own if own is not None and os.path.exists(own) else os.path.join(self._folder, SOCKET_NAME)
        return super()._connect()


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
