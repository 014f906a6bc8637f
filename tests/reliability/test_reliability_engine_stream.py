"""The engine-core stream channel (vLLM's Rust frontend): an engine core never blocks on it nor
raises; what it cannot hand over is counted and told; a consumer reads frames whole however the
bytes come, and garbage costs it only that connection. Real Unix sockets, no vLLM needed."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
from typing import Iterator

import pytest

from otel_llm.integrations.vllm.channels import stream_channel
from otel_llm.integrations.vllm.channels.stream_channel import LOST, OUTPUTS, Connection, Sender


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
    assert received[-1] == (OUTPUTS, b"y" * 1000)
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
    assert frames == [(OUTPUTS, b"a" * 70_000), (LOST, b"4")]  # an output's first buffer only
    with pytest.raises(ValueError, match="a frame of"):
        list(Connection(right).frames(b"O\xff\xff\xff\xff"))
    left.close()
    right.close()


def _stalled(folder: str, monkeypatch: pytest.MonkeyPatch, pending: int) -> tuple[socket.socket, Sender]:
    """A consumer that accepts and does not read yet, behind a small socket buffer (set
    explicitly: the kernel caps what is asked at net.core.wmem_max, 208 KiB by default) and a
    backlog bound of ``pending`` bytes; the sender connected to it."""
    monkeypatch.setattr(stream_channel, "SEND_BUFFER", 4096)
    monkeypatch.setattr(stream_channel, "MAX_PENDING", pending)
    listener = _listen(folder)
    sender = Sender(folder)
    sender.send(stream_channel.frame(stream_channel.HELLO, b"{}"))
    peer, _ = listener.accept()
    listener.close()
    return peer, sender


def test_a_send_copies_at_most_its_own_frame_whatever_waits(folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled consumer: the backlog fills to its bound, then frames are lost. Each send copies
    its own frame at most (the backlog ahead of it is not copied again), the backlog never holds
    more than the bound, and once the consumer reads, every frame kept comes in order after the
    count of those lost."""
    peer, sender = _stalled(folder, monkeypatch, pending=64 << 10)
    frames = [bytearray(stream_channel.frame(OUTPUTS, bytes([i % 251]) * 1000)) for i in range(300)]
    copied = []
    for data in frames:
        before = sender.copied
        sender.send(data)
        copied.append(sender.copied - before)
        assert sender.pending_bytes <= 64 << 10
        data[:] = b""  # vLLM reuses its buffer at once: nothing of it may still be held
    assert max(copied) <= 1005 and sum(copied) == sender.copied
    assert sender.lost_total > 0 and sender.pending_bytes > (64 << 10) - 1005
    kept = len(frames) - sender.lost_total
    received: list[tuple[bytes, bytes]] = []
    reader = threading.Thread(target=lambda: received.extend(_read_until(peer, kept + 3)[1:]))  # after the hello
    reader.start()
    sender.send(stream_channel.frame(OUTPUTS, b"last"))
    assert sender.flush(30)
    reader.join(30)
    outputs = [payload for kind, payload in received if kind == OUTPUTS]
    assert len(outputs) == kept + 1 and [p[0] for p in outputs[:kept]] == [i % 251 for i in range(kept)]
    assert [json.loads(payload) for kind, payload in received if kind == LOST] == [sender.lost_total]
    assert received[-1] == (OUTPUTS, b"last") and sender.pending_bytes == 0
    peer.close()
    sender.close()


def test_a_frame_larger_than_the_bound_is_lost_and_counted_never_kept(folder: str) -> None:
    listener = _listen(folder)
    sender = Sender(folder)
    sender.send(stream_channel.frame(stream_channel.HELLO, b"{}"))
    peer, _ = listener.accept()
    header, first = stream_channel.outputs_parts([bytearray(stream_channel.MAX_PENDING), b"aux"])
    assert not sender.send(header, first)
    assert (sender.lost_total, sender.copied, sender.pending_bytes) == (1, 0, 0)
    assert sender.send(*stream_channel.outputs_parts([b"next", b"aux"]))
    connection = Connection(peer)
    assert _read_all(peer, connection) == [(stream_channel.HELLO, b"{}"), (LOST, b"1"), (OUTPUTS, b"next")]
    peer.close()
    listener.close()
    sender.close()


def test_flush_waits_for_the_backlog_or_gives_up_at_its_timeout(folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    peer, sender = _stalled(folder, monkeypatch, pending=1 << 20)
    for i in range(40):
        sender.send(stream_channel.frame(OUTPUTS, bytes([i]) * 2000))
    assert sender.pending_bytes > 0 and sender.lost_total == 0
    assert not sender.flush(0.01)  # nobody reads: it gives up
    received: list[tuple[bytes, bytes]] = []
    reader = threading.Thread(target=lambda: received.extend(_read_until(peer, 41)))
    reader.start()
    assert sender.flush(30)
    reader.join(30)
    assert sender.pending_bytes == 0
    assert [payload[0] for kind, payload in received if kind == OUTPUTS] == list(range(40))
    peer.close()
    sender.close()


def test_flush_says_so_when_the_consumer_goes_away_with_the_backlog(
    folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    peer, sender = _stalled(folder, monkeypatch, pending=1 << 20)
    for i in range(40):
        sender.send(stream_channel.frame(OUTPUTS, bytes([i]) * 2000))
    assert sender.pending_bytes > 0 and sender.lost_total == 0
    peer.close()  # the consumer's end goes: the socket turns writable, the send fails
    assert not sender.flush(30)
    assert (sender.connected, sender.pending_bytes, sender.lost_total) == (False, 0, 1)


def _read_until(peer: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """``count`` frames, read blocking."""
    peer.setblocking(True)
    connection = Connection(peer)
    frames: list[tuple[bytes, bytes]] = []
    while len(frames) < count:
        frames += list(connection.frames(peer.recv(1 << 16)))
    return frames
