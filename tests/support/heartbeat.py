"""Tell a call that waited from a process that was held back.

A call that took seconds either waited on something (a lock, a sleep, a socket) while the rest of
the process ran, or the process as a whole was not running (other processes took the CPUs, the
machine paused it, one thread held the GIL). A thread that wakes every few milliseconds tells the
two apart: it keeps ticking through the first and not through the second.
"""

from __future__ import annotations

import threading
import time

from otel_llm.testing.cost import threads_cpu_s


class Heartbeat:
    """A thread that wakes every ``interval`` seconds; the stretches in which it did not run
    (a tick later than ``interval + late``) are kept as ``gaps`` of (start, end) perf_counter
    seconds. Only those are kept, so memory grows with the stalls, not with time."""

    def __init__(self, interval: float = 0.01, late: float = 0.05) -> None:
        self.interval = interval
        self.late = late
        self.gaps: list[tuple[float, float]] = []
        self._last = time.perf_counter()
        self._ticked = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.perf_counter()
            with self._ticked:
                if now - self._last > self.interval + self.late:
                    self.gaps.append((self._last + self.interval, now))
                self._last = now
                self._ticked.notify_all()

    def __enter__(self) -> Heartbeat:
        self._last = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def cpu_s(self) -> float:
        """CPU seconds the heartbeat thread has used (to leave out of other measurements)."""
        return threads_cpu_s([self._thread])

    def held_s(self, start: float, end: float) -> float:
        """Seconds of [start, end] (perf_counter) in which the heartbeat did not run: the
        process was held back."""
        self._tick_after(end)
        return sum(max(0.0, min(end, g1) - max(start, g0)) for g0, g1 in self.gaps)

    def _tick_after(self, t: float, timeout: float = 30.0) -> None:
        """Wait for a tick after ``t``: a stall that ended then is in ``gaps`` from that tick on."""
        with self._ticked:
            if not self._ticked.wait_for(lambda: self._last > t, timeout):
                raise TimeoutError(f"the heartbeat did not tick in {timeout} s")

    def own_wait_s(self, start: float, end: float) -> float:
        """Of a call that ran from ``start`` to ``end``, the time it waited while the process ran."""
        return (end - start) - self.held_s(start, end)
