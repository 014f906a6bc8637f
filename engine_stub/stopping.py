"""SIGTERM as an exception, for programs whose ``finally`` blocks must run when they are stopped.

Python's default SIGTERM ends the process at once: no ``finally``, no ``atexit``, so nothing
buffered (spans, the last metrics) is flushed. Inside :func:`stop_on_sigterm` a SIGTERM raises
:class:`Stopped` in the main thread instead, and a second one, while that unwinding flushes,
exits at once with status 143. Only a program's own entry point uses it: a library must not
take over its host's signal handling, so nothing is installed when the host already has a
SIGTERM handler of its own, or outside the main thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Iterator, Optional

EXIT_STATUS = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


class Stopped(BaseException):
    """Raised where the main thread is when SIGTERM arrives; a BaseException, as KeyboardInterrupt
    is, so that code guarding itself with ``except Exception`` (telemetry hooks) lets it through."""

    def __init__(self) -> None:
        super().__init__("stopped by SIGTERM")


def _second(signum: int, frame: Optional[FrameType]) -> None:
    os._exit(EXIT_STATUS)


def _first(signum: int, frame: Optional[FrameType]) -> None:
    signal.signal(signal.SIGTERM, _second)
    raise Stopped()


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`Stopped` while the block runs (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        yield
        return
    signal.signal(signal.SIGTERM, _first)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is _first:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
