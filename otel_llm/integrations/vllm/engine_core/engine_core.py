"""The deep hook's part in vLLM's engine core: the cause of every preemption, taken at the
scheduler's own preemption point and written to the cause channel (:mod:`.cause_channel`).

vLLM v1's ``Scheduler.schedule()`` allocates KV blocks for each running request in turn
(``request``); when ``kv_cache_manager.allocate_slots`` fails it picks a victim
(``preempted_req``: the last running under FCFS, the lowest priority under the priority policy)
and calls ``_preempt_request``, until the allocation fits or the victim is ``request`` itself.
The cause is ``request`` (its own cause when it is the victim). ``reset_prefix_cache`` with
``reset_running_requests`` preempts every running request: no request is the cause
(``cache_reset``). Any other caller is ``unknown``.

The wrapper of ``_preempt_request`` reads its callers' frames: only when vLLM preempts, so that a
step without a preemption costs nothing more. It walks up (at most :data:`MAX_DEPTH` frames, past
any other wrapper of ``_preempt_request`` installed after it) to vLLM's ``schedule``, known by
its name and the loop's locals (whatever else wraps ``schedule``, its own code calls
``_preempt_request``), and checks the victim against ``preempted_req`` before ``request`` is
taken as the cause; or to ``reset_prefix_cache``, by its name. A preemption found in neither is
``unknown``, said once with the caller's name.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, Callable, Optional

from otel_llm.events import CAUSE_CACHE_RESET, CAUSE_REQUEST, CAUSE_SELF, CAUSE_UNKNOWN
from otel_llm.integrations.vllm.channels.cause_channel import CauseRecord, Sender, folder

_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs

MAX_DEPTH = 8  # frames walked up from the wrapper: vLLM's caller, past other wrappers
_sender: list[Sender] = []  # made at the first preemption, in the engine core's process
_warned: set[str] = set()


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        _log.warning("otel-llm deep hook (engine core): %s", message)


def problem() -> Optional[str]:
    """Why the causes cannot be read from the installed vLLM's Scheduler, or None."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except Exception as exc:  # noqa: BLE001 - any import failure: no causes
        return f"vllm.v1.core.sched.scheduler.Scheduler is not importable ({exc!r})"
    return shape_problem(Scheduler)


def shape_problem(scheduler_cls: type) -> Optional[str]:
    """Why the causes cannot be read from this vLLM's Scheduler, or None."""
    preempt = getattr(scheduler_cls, "_preempt_request", None)
    schedule = getattr(scheduler_cls, "schedule", None)
    if preempt is None or schedule is None or not hasattr(scheduler_cls, "reset_prefix_cache"):
        return "Scheduler._preempt_request / schedule / reset_prefix_cache not found"
    params = list(inspect.signature(preempt).parameters)
    if params[:3] != ["self", "request", "timestamp"]:
        return f"Scheduler._preempt_request has parameters {params}"
    code = getattr(inspect.unwrap(schedule), "__code__", None)
    names = local_names(code) if code is not None else ()
    if "request" not in names or "preempted_req" not in names:
        return "Scheduler.schedule has no locals request / preempted_req"
    return None


def local_names(code: Any) -> tuple[str, ...]:
    """A function's local variables, those its nested functions use (cells) included: vLLM's
    ``schedule`` has closures over ``request`` and ``preempted_req``."""
    return code.co_varnames + code.co_cellvars


def wrapper(scheduler_cls: type) -> Callable[..., Any]:
    """The ``_preempt_request`` of ``scheduler_cls`` that also reports the preemption's cause."""
    original = scheduler_cls._preempt_request  # type: ignore[attr-defined]  # checked by shape_problem

    def _preempt_request(self: Any, request: Any, timestamp: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, request, timestamp, *args, **kwargs)
        try:
            report(request, sys._getframe(1))
        except Exception as exc:  # noqa: BLE001 - never into vLLM's scheduler
            _warn_once("report", f"reporting a preemption's cause failed ({exc!r}): it is unknown")
        return result

    return _preempt_request


def report(victim: Any, caller: Any) -> None:
    """The cause of ``victim``'s preemption, from the frames above ``_preempt_request``'s wrapper
    (``caller``: the first of them)."""
    causes: tuple[str, ...] = ()
    kind = CAUSE_UNKNOWN
    frame = caller
    for _ in range(MAX_DEPTH):
        if frame is None:
            break
        code = frame.f_code
        if code.co_name == "schedule" and "preempted_req" in local_names(code):
            local = frame.f_locals
            cause = local.get("request")
            if local.get("preempted_req") is victim and cause is not None:
                kind = CAUSE_SELF if cause is victim else CAUSE_REQUEST
                causes = (str(cause.request_id),)
            else:
                _warn_once("victim", "a preemption's victim is not schedule()'s preempted_req: its cause is unknown")
            break
        if code.co_name == "reset_prefix_cache":
            kind = CAUSE_CACHE_RESET
            break
        frame = frame.f_back
    else:
        frame = None
    if frame is None:
        _warn_once(
            "caller",
            f"a preemption came from {caller.f_code.co_name}(), not from vLLM's schedule() or "
            "reset_prefix_cache(): its cause is unknown (said once)",
        )
    sender = _sender[0] if _sender else _new_sender()
    if sender is not None:
        sender.send(CauseRecord(str(victim.request_id), int(victim.num_preemptions), kind, causes))


def _new_sender() -> Optional[Sender]:
    path = folder()
    if path is None:
        _warn_once("folder", "no cause channel (the plugin did not start this serve): causes are unknown")
        return None
    _sender.append(Sender(path))
    return _sender[0]
