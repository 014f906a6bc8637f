"""The one way a vLLM engine core writes to otel-llm's channels (:mod:`.stream_channel`,
:mod:`.cause_channel`): whole messages on a Unix stream socket, from a process that must never
wait on its reader (its busy loop and output thread feed the GPU).

A send never blocks and costs O(its own message) whatever waits: what the socket takes goes
straight from the caller's buffers (``sendmsg``); past a full socket, the rest of the message is
copied once into a backlog of at most ``max_pending`` bytes, sent ahead of the next messages; a
message the backlog cannot take (one larger than the bound, always) is lost and counted, and the
count is told in a message of its own (``lost_message``) once the backlog takes messages again.
A reader that is not listening (yet, or any more) loses what is sent meanwhile, counted the same
way. Nothing of the caller's buffers is kept after a send returns (vLLM reuses its encoding
buffer).
"""

from __future__ import annotations

import collections
import select
import socket
import time
from typing import Any, Callable, Optional, Sequence

MAX_PARTS = 16  # buffers per sendmsg: enough for the room a read makes, few to build (far below IOV_MAX)


class SocketWriter:
    """A bounded, non-blocking writer to the Unix socket at ``address`` (connected at the first
    send, and again after its reader went away); one thread at a time."""

    def __init__(
        self, address: str, *, send_buffer: int, max_pending: int, lost_message: Callable[[int], bytes]
    ) -> None:
        self.address = address
        self._send_buffer = send_buffer  # asked for; the kernel caps it at net.core.wmem_max
        self.max_pending = max_pending  # bytes the backlog may hold
        self._lost_message = lost_message
        self._peer: Optional[socket.socket] = None
        self._pending: collections.deque[bytes] = collections.deque()  # messages, or their rests, in order
        self._offset = 0  # bytes of the first pending item already sent
        self.pending_bytes = 0  # what the backlog holds, at most max_pending
        self.copied = 0  # bytes ever copied into the backlog (each message's at most once)
        self.lost = 0  # messages dropped and not yet told
        self.lost_total = 0

    @property
    def connected(self) -> bool:
        return self._peer is not None

    def connect(self) -> bool:
        """Connect now if not connected; False when nobody listens at the address."""
        return (self._peer or self._connect()) is not None

    def send(self, *parts: Any) -> bool:
        """Send whole messages, ``parts`` (bytes-like) in order, or lose them (counted); never
        blocks. True when they were sent or kept in the backlog."""
        peer = self._peer or self._connect()
        if peer is not None and self._pending:
            peer = self._drain(peer)
        if peer is None:
            return self._lose()
        if self.lost:
            parts = (self._lost_message(self.lost), *parts)
        size = sum(memoryview(part).nbytes for part in parts)
        if self.pending_bytes + size > self.max_pending:
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
        the reader went away meanwhile: the backlog is lost with it, counted)."""
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
        """Bytes the socket took of ``parts`` (0 when full); -1 when the reader went away."""
        try:
            return peer.sendmsg(parts)
        except BlockingIOError:
            return 0
        except OSError:  # the reader went away: what was pending is lost with it
            self.close()
            self._lose()
            return -1

    def _connect(self) -> Optional[socket.socket]:
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer)
            peer.setblocking(False)
            peer.connect(self.address)
        except OSError:  # nobody listening (yet, or any more), or its backlog is full
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
