"""Provider flushes and shutdowns that cannot hold up the host for longer than a deadline.

Older SDKs do not bound an export by its timeout: before 1.35, the OTLP exporters retry an
unreachable collector for up to 63 s whatever their timeout, and a batch span processor's
shutdown waits for that without limit, so an engine that stopped while its collector was down
hung for minutes. resilience.ExportBound bounds our own exports; this bounds the rest (a console
exporter, a user's span processor, a hung shutdown). Each call runs on a thread of its own that
the caller waits for up to the deadline; a call still running then is left to finish in the
background (a daemon thread: it does not keep the process alive) and one warning names it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

_log = logging.getLogger(__name__)


def run_bounded(calls: Sequence[tuple[str, Callable[[], Any]]], timeout_s: float) -> dict[str, Any]:
    """Run ``calls`` (name, function) side by side; the results, by name, of those that returned
    within ``timeout_s``. A call that raised is logged and gives None."""
    results: dict[str, Any] = {}

    def call(name: str, fn: Callable[[], Any]) -> None:
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - a dead collector must not fail the host's flush or shutdown
            _log.warning("otel_llm: %s failed", name, exc_info=True)
            results[name] = None

    threads = []
    for name, fn in calls:
        thread = threading.Thread(target=call, args=(name, fn), name=f"otel_llm {name}", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no new threads while the interpreter shuts down: call it here
            call(name, fn)
            continue
        threads.append(thread)
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    done = dict(results)  # a late call may still add its result: judge one copy
    late = [name for name, _ in calls if name not in done]
    if late:
        _log.warning(
            "otel_llm: %s did not finish within %.1f s (collector unreachable?); left to finish in the "
            "background, and what it still holds may be lost",
            ", ".join(late),
            timeout_s,
        )
    return done
