"""The engine-core stream channel (vLLM's Rust frontend): an engine core never blocks on it nor
raises; what it cannot hand over is counted and told; a consumer reads frames whole however the
bytes come, and garbage costs it only that connection. Real Unix sockets, no vLLM needed."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from typing import Iterator

import pytest

from otel_llm.integrations.vllm import stream_channel
from otel_llm.integrations.vllm.stream_channel import LOST, OUTPUTS, Connection, Sender


@pytest.fixture
def folder() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="otel-llm-stream-")  # short: a Unix socket's path is bounded
    yield path


def _listen(folder: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(folder, stream_channel.SOCKET_NAME))
    listener.listen(4)
    return listener


def _read_all(peer: socket.socket, connection: Connection) -> list[tuple[bytes, bytes]]:
    peer.setblocking(False)
    frames: list[tuple[bytes, bytes]] = []
    while True:
        try:
            chunk = peer.recv(1 << 20)
        except BlockingIOError:
            return frames
        if not chunk:
            return frames
        frames += list(connection.frames(chunk))


def test_no_consumer_costs_the_engine_core_nothing_but_the_count(folder: str) -> None:
    sender = Sender(folder)
    for _ in range(3):
        sender.send(stream_channel.outputs_frame([b"x" * 10]))
    assert sender.lost_total == 3 and not sender.connected


def test_a_consumer_that_does_not_read_gets_the_count_once_it_does(
    folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_channel, "SEND_BUFFER", 4096)
    monkeypatch.setattr(stream_channel, "MAX_PENDING", 16384)
    listener = _listen(folder)
    sender = Sender(folder)
    frame = stream_channel.outputs_frame([b"y" * 1000])
    sent = 2_000  # far more than the socket and the bound hold: a fixed amount of work, no wait
    for _ in range(sent):
        sender.send(frame)
    peer, _ = listener.accept()
    connection = Connection(peer)
    received = _read_all(peer, connection)
    assert sender.lost_total > 0 and 0 < len(received) < sent
    for _ in range(3):  # drained: what waited goes, after a frame telling what was lost
        sender.send(frame)
        received += _read_all(peer, connection)
    told = sum(json.loads(payload) for kind, payload in received if kind == LOST)
    outputs = sum(kind == OUTPUTS for kind, _ in received)
    assert told == sender.lost_total and outputs + told == sent + 3
    assert [bytes(b) for b in stream_channel.split_outputs(received[-1][1])] == [b"y" * 1000]
    peer.close()
    listener.close()


def test_a_consumer_gone_costs_the_engine_core_no_exception(folder: str) -> None:
    listener = _listen(folder)
    sender = Sender(folder)
    sender.send(stream_channel.frame(stream_channel.BYE, b""))
    peer, _ = listener.accept()
    peer.close()
    listener.close()
    for _ in range(3):
        sender.send(stream_channel.outputs_frame([b"z"]))
    assert not sender.connected and sender.lost_total >= 1


def test_frames_are_read_whole_however_the_bytes_come_and_garbage_is_refused() -> None:
    left, right = socket.socketpair()
    data = stream_channel.outputs_frame([b"a" * 70_000, b"b"]) + stream_channel.json_frame(LOST, 4)
    connection = Connection(right)
    frames = [f for i in range(0, len(data), 997) for f in connection.frames(data[i : i + 997])]
    assert [kind for kind, _ in frames] == [OUTPUTS, LOST]
    assert [bytes(b) for b in stream_channel.split_outputs(frames[0][1])] == [b"a" * 70_000, b"b"]
    with pytest.raises(ValueError, match="a frame of"):
        list(Connection(right).frames(b"O\xff\xff\xff\xff"))
    left.close()
    right.close()
