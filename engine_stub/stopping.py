"""SIGTERM as an exception, for programs whose ``finally`` blocks must run when they are stopped.

Python's default SIGTERM ends the process at once: no ``finally``, no ``atexit``, so nothing
buffered (spans, the last metrics) is flushed. Inside :func:`stop_on_sigterm` a SIGTERM raises
:class:`Stopped` in the main thread instead, and a second one, while that unwinding flushes,
exits at once with status 143. Inside :meth:`Stop.between_steps` it only sets
:attr:`Stop.requested`, and the loop's :meth:`Stop.check` raises at its next step boundary, so
that a step is never cut in half (its events half published). Only a program's own entry point
uses it: a library must not take over its host's signal handling, so nothing is installed when
the host already has a SIGTERM handler of its own, or outside the main thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Iterator, Optional

EXIT_STATUS = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


class Stopped(BaseException):
    """Raised in the main thread when SIGTERM arrives; a BaseException, as KeyboardInterrupt
    is, so that code guarding itself with ``except Exception`` (telemetry hooks) lets it through."""

    def __init__(self) -> None:
        super().__init__("stopped by SIGTERM")


class Stop:
    """What :func:`stop_on_sigterm` gives: whether SIGTERM came, and where it may stop the program."""

    def __init__(self) -> None:
        self.requested = False
        self._deferred = False

    def check(self) -> None:
        """Raises :class:`Stopped` if SIGTERM came (a loop calls it between its steps)."""
        if self.requested:
            raise Stopped()

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[None]:
        """Inside, SIGTERM only sets :attr:`requested`: the loop stops at its next :meth:`check`."""
        self._deferred = True
        try:
            yield
        finally:
            self._deferred = False
        self.check()

    def _signalled(self, signum: int, frame: Optional[FrameType]) -> None:
        signal.signal(signal.SIGTERM, _exit_at_once)
        self.requested = True
        if not self._deferred:
            raise Stopped()


def say_stopped(program: str, in_flight: int, where: str = "") -> None:
    """The one line a stopped program prints (stderr) before it flushes: what was cut short."""
    print(
        f"{program}: stopped by SIGTERM{where}, {in_flight} requests in flight cut short; flushing the telemetry",
        file=sys.stderr,
        flush=True,
    )


def _exit_at_once(signum: int, frame: Optional[FrameType]) -> None:
    os._exit(EXIT_STATUS)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[Stop]:
    """SIGTERM stops the block (see the module docstring)."""
    stop = Stop()
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        yield stop
        return
    signal.signal(signal.SIGTERM, stop._signalled)
    try:
        yield stop
    finally:
        if signal.getsignal(signal.SIGTERM) == stop._signalled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
