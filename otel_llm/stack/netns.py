"""Run a server in a network namespace of its own (loopback only), one TCP port reachable from here.

For servers that bind every interface whatever they are told (Phoenix's gRPC server listens on
``[::]``): inside the namespace, every interface is its loopback. The one port that callers need is
bridged: the parent binds a listening socket on 127.0.0.1 in its own namespace and hands it to the
child, and the child relays each connection accepted there to the server's port inside the
namespace (a socket keeps the namespace it was created in). Nothing else of the server is
reachable from outside.

``python -m otel_llm.stack.netns FD PORT -- COMMAND...`` is the child's side, run by
:func:`start_isolated` under ``unshare --net``. It stops the server when its standard input closes
(the parent exited) or on SIGTERM, and exits when the server exits.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping, Optional, Sequence

from otel_llm.stack.lifetime import die_with_parent

LOOPBACK = "127.0.0.1"


class IsolationUnavailable(RuntimeError):
    """The namespace cannot be made here (no ``unshare``, or not allowed to)."""


@dataclass
class Isolated:
    """A server in its own network namespace; ``port`` is its bridged port on this side's 127.0.0.1."""

    proc: subprocess.Popen
    port: int

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the child stops the server first), then SIGKILL after ``timeout_s``."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self.proc.stdin is not None:
            self.proc.stdin.close()


def start_isolated(
    command: Sequence[str], inner_port: int, env: Mapping[str, str], log: IO[bytes], cwd: Optional[Path] = None
) -> Isolated:
    """Start ``command`` in a new network namespace; its ``inner_port`` is bridged to the returned port."""
    unshare = _unshare()
    if unshare is None:
        raise IsolationUnavailable(
            "cannot make a network namespace (`unshare --net` is missing or not permitted: it needs root,"
            " or unprivileged user namespaces)"
        )
    listener = socket.create_server((LOOPBACK, 0), backlog=64)
    try:
        fd = listener.fileno()
        relay = [sys.executable, "-m", "otel_llm.stack.netns", str(fd), str(inner_port)]
        proc = subprocess.Popen(
            [*unshare, *relay, "--", *command],
            pass_fds=(fd,),
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
        )
        return Isolated(proc, listener.getsockname()[1])
    finally:
        listener.close()  # the child holds its own copy


def _unshare() -> Optional[list[str]]:
    """The ``unshare`` command that makes a network namespace here: as root, else inside a user
    namespace of its own (``--map-root-user``); None where neither is allowed."""
    for command in (["unshare", "--net", "--"], ["unshare", "--net", "--map-root-user", "--"]):
        try:
            if subprocess.run([*command, "true"], capture_output=True, timeout=10).returncode == 0:
                return command
        except (OSError, subprocess.TimeoutExpired):
            return None
    return None


# ------------------------------------------------------------------------ inside the namespace


def _loopback_up() -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def _relay(listener: socket.socket, inner_port: int, server: subprocess.Popen) -> None:
    """Relays connections until the server exits, SIGTERM arrives or our standard input closes."""

    async def connection(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            reader, writer = await asyncio.open_connection(LOOPBACK, inner_port)
        except OSError:  # the server is not listening (yet): the caller sees a closed connection
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, writer), _pipe(reader, client_writer))

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    def parent_gone() -> None:  # the parent's end of our stdin closes when it exits, however it exits
        if not os.read(sys.stdin.fileno(), 4096):
            stop.set()

    loop.add_reader(sys.stdin.fileno(), parent_gone)
    relay = await asyncio.start_server(connection, sock=listener)
    while server.poll() is None and not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except asyncio.TimeoutError:
            pass
    relay.close()


def main(argv: Sequence[str]) -> int:
    fd, inner_port, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: python -m otel_llm.stack.netns FD PORT -- COMMAND...")
    listener = socket.socket(fileno=int(fd))
    _loopback_up()
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    try:
        asyncio.run(_relay(listener, int(inner_port), server))
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return max(server.returncode, 0)  # stopped by our signal: not a failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
