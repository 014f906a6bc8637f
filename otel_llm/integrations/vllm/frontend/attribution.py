"""In vLLM's API server: the causes the engine cores report (:mod:`.cause_channel`) joined to this
server's requests (:data:`.traces.in_flight`), so that each request's summary names the cause of
each of its preemptions and counts the preemptions it caused.

A record is applied when it is drained: to the victim's trace (the cause of that preemption
ordinal, by the ids the client knows) and to each cause's (one preemption more caused). Drains
happen before the finished requests of kept steps are translated (every record those requests
need is in the socket by then: see :mod:`.cause_channel`), and whenever the deep hook sees a
PREEMPTED event go by (which keeps the socket's queue short). A record for a request of another
API server (``--api-server-count`` > 1) is applied to what this server has of it: a cause that
is not here is named by vLLM's internal id, and has no span here to link to.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from otel_llm.events import CAUSE_UNKNOWN
from otel_llm.integrations.vllm.channels.cause_channel import Receiver, folder
from otel_llm.integrations.vllm.frontend import traces
from otel_llm.summary import PreemptionCause

_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs

_lock = threading.Lock()  # drains come from vLLM's output handler and from collections
_receiver: list[Receiver] = []
_told: list[int] = [0]  # records the senders lost, as already counted
_warned: set[str] = set()


def start() -> bool:
    """Listen for this API server's causes (once per process); False, with one warning, where the
    serve has no channel (the plugin did not start it: the causes are unknown)."""
    with _lock:
        if _receiver:
            return True
        path = folder()
        if path is None:
            _warn_once(
                "no channel", "the engine core has no channel to report causes on: preemption causes are unknown"
            )
            return False
        try:
            _receiver.append(Receiver(path))
        except OSError as exc:
            _warn_once("no channel", f"cannot listen for preemption causes ({exc}): they are unknown")
            return False
        return True


def drain() -> None:
    """Apply every record received so far."""
    if not _receiver:
        return
    with _lock:
        receiver = _receiver[0]
        in_flight = traces.in_flight
        for record in receiver.drain():
            victim = in_flight.get(record.victim)
            known = [in_flight.get(c) for c in record.causes]
            for cause in known:
                if cause is not None:
                    cause.caused += 1
            if victim is not None:
                ids = tuple(c.external_id or rid if c is not None else rid for rid, c in zip(record.causes, known))
                victim.causes[record.ordinal] = (record.kind, ids, record.causes)


def take_lost() -> int:
    """The records the senders lost (their victims' causes are unknown), since the last call."""
    if not _receiver:
        return 0
    with _lock:
        lost = _receiver[0].lost - _told[0]
        _told[0] += lost
        return lost


def causes_of(trace: traces.RequestTrace, num_preemptions: int) -> tuple[PreemptionCause, ...]:
    """The cause of each of the request's preemptions, in order; unknown where none was reported
    (one warning the first time)."""
    out = []
    for ordinal in range(1, num_preemptions + 1):
        reported = trace.causes.get(ordinal)
        if reported is None:
            out.append(PreemptionCause(CAUSE_UNKNOWN))
            if _receiver:
                _warn_once(
                    "unreported",
                    "a preemption came with no cause from the engine core (its deep hook not attached there, or "
                    "records lost): that cause is unknown",
                )
            continue
        kind, ids, _ = reported
        out.append(PreemptionCause(kind, ids))
    return tuple(out)


def causes_in_flight(trace: traces.RequestTrace) -> list[traces.RequestTrace]:
    """The traces of the request's causes that are still to be translated here (their spans can
    be opened ahead for links)."""
    out: list[traces.RequestTrace] = []
    for _, _, internal in trace.causes.values():
        for rid in internal:
            cause = traces.in_flight.get(rid)
            if cause is not None and cause is not trace and cause not in out:
                out.append(cause)
    return out


def translated(trace: traces.RequestTrace) -> None:
    """The request's span is made: nothing more is applied to it."""
    if trace.internal_id is not None:
        traces.in_flight.pop(trace.internal_id, None)


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        _log.warning("otel-llm deep hook: %s", message)


def receiving() -> Optional[Receiver]:
    """This process's receiver (tests)."""
    return _receiver[0] if _receiver else None
