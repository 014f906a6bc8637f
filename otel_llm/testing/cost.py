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
    threads take from it)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ns = 0
        self.cpu_ns = 0

    def on_events(self, events: Any) -> None:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        self.inner.on_events(events)
        self.cpu_ns += time.thread_time_ns() - c0
        self.ns += time.perf_counter_ns() - t0

    def on_step(self, stats: Any) -> None:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        self.inner.on_step(stats)
        self.cpu_ns += time.thread_time_ns() - c0
        self.ns += time.perf_counter_ns() - t0


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
