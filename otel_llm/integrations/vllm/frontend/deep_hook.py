"""The deep hook into vLLM, on wherever it attaches (``OTEL_LLM_VLLM_DEEP_HOOK=0`` turns it off):
a span event at each preemption, with its time and cause, the caller's trace context, and spans
for the requests vLLM ends without stats.

vLLM's stat loggers only get ``FinishedRequestStats.num_preemptions``: the per-request
``EngineCoreEvent`` timestamps (QUEUED / SCHEDULED / PREEMPTED) are consumed by
``IterationStats.update_from_events`` in the output processor and dropped. This hook wraps two
methods of vLLM's ``IterationStats`` (an internal class, not a stable interface):

* ``update_from_events(req_id, events, is_prefilling, req_stats, ...)``: after vLLM's own
  processing, the events' ``(type, timestamp)`` are appended to a small trace kept on vLLM's
  per-request ``RequestStateStats`` object (so it lives and dies with the request);
* ``update_from_finished_request(..., req_stats, ...)``: after vLLM appended its
  ``FinishedRequestStats``, the trace is attached to it, where the stat logger
  (:mod:`otel_llm.integrations.vllm`) finds it: one ``preempted`` span event at each real
  PREEMPTED timestamp, the exact preempted time, the real arrival time and TTFT of the request.

It also keeps the caller's W3C trace context, which vLLM drops unless its own tracing is on
(``AsyncLLM.add_request`` discards ``trace_headers`` without ``--otlp-traces-endpoint``): a
wrapper of ``AsyncLLM.add_request`` holds the headers in a context variable while vLLM builds
the request, and a wrapper of ``OutputProcessor.add_request`` (called in the same task) stores
them in the request's trace, so that the request span is a child of the caller's span.

And it sees the requests that end without ``FinishedRequestStats``, which vLLM never hands to
its stat loggers nor counts in ``request_success``: a wrapper of
``OutputProcessor.abort_requests`` (a client that disconnects), one of ``AsyncLLM.shutdown``
(every request still in flight when vLLM stops: ``incomplete="shutdown"``) and one of
``OutputProcessor.propagate_error`` (every request in flight when the engine core died:
``incomplete="engine_dead"``, with the exception's type) queue what was known of each
(:class:`EndedRequest`, at most :data:`MAX_ENDED` waiting; more are counted as lost), and the
stat logger gives each a span, leaving the metrics as vLLM's. After a shutdown or an engine
death no engine step comes to record them: the wrapper calls the stat loggers' listeners
(:func:`listen`) at once. A request is ended once: its trace is marked when its span is made.

Attached by structure, whatever vLLM's version (:mod:`.package`): both targets must have the
parameters relied on. When it cannot attach, it says once (a warning) what does not hold and
what is lost, and the plugin falls back to metrics plus one span per finished request with the
exact preemption count; on a release CI does not prove, the attach line says so. The other
parts check their own targets the same way: the caller's trace context, the preemptions'
causes (:mod:`.engine_core`). Loaded in every vLLM process through the
``vllm.general_plugins`` entry point (``register``); the stat logger also installs it.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import threading
import weakref
from typing import Any, Callable, Mapping, Optional

from otel_llm.config.settings import from_environment
from otel_llm.integrations.vllm import package
from otel_llm.integrations.vllm.channels.cause_channel import folder
from otel_llm.integrations.vllm.engine_core import engine_core
from otel_llm.integrations.vllm.frontend import attribution, tenant_steps, traces
from otel_llm.summary import ENGINE_DEAD, SHUTDOWN

_log = logging.getLogger(__name__)

ENV = "OTEL_LLM_VLLM_DEEP_HOOK"
# What the stat loggers get instead when the deep hook does not attach.
FALLBACK = (
    "falling back to stat-logger data: exact preemption counts, but no per-preemption times, no caller "
    "traceparent, no spans for aborted or cut-off requests, no preemption causes"
)
SHUT_DOWN_ATTR = "_otel_llm_shut_down"  # on an AsyncLLM whose shutdown the stat loggers were told of
_MARK = "__otel_llm_deep_hook__"
_lock = threading.Lock()
# "values": whether the per-step stats are taken by tenant (None: not asked yet).
_state: dict[str, Any] = {"installed": False, "failed": None, "originals": [], "values": None}
# The trace headers of the request being added, from AsyncLLM.add_request to OutputProcessor.add_request.
_adding_headers: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("otel_llm_trace_headers", default=None)


def enabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """On unless turned off (``0``/``off``/``false``/``no``): every headline feature needs it, and
    it attaches by structure or says why not; a bad value raises ValueError naming the variable."""
    return from_environment(ENV, environ) != "off"


def register() -> None:
    """``vllm.general_plugins`` entry point: under a frontend that calls no stat-logger plugin,
    the engine-core stream's part of this process (:mod:`.frontend`); the deep hook when enabled;
    never raises into vLLM."""
    try:
        from otel_llm.export.settings_check import check_settings, refused
        from otel_llm.integrations.vllm.frontend import frontend

        # A bad setting leaves every part off, said once where the telemetry would start: by the
        # stat logger, or here under the Rust frontend, which calls no stat logger.
        if refused(_log, "vLLM plugin", "vLLM serves on") if frontend.rust_frontend() else check_settings():
            return
        frontend.start()
        if enabled():
            folder(create=True)  # before the engine cores start: they inherit where to report causes
            install()
    except Exception:  # noqa: BLE001 - registration must not stop vLLM: the plain plugin stays
        _log.exception("otel-llm deep hook: registration failed; falling back")


# Called when vLLM stops or its engine died: no engine step comes to record what was ended.
_listeners: "list[weakref.WeakMethod]" = []


def listen(callback: Callable[[], None]) -> None:
    """Call the bound method ``callback`` (a stat logger's) when vLLM stops or its engine died,
    so that it records the requests ended then and flushes; held weakly."""
    _listeners.append(weakref.WeakMethod(callback))


def _notify() -> None:
    for ref in list(_listeners):
        callback = ref()
        if callback is None:
            _listeners.remove(ref)
            continue
        try:
            callback()
        except Exception:  # noqa: BLE001 - one logger's failure must not stop vLLM's shutdown
            _log.exception("otel-llm deep hook: recording the requests cut short failed")


def _params(fn: Callable) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _shape_ok(stats_cls: type) -> Optional[str]:
    ufe = getattr(stats_cls, "update_from_events", None)
    ufr = getattr(stats_cls, "update_from_finished_request", None)
    if ufe is None or ufr is None:
        return "IterationStats.update_from_events / update_from_finished_request not found"
    p = _params(ufe)
    if p[:5] != ["self", "req_id", "events", "is_prefilling", "req_stats"]:
        return f"IterationStats.update_from_events has parameters {p}"
    q = _params(ufr)
    if "req_stats" not in q or "request_id" not in q:
        return f"IterationStats.update_from_finished_request has parameters {q}"
    try:
        probe = stats_cls()
    except Exception as exc:  # noqa: BLE001 - any failure means vLLM's class changed shape: no deep hook
        return f"IterationStats() cannot be built ({exc!r})"
    if not isinstance(getattr(probe, "finished_requests", None), list):
        return "IterationStats has no finished_requests list"
    return None


def install() -> bool:
    """Wrap vLLM's IterationStats (idempotent). False, with one warning, when it cannot."""
    with _lock:
        if _state["installed"]:
            return True
        if _state["failed"] is not None:
            return False
        try:
            reason = _install()
        except Exception as exc:  # noqa: BLE001 - any install failure means no deep hook, reported once
            reason = f"unexpected error {exc!r}"
        if reason is None:
            _state["installed"] = True
            _log.info(
                "otel-llm deep hook: attached to vLLM's IterationStats: a span event at each preemption with its "
                "time and cause, the caller's traceparent, spans for aborted and cut-off requests (%s=0 turns it "
                "off)%s",
                ENV,
                package.unproven_note(),
            )
            return True
        _state["failed"] = reason
        _log.warning("otel-llm deep hook: not attached (%s); %s", reason, FALLBACK)
        return False


def shape_problem() -> Optional[str]:
    """Why the deep hook cannot attach to this vLLM, or None (its checks alone, nothing wrapped)."""
    try:
        from vllm.v1.metrics import stats as vstats
    except Exception as exc:  # noqa: BLE001 - any import failure means no deep hook
        return f"vllm.v1.metrics.stats is not importable ({exc!r})"
    cls = getattr(vstats, "IterationStats", None)
    if cls is None:
        return "vllm.v1.metrics.stats.IterationStats not found"
    return _shape_ok(cls)


def _install() -> Optional[str]:
    problem = shape_problem()
    if problem:
        return problem
    from vllm.v1.metrics.stats import IterationStats as cls

    if getattr(cls.update_from_events, _MARK, False):
        return None  # already wrapped (e.g. by another copy of this module)

    orig_events = cls.update_from_events
    orig_finished = cls.update_from_finished_request
    finished_params = _params(orig_finished)
    req_stats_pos = finished_params.index("req_stats")  # self included
    warned: set[str] = set()

    def warn_once(what: str, exc: BaseException) -> None:
        if what not in warned:
            warned.add(what)
            _log.warning("otel-llm deep hook: %s failed (%r); that request keeps the fallback data", what, exc)

    def update_from_events(
        self: Any, req_id: Any, events: Any, is_prefilling: Any, req_stats: Any, *args: Any, **kwargs: Any
    ) -> Any:
        result = orig_events(self, req_id, events, is_prefilling, req_stats, *args, **kwargs)
        try:
            if events:
                trace = getattr(req_stats, traces.TRACE_ATTR, None)
                if trace is None:
                    trace = traces.RequestTrace()
                    setattr(req_stats, traces.TRACE_ATTR, trace)
                seen = [(int(e.type), float(e.timestamp)) for e in events]
                trace.events.extend(seen)
                if any(kind == traces.PREEMPTED for kind, _ in seen):
                    attribution.drain()  # a preemption went by: its causes are in the channel
        except Exception as exc:  # noqa: BLE001 - never into vLLM's engine core
            warn_once("recording engine-core events", exc)
        return result

    def update_from_finished_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = len(self.finished_requests)
        result = orig_finished(self, *args, **kwargs)
        try:
            req_stats = kwargs.get("req_stats")
            if req_stats is None and len(args) >= req_stats_pos:
                req_stats = args[req_stats_pos - 1]
            if req_stats is not None and len(self.finished_requests) > before:
                trace = getattr(req_stats, traces.TRACE_ATTR, None) or traces.RequestTrace()
                trace.arrival_time = getattr(req_stats, "arrival_time", None)
                ftl = getattr(req_stats, "first_token_latency", None)
                trace.first_token_latency = ftl if isinstance(ftl, (int, float)) and ftl > 0 else None
                setattr(self.finished_requests[-1], traces.TRACE_ATTR, trace)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's output processor
            warn_once("attaching the trace to FinishedRequestStats", exc)
        return result

    _wrap(cls, "update_from_events", update_from_events)
    _wrap(cls, "update_from_finished_request", update_from_finished_request)
    _install_cause_reports()
    problem = _install_trace_context_capture(warn_once)
    if problem:
        _log.warning(
            "otel-llm deep hook: the frontend's part is not attached (%s): request spans are roots unless "
            "vLLM's own tracing is on, and aborted requests and those cut off by a shutdown or an engine "
            "death get no span",
            problem,
        )
    return None


def take_tenant_values(resolve: Callable[[Optional[dict]], str]) -> Optional[tenant_steps.Tenants]:
    """With a tenant source taken from each request's facts: each value of vLLM's per-step stats
    added to the values of its request's tenant (:mod:`.tenant_steps`:
    ``IterationStats.update_from_output`` wrapped, once, in this process only), ``resolve``
    giving a request's facts their tenant. None, with one warning, where the deep hook's
    frontend part is not attached or the method is not as relied on: those values are then
    recorded under the tenant of a request with no facts."""
    with _lock:
        if _state["values"] is None:
            _state["values"] = _install_values_wrapper()
        if not _state["values"]:
            return None
        tenant_steps.current = tenant_steps.Tenants(resolve)
        return tenant_steps.current


def _install_values_wrapper() -> bool:
    if not _state["installed"]:
        return False
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.stats import IterationStats as cls

    problem = tenant_steps.shape_problem(cls)
    if problem is None and not getattr(OutputProcessor.add_request, _MARK, False):
        problem = "the deep hook's frontend part is not attached"
    if problem is not None:
        _log.warning(
            "otel-llm deep hook: time to first token, inter-token latency and the token counters carry the "
            "tenant of a request with no facts (%s)",
            problem,
        )
        return False
    if not getattr(cls.update_from_output, _MARK, False):
        _wrap(cls, "update_from_output", tenant_steps.wrapper(cls.update_from_output))
    return True


def _install_cause_reports() -> None:
    """In the engine core (and, unused, everywhere else): the cause of every preemption reported
    (:mod:`.engine_core`); where it cannot be, the causes are unknown, said once."""
    from vllm.v1.core.sched.scheduler import Scheduler

    problem = engine_core.shape_problem(Scheduler)
    if problem is not None:
        _log.warning("otel-llm deep hook: the causes of preemptions are not reported (%s): they are unknown", problem)
        return
    _wrap(Scheduler, "_preempt_request", engine_core.wrapper(Scheduler))


def _wrap(owner: type, name: str, wrapper: Callable) -> None:
    original = getattr(owner, name)
    wrapper.__name__ = original.__name__
    wrapper.__qualname__ = original.__qualname__
    wrapper.__doc__ = original.__doc__
    setattr(wrapper, _MARK, True)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]  # a function takes any attribute; Callable does not say so
    _state["originals"].append((owner, name, original))
    setattr(owner, name, wrapper)


def tenant_facts(request: Any) -> dict[str, Any]:
    """What vLLM's ``EngineCoreRequest`` tells to take a tenant from: its priority and LoRA
    adapter's name (a base-model request: none, the served model then). vLLM passes only
    ``traceparent`` and ``tracestate`` as trace headers: no other header, no ``baggage``."""
    priority = getattr(request, "priority", None)
    lora = getattr(getattr(request, "lora_request", None), "lora_name", None)
    return {"priority": priority if isinstance(priority, int) else None, "lora": str(lora) if lora else None}


def frontend_problem() -> Optional[str]:
    """Why the deep hook's Python-frontend parts (the caller's trace context, aborted requests,
    the requests in flight at a shutdown or an engine death) cannot attach here, or None."""
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.output_processor import OutputProcessor
    except Exception as exc:  # noqa: BLE001 - any import failure: those parts cannot attach
        return f"vLLM's AsyncLLM / OutputProcessor are not importable ({exc!r})"
    return _frontend_shape(AsyncLLM, OutputProcessor)


def _frontend_shape(async_llm: type, processor: type) -> Optional[str]:
    missing = [
        name
        for owner, name in (
            (async_llm, "add_request"),
            (async_llm, "shutdown"),
            (processor, "add_request"),
            (processor, "abort_requests"),
            (processor, "propagate_error"),
        )
        if not callable(getattr(owner, name, None))
    ]
    if missing:
        return f"{', '.join(missing)} not found on AsyncLLM / OutputProcessor"
    add = async_llm.add_request  # type: ignore[attr-defined]  # checked above
    parameters = list(inspect.signature(add).parameters)
    if "trace_headers" not in parameters or not inspect.iscoroutinefunction(add):
        return f"AsyncLLM.add_request has parameters {parameters}"
    if _params(processor.add_request)[:2] != ["self", "request"]:  # type: ignore[attr-defined]
        return f"OutputProcessor.add_request has parameters {_params(processor.add_request)}"  # type: ignore[attr-defined]
    return None


def _install_trace_context_capture(warn_once: Callable[[str, BaseException], None]) -> Optional[str]:
    """Keep the trace headers that AsyncLLM.add_request receives on the request's trace."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor

    problem = _frontend_shape(AsyncLLM, OutputProcessor)
    if problem is not None:
        return problem
    add = AsyncLLM.add_request
    signature = inspect.signature(add)

    # Where a positional call puts the headers (after self); None when they are keyword-only.
    parameter = signature.parameters["trace_headers"]
    index: Optional[int] = None
    if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
        index = list(signature.parameters).index("trace_headers") - 1

    async def add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Read by position or keyword: binding the signature cost more than the rest of this
        # hook for the request.
        kept = None
        try:
            headers = args[index] if index is not None and len(args) > index else kwargs.get("trace_headers")
            kept = dict(headers) if headers else None
        except Exception as exc:  # noqa: BLE001 - never into vLLM's request path
            warn_once("reading the trace headers", exc)
        token = _adding_headers.set(kept)
        try:
            return await add(self, *args, **kwargs)
        finally:
            _adding_headers.reset(token)

    processor_add = OutputProcessor.add_request

    def add_to_processor(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = processor_add(self, request, *args, **kwargs)
        try:
            req_state = self.request_states.get(request.request_id)
            if getattr(req_state, "stats", None) is not None:
                # Every request: a preemption's victim and its cause are told by internal id.
                trace = traces.trace_on(req_state)
                trace.carrier = _adding_headers.get() or trace.carrier
                trace.internal_id = str(request.request_id)
                trace.external_id = str(getattr(req_state, "external_req_id", None) or request.request_id)
                trace.arrival_time = getattr(req_state.stats, "arrival_time", None)
                trace.tenant_facts = tenant_facts(request)
                values = tenant_steps.current
                if values is not None:
                    trace.values = values.values_for(trace.tenant_facts)
                traces.arrived(trace.internal_id, trace)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's request path
            warn_once("keeping the request's trace", exc)
        return result

    abort = OutputProcessor.abort_requests

    def abort_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = dict(self.request_states)
        result = abort(self, *args, **kwargs)
        try:
            traces.end(state for rid, state in before.items() if rid not in self.request_states)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's abort path
            warn_once("keeping aborted requests", exc)
        return result

    propagate = OutputProcessor.propagate_error

    def propagate_error(self: Any, e: Any, *args: Any, **kwargs: Any) -> Any:
        # Before vLLM's: it hands the error to every request's stream, which then ends.
        try:
            traces.end(list(self.request_states.values()), ENGINE_DEAD, type(e).__name__)
            _notify()
        except Exception as exc:  # noqa: BLE001 - never into vLLM's error path
            warn_once("keeping the requests of a dead engine", exc)
        return propagate(self, e, *args, **kwargs)

    shutdown = AsyncLLM.shutdown

    def shutdown_llm(self: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM may still finish requests while it stops (draining, or with finish reason abort):
        # those in flight now are marked, and what is left when it has stopped is ended here.
        # vLLM's finalizer shuts an AsyncLLM down again, maybe while another one of the process
        # runs: its stat loggers are not told (they would flush for nothing). A mark on the
        # object, not a weak set: the garbage collector clears weak references before finalizers.
        if getattr(self, SHUT_DOWN_ATTR, False):
            return shutdown(self, *args, **kwargs)
        try:
            setattr(self, SHUT_DOWN_ATTR, True)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's shutdown
            warn_once("marking the AsyncLLM shut down", exc)
        processor = getattr(self, "output_processor", None)
        try:
            for state in list(getattr(processor, "request_states", {}).values()):
                traces.trace_on(state).stopping = True
        except Exception as exc:  # noqa: BLE001 - never into vLLM's shutdown
            warn_once("marking the requests in flight at shutdown", exc)
        try:
            return shutdown(self, *args, **kwargs)
        finally:
            try:
                if processor is not None:
                    traces.end(list(processor.request_states.values()), SHUTDOWN)
                _notify()
            except Exception as exc:  # noqa: BLE001 - never into vLLM's shutdown
                warn_once("keeping the requests in flight at shutdown", exc)

    _wrap(AsyncLLM, "add_request", add_request)
    _wrap(OutputProcessor, "add_request", add_to_processor)
    _wrap(OutputProcessor, "abort_requests", abort_requests)
    _wrap(OutputProcessor, "propagate_error", propagate_error)
    _wrap(AsyncLLM, "shutdown", shutdown_llm)
    return None


def uninstall() -> None:
    """Restore vLLM's methods and forget a failed attempt, the stat loggers listening and the
    requests ended but not yet recorded (tests: a logger of an earlier test, not yet collected,
    would otherwise take the next test's ended requests)."""
    with _lock:
        for owner, name, original in reversed(_state["originals"]):
            setattr(owner, name, original)
        _state.update(installed=False, failed=None, originals=[], values=None)
        tenant_steps.current = None
        _listeners.clear()
        traces.ended.clear()
        traces.lost[0] = 0


def is_installed() -> bool:
    return bool(_state["installed"])
