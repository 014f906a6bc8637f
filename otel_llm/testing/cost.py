"""What the telemetry costs an engine: the time spent inside its hooks, and the CPU of the
threads it started (exporters, readers, the /metrics endpoint)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class TimedHooks:
    """Wraps a subscriber to measure the time spent inside it (on_events + on_step): ``ns`` of wall
    time, ``cpu_ns`` of the calling thread's CPU time (not counting time that other processes or
    threads take from it). Calls of ``slow_s`` seconds or more are kept in ``slow`` as (start,
    end) perf_counter seconds."""

    def __init__(self, inner: Any, slow_s: float | None = None) -> None:
        self.inner = inner
        self.ns = 0
        self.cpu_ns = 0
        self.slow_ns = None if slow_s is None else int(slow_s * 1e9)
        self.slow: list[tuple[float, float]] = []

    def _timed(self, fn: Callable[[Any], None], arg: Any) -> None:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        fn(arg)
        self.cpu_ns += time.thread_time_ns() - c0
        t1 = time.perf_counter_ns()
        self.ns += t1 - t0
        if self.slow_ns is not None and t1 - t0 >= self.slow_ns:
            self.slow.append((t0 / 1e9, t1 / 1e9))

    def on_events(self, events: Any) -> None:
        self._timed(self.inner.on_events, events)

    def on_step(self, stats: Any) -> None:
        self._timed(self.inner.on_step, stats)


def started_threads(fn: Callable[[], T]) -> tuple[T, list[threading.Thread]]:
    """``fn()``, and the threads it started that are still running (exporters, readers, servers)."""
    before = set(threading.enumerate())
    value = fn()
    return value, [t for t in threading.enumerate() if t not in before]


def threads_cpu_s(threads: list[threading.Thread]) -> float:
    """CPU seconds used so far by those of ``threads`` that are still alive (their own CPU clocks:
    time another process or thread takes from them is not counted)."""
    return sum(
        time.clock_gettime(time.pthread_getcpuclockid(t.ident)) for t in threads if t.is_alive() and t.ident is not None
    )
