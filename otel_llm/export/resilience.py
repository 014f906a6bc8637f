"""Exports that cannot hold up the engine or the host: a backoff while the collector is unreachable
(:class:`Backoff`), and a bound on how long one export is waited for (:class:`ExportBound`)."""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Any, Callable, Optional

_log = logging.getLogger(__name__)


class Backoff:
    """While the collector is unreachable, do not even try: after a failed export, the exports
    of the next ``delay`` seconds fail at once (counted, nothing encoded), then one is let
    through as a probe; the delay doubles from MIN_S up to MAX_S, and a success resets it.

    Why: the SDK's OTLP exporters re-encode the whole batch on every retry and log each
    failure; during an outage that work, on exporter threads, takes the GIL from the engine.
    """

    MIN_S = 1.0
    MAX_S = 10.0

    def __init__(self) -> None:
        self._delay = 0.0
        self._until = 0.0

    def closed(self) -> bool:
        return time.monotonic() < self._until

    def result(self, ok: bool) -> None:
        if ok:
            self._delay = self._until = 0.0
        else:
            self._delay = min(self.MAX_S, max(self.MIN_S, 2 * self._delay))
            self._until = time.monotonic() + self._delay


class ExportBound:
    """Waits at most ``timeout_s`` for an export, which runs on a thread of its own (with the
    caller's context: the SDK marks its exports there so that instrumented libraries do not trace
    them). For exporters that retry past their timeout: the OTLP exporters before 1.35 retry an
    unreachable collector for up to 63 s whatever their timeout.

    An export still running at the deadline counts as failed (should it succeed later, its items
    arrive although counted lost) and finishes in the background; until it has, the next exports
    fail at once, and a shutdown of the exporter waits for it there."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._running = False
        self._then: Optional[Callable[[], None]] = None

    def export(self, attempt: Callable[[], Any], failure: Any) -> Any:
        with self._lock:
            if self._running:
                return failure
            self._running = True
        result = [failure]
        context = contextvars.copy_context()

        def run() -> None:
            result[0] = context.run(attempt)
            with self._lock:
                self._running = False
                then, self._then = self._then, None
            if then is not None:
                try:
                    then()
                except Exception:  # noqa: BLE001 - a background thread: nobody to raise to
                    _log.warning("otel_llm: exporter shutdown failed", exc_info=True)

        thread = threading.Thread(target=run, name="otel_llm export", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        return failure if thread.is_alive() else result[0]

    def when_idle(self, fn: Callable[[], None]) -> None:
        """``fn()`` now, or after the export still running in the background."""
        with self._lock:
            if self._running:
                self._then = fn
                return
        fn()


def run_export(export: Callable[[], Any], failure: Any, what: str, bound: Optional[ExportBound]) -> Any:
    """``export()``'s result, or ``failure`` if it raised or (with a bound) did not return in time."""

    def attempt() -> Any:
        try:
            return export()
        except Exception:  # noqa: BLE001 - counted, then as the SDK would: logged, batch lost
            _log.warning("otel_llm: %s export raised", what, exc_info=True)
            return failure

    return attempt() if bound is None else bound.export(attempt, failure)


def export_bound(bound_s: Optional[float]) -> Optional[ExportBound]:
    return None if bound_s is None else ExportBound(bound_s)


def when_export_idle(bound: Optional[ExportBound], fn: Callable[[], None]) -> None:
    """An exporter's shutdown: at once, or once its export still running has ended (it waits for
    that export itself otherwise, holding up the host's shutdown)."""
    if bound is None:
        fn()
    else:
        bound.when_idle(fn)
