"""The channel that carries preemption causes from vLLM's engine cores to its API servers
(otel_llm.integrations.vllm.channels.cause_channel), on real Unix sockets: every record arrives in order,
nothing blocks the engine core whatever the API server does, what is lost is counted, and an
engine core that dies mid-line or writes garbage breaks nothing."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Iterator

import pytest

from otel_llm.integrations.vllm.channels import cause_channel
from otel_llm.integrations.vllm.channels.cause_channel import CauseRecord, Receiver, Sender


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[str]:
    yield str(tmp_path)


def _record(i: int, victim: str = "v") -> CauseRecord:
    return CauseRecord(f"{victim}-{i}", i + 1, "request", (f"cause-{i}", "ünïcode-id"))


def test_every_record_arrives_in_order_from_each_engine_core(folder: str) -> None:
    receiver = Receiver(folder)
    first, second = Sender(folder), Sender(folder)
    for i in range(500):
        first.send(_record(i, "a"))
        second.send(_record(i, "b"))
    records = receiver.drain()
    assert [r for r in records if r.victim.startswith("a")] == [_record(i, "a") for i in range(500)]
    assert [r for r in records if r.victim.startswith("b")] == [_record(i, "b") for i in range(500)]
    assert receiver.drain() == [] and receiver.lost == 0 and receiver.garbage == 0
    receiver.close()
    assert not os.path.exists(receiver.address)


def test_a_closed_receiver_is_not_kept_for_the_exit(folder: str) -> None:
    """A receiver closes itself at the process's exit; closed before, it is let go (a process
    that makes one receiver after another does not keep each until it exits)."""
    import gc
    import weakref

    receiver = Receiver(folder)
    ref = weakref.ref(receiver)
    receiver.close()
    del receiver
    gc.collect()
    assert ref() is None


def test_a_sender_never_blocks_and_what_it_drops_is_counted(folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An API server that does not drain: the engine core goes on (its socket full, then its own
    buffer), drops past the bound, and tells the count with its next line after the drain."""
    monkeypatch.setattr(cause_channel, "SEND_BUFFER", 4096)
    monkeypatch.setattr(cause_channel, "MAX_PENDING", 8192)
    receiver = Receiver(folder)
    sender = Sender(folder)
    sent = 20_000  # far more than the socket and the bound hold: a fixed amount of work, no wait
    for i in range(sent):
        sender.send(_record(i))
    received = receiver.drain()
    assert 0 < len(received) < sent
    assert receiver.drain() == []
    # The API server drains again: what waited in the engine core follows with the next records,
    # after a line with the count of the dropped ones.
    more = 200
    for i in range(sent, sent + more):
        sender.send(_record(i))
        received += receiver.drain()
    assert received[-1] == _record(sent + more - 1)
    assert len(received) + receiver.lost == sent + more
    assert receiver.lost > 0
    assert [r.ordinal for r in received] == sorted(r.ordinal for r in received)  # still in order
    receiver.close()


def test_a_receiver_that_went_away_is_dropped_without_an_exception(folder: str) -> None:
    receiver = Receiver(folder)
    sender = Sender(folder)
    sender.send(_record(0))
    assert receiver.drain() == [_record(0)]
    receiver.close()
    for i in range(1, 100):
        sender.send(_record(i))  # no exception into the scheduler
    assert sender._writers == {}


def test_a_receiver_started_later_is_found_at_a_later_preemption(folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cause_channel, "RESCAN_S", 0.0)
    sender = Sender(folder)
    sender.send(_record(0))  # nobody listens yet: nothing to send to
    receiver = Receiver(folder)
    sender.send(_record(1))
    assert receiver.drain() == [_record(1)]
    receiver.close()


def test_an_engine_core_dying_mid_line_or_writing_garbage_breaks_nothing(folder: str) -> None:
    receiver = Receiver(folder)
    good = cause_channel.encode(_record(7))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dying:
        dying.connect(receiver.address)
        dying.sendall(good + b'["p", "x", 1, "request", ["y"]]\nnot json\n[1, 2]\n' + good[:10])
    assert receiver.drain() == [_record(7), CauseRecord("x", 1, "request", ("y",))]
    assert receiver.garbage == 2  # the half line is dropped with its connection, not counted as garbage
    assert receiver.drain() == []
    receiver.close()


def test_the_folder_is_made_once_and_inherited(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(cause_channel.ENV, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(cause_channel.tempfile, "tempdir", None)  # TMPDIR read again
    assert cause_channel.folder() is None
    made = cause_channel.folder(create=True)
    assert made is not None and made.startswith(str(tmp_path)) and os.environ[cause_channel.ENV] == made
    assert oct(os.stat(made).st_mode & 0o777) == "0o700"
    assert cause_channel.folder(create=True) == made
