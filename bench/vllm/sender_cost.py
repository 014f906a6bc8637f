"""What one hand-over costs the engine core's output thread, this tree's sender against another
revision's (``bench.vllm.rates --sender-against REV``): vLLM's encoded buffers made into a frame
and sent, nothing waiting (the consumer has read everything) and behind backlogs of 1 to 8 MiB
(the consumer reads one frame's worth before each send, so the backlog stays), the send buffer
asked for as the engine core asks, a stock kernel's cap applied. Both in this process, interleaved
send by send; the frames are a batch-256 engine's steps."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BACKLOGS_MIB = (0, 1, 2, 4, 8)
SENDS = 200  # timed per variant and backlog


class _Variant:
    """A sender of ``package`` (``otel_llm`` or a copy) connected to a consumer that reads only
    when told; ``hand_over`` is what its tap does with one output message."""

    def __init__(self, package: str, sndbuf: int) -> None:
        from .stream import vllm_module

        channel: Any = vllm_module(package, "channels.stream_channel")
        channel.SEND_BUFFER = sndbuf  # as the engine core asks, capped like a stock kernel
        self.channel = channel
        folder = tempfile.mkdtemp(prefix="bench-sender-")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.path.join(folder, self.channel.SOCKET_NAME))
        listener.listen(1)
        self.sender = self.channel.Sender(folder)
        self.parts = hasattr(self.channel, "outputs_parts")  # this tree's: the frame's parts, sent as they are
        self.sender.send(self.channel.frame(self.channel.HELLO, b"{}"))
        self.peer, _ = listener.accept()
        listener.close()
        self.peer.setblocking(False)

    def hand_over(self, buffers: Any) -> None:
        if self.parts:
            self.sender.send(*self.channel.outputs_parts(buffers))
        else:
            self.sender.send(self.channel.outputs_frame(buffers))

    def backlog(self) -> int:
        pending = getattr(self.sender, "pending_bytes", None)
        return len(self.sender._pending) if pending is None else pending

    def read(self, size: int) -> None:
        try:
            while size > 0:
                size -= len(self.peer.recv(min(size, 1 << 20)))
        except BlockingIOError:
            pass

    def close(self) -> None:
        self.peer.close()
        self.sender.close()


def measure(packages: dict[str, str], frames: list[bytes], sndbuf: int) -> dict[str, Any]:
    """Per variant and backlog: µs per hand-over, p50 and p99, and the ratios to the first variant."""
    clock = time.perf_counter_ns
    out: dict[str, Any] = {}
    for mib in BACKLOGS_MIB:
        variants = {name: _Variant(package, sndbuf) for name, package in packages.items()}
        times: dict[str, list[int]] = {name: [] for name in variants}
        try:
            for v in variants.values():
                target = min(mib << 20, v.channel.MAX_PENDING - 4 * len(frames[0]))  # below the bound: kept
                while v.backlog() < target:
                    v.hand_over([frames[0]])
            for i in range(SENDS):
                frame = frames[i % len(frames)]
                for name, v in variants.items():
                    v.read(len(frame) + 8 if mib else 1 << 30)
                    t0 = clock()
                    v.hand_over([bytearray(frame)])  # vLLM's buffer: a bytearray it reuses
                    times[name].append(clock() - t0)
        finally:
            for v in variants.values():
                v.close()
        row: dict[str, Any] = {}
        for name, ns in times.items():
            ns.sort()
            row[name] = {"p50_us": ns[len(ns) // 2] / 1e3, "p99_us": ns[len(ns) * 99 // 100] / 1e3}
        first = next(iter(row))
        for name in list(row)[1:]:
            row[f"{name}/{first} p50"] = row[name]["p50_us"] / row[first]["p50_us"]
        out[f"{mib}MiB"] = row
    return out


def run(against: str, frames: list[bytes], sndbuf: int) -> dict[str, Any]:
    from .stream import package_copy

    copies = Path(tempfile.mkdtemp(prefix="bench-sender-packages-"))
    sys.path.insert(0, str(copies))
    package, what = package_copy("base", against, copies)
    return {
        "variants": {"ours": "this tree", "base": what},
        "frame_bytes": sum(map(len, frames)) / len(frames),
        "by_backlog": measure({"ours": "otel_llm", "base": package}, frames, sndbuf),
    }
