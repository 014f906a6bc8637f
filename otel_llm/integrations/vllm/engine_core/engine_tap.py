"""In vLLM's engine core, for a frontend that calls no stat-logger plugin (the Rust frontend): the
engine-core stream handed over, as built, to the process where the telemetry lives
(:mod:`.stream_consumer`), over :mod:`.stream_channel`: to its engine's own consumer process when
the serve started one (several local engines), else to the serve's.

What the engine core pays, and where:

- its busy loop, per request added: one ``deque.append`` of vLLM's ``Request`` object (a wrapper
  of ``EngineCore.add_request``); nothing is read there;
- its busy loop, per abort (``EngineCore.abort_requests``: a client gone, a stop string the
  frontend found, an explicit abort): the ids the scheduler still had unfinished, written at once
  with their time, after the requests added before them (the output thread may be idle: no
  output would carry them); vLLM sends its frontend nothing for such a request;
- its output thread, at its start: who it is (engine index, served model, ``max_model_len``,
  vLLM's custom histogram buckets), said first on every connection; per output message: the bytes
  vLLM has just encoded for its frontend (``EngineCoreProc._send_msg_tracking_payload``), its
  first buffer sent as one frame straight from vLLM's memory (copied only past a full socket), the
  requests added since (their id, arrival time, prompt length, ``max_tokens``, trace headers,
  priority, LoRA adapter name) read and written before them, one non-blocking send; never an
  OpenTelemetry call, never an exception into vLLM;
- its shutdown: a goodbye, after the backlog, waiting for it at most :data:`BYE_FLUSH_S`.

Nothing is sent before the output thread has started, nor after the engine core said goodbye.
Attached by structure (:func:`shape_problem`), whatever vLLM's version; where a check fails, one
warning names it and nothing is wrapped.
"""

from __future__ import annotations

import collections
import inspect
import logging
import threading
import time
from typing import Any, Callable, Optional

from otel_llm.integrations.vllm.channels import stream_channel
from otel_llm.integrations.vllm.translation.translate import custom_buckets

_log = logging.getLogger("otel_llm.integrations.vllm")

MAX_WAITING_REQUESTS = 65_536  # requests added and not yet written; more are lost, counted
BYE_FLUSH_S = 1.0  # the engine core's shutdown waits this long at most for its backlog to be read
OUTPUT_FIELDS = ("engine_index", "outputs", "scheduler_stats", "timestamp", "finished_requests")
OUTPUT_ITEM_FIELDS = ("request_id", "new_token_ids", "finish_reason", "events", "trace_headers", "prefill_stats")

_added: "collections.deque[Any]" = collections.deque()
_state: dict[str, Any] = {"tap": None, "originals": [], "warned": set()}


def _warn_once(what: str, message: str) -> None:
    if what not in _state["warned"]:
        _state["warned"].add(what)
        _log.warning("otel-llm engine-core stream: %s", message)


def _params(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters) if callable(function) else []


def shape_problem() -> Optional[str]:
    """Why the stream cannot be handed over from this vLLM's engine core, or None."""
    try:
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
        from vllm.v1.engine.core import EngineCore, EngineCoreProc
    except Exception as exc:  # noqa: BLE001 - any import failure: no stream
        return f"vLLM's engine core is not importable ({exc!r})"
    missing = [f for f in OUTPUT_FIELDS if f not in getattr(EngineCoreOutputs, "__struct_fields__", ())]
    missing += [f for f in OUTPUT_ITEM_FIELDS if f not in getattr(EngineCoreOutput, "__struct_fields__", ())]
    if missing:
        return f"EngineCoreOutputs / EngineCoreOutput have no {', '.join(missing)}"
    if _params(getattr(EngineCore, "add_request", None))[:2] != ["self", "request"]:
        return "EngineCore.add_request(self, request, ...) not found"
    if _params(getattr(EngineCore, "abort_requests", None))[:2] != ["self", "request_ids"]:
        return "EngineCore.abort_requests(self, request_ids) not found"
    if _params(getattr(EngineCoreProc, "process_output_sockets", None))[-1:] != ["engine_index"]:
        return "EngineCoreProc.process_output_sockets(self, ..., engine_index), its output thread, not found"
    send = inspect.getattr_static(EngineCoreProc, "_send_msg_tracking_payload", None)
    if not isinstance(send, staticmethod) or _params(send.__func__) != ["socket", "buffers"]:
        return "EngineCoreProc._send_msg_tracking_payload(socket, buffers), a staticmethod, not found"
    if not callable(getattr(EngineCore, "shutdown", None)):
        return "EngineCore.shutdown not found"
    return None


class _Tap:
    """Frames to the consumer, from the output thread and, for aborts, the busy loop (a lock)."""

    def __init__(self, folder: str) -> None:
        self.sender = stream_channel.Sender(folder)
        self.hello: Optional[bytes] = None  # said first on each connection; None until the output thread starts
        self.lock = threading.Lock()
        self.closed = False  # the engine core said goodbye: nothing more is sent
        self.lost_requests = 0  # the busy loop's count of requests it could not keep (only it writes it)
        self._lost_told = 0  # the part of it already written

    def forward(self, buffers: Any) -> None:
        """The output thread: one output message as vLLM encoded it (its first buffer, not copied)."""
        with self.lock:
            self._send(*stream_channel.outputs_parts(buffers))

    def aborted(self, request_ids: list[str], at: float) -> None:
        """The busy loop: requests the scheduler finished as aborted, at ``at`` (its monotonic clock)."""
        with self.lock:
            self._send(stream_channel.json_frame(stream_channel.ABORTED, [at, request_ids]))

    def _send(self, *frame: Any) -> None:
        if self.closed or self.hello is None:
            return
        requests = self._requests()
        parts = (requests, *frame) if requests else frame
        if not self.sender.connected:
            parts = (self.hello, *parts)  # a new connection: the consumer learns who we are first
        self.sender.send(*parts)

    def _requests(self) -> bytes:
        rows: list[list[Any]] = []
        while _added:
            request = _added.popleft()
            params = getattr(request, "sampling_params", None)
            max_tokens = getattr(params, "max_tokens", None)
            headers = getattr(request, "trace_headers", None)
            priority = getattr(request, "priority", None)
            lora = getattr(getattr(request, "lora_request", None), "lora_name", None)
            rows.append(
                [
                    str(request.request_id),
                    float(request.arrival_time),
                    len(request.prompt_token_ids or ()),
                    max_tokens if isinstance(max_tokens, int) else 0,
                    dict(headers) if headers else None,
                    priority if isinstance(priority, int) else None,  # the tenant facts the engine core has
                    str(lora) if lora else None,
                ]
            )
        lost = self.lost_requests - self._lost_told
        if lost:
            rows.append(["lost", lost])
            self._lost_told += lost
        return stream_channel.json_frame(stream_channel.REQUESTS, rows) if rows else b""

    def bye(self) -> None:
        """Goodbye, after what the backlog still holds (waiting for it at most BYE_FLUSH_S)."""
        with self.lock:
            if self.sender.connected and not self.closed:
                self.sender.send(stream_channel.frame(stream_channel.BYE, b""))
                self.sender.flush(BYE_FLUSH_S)
            self.sender.close()
            self.closed = True


def install(folder: str) -> bool:
    """Wrap the engine core's hand-over points (idempotent); False, with one warning, when the
    shape does not hold."""
    if _state["tap"] is not None:
        return True
    problem = shape_problem()
    if problem is not None:
        _warn_once("shape", f"not attached ({problem}): otel-llm records nothing under this frontend")
        return False
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    tap = _state["tap"] = _Tap(folder)
    add, abort, output_thread, send, shutdown = (
        EngineCore.add_request,
        EngineCore.abort_requests,
        EngineCoreProc.process_output_sockets,
        EngineCoreProc._send_msg_tracking_payload,
        EngineCore.shutdown,
    )

    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        # Kept before vLLM adds it: an abort inside (``abort_immediately``) then follows its row.
        if len(_added) < MAX_WAITING_REQUESTS:
            _added.append(request)
        else:
            tap.lost_requests += 1
        return add(self, request, *args, **kwargs)

    def abort_requests(self: Any, request_ids: Any, *args: Any, **kwargs: Any) -> Any:
        live = _unfinished(self, request_ids)
        result = abort(self, request_ids, *args, **kwargs)
        if live:
            try:
                tap.aborted(live, time.monotonic())
            except Exception as exc:  # noqa: BLE001 - never into vLLM's busy loop
                _warn_once("abort", f"handing an abort over failed ({exc!r}); what follows is still tried")
        return result

    def process_output_sockets(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine_index = kwargs["engine_index"] if "engine_index" in kwargs else args[-1]
        tap.hello = _hello(self, engine_index)
        tap.sender.engine = _index(engine_index)
        return output_thread(self, *args, **kwargs)

    def send_msg_tracking_payload(socket: Any, buffers: Any) -> Any:
        tracker = send(socket, buffers)
        try:
            tap.forward(buffers)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's output thread
            _warn_once("forward", f"handing an output over failed ({exc!r}); what follows is still tried")
        return tracker

    def shutdown_core(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            tap.bye()
        except Exception as exc:  # noqa: BLE001 - never into vLLM's shutdown
            _warn_once("bye", f"telling the consumer of a clean shutdown failed ({exc!r})")
        return shutdown(self, *args, **kwargs)

    _replace(EngineCore, "add_request", add_request)
    _replace(EngineCore, "abort_requests", abort_requests)
    _replace(EngineCoreProc, "process_output_sockets", process_output_sockets)
    _replace(EngineCoreProc, "_send_msg_tracking_payload", staticmethod(send_msg_tracking_payload))
    _replace(EngineCore, "shutdown", shutdown_core)
    return True


def _unfinished(core: Any, request_ids: Any) -> list[str]:
    """The ids among ``request_ids`` that the scheduler has and has not finished: those an abort
    ends (one for a request already finished, or never added, changes nothing)."""
    ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
    try:
        requests = core.scheduler.requests
        return [rid for rid in ids if (r := requests.get(rid)) is not None and not r.is_finished()]
    except Exception as exc:  # noqa: BLE001 - never into vLLM's busy loop: every id, the consumer sorts them
        _warn_once("unfinished", f"reading which aborted requests were unfinished failed ({exc!r})")
        return [str(rid) for rid in ids]


def _hello(core: Any, engine_index: Any) -> bytes:
    """Who this engine core is: its index, served model name, ``max_model_len`` and vLLM's custom
    histogram buckets (the settings its telemetry takes from vLLM, read where vLLM's config is)."""
    hello: dict[str, Any] = {"engine": 0, "model": "", "max_model_len": None, "custom_histogram_buckets": {}}
    try:
        hello["custom_histogram_buckets"] = custom_buckets(core.vllm_config)
        model_config = core.vllm_config.model_config
        served = model_config.served_model_name
        max_len = getattr(model_config, "max_model_len", None)
        hello.update(
            engine=int(engine_index),
            model=str(served[0] if isinstance(served, (list, tuple)) and served else served),
            max_model_len=max_len if isinstance(max_len, int) and max_len >= 1 else None,
        )
    except Exception as exc:  # noqa: BLE001 - never into vLLM's output thread
        _warn_once("hello", f"reading the engine's index, model name, length and buckets failed ({exc!r})")
    return stream_channel.json_frame(stream_channel.HELLO, hello)


def _index(engine_index: Any) -> Optional[int]:
    try:
        return int(engine_index)
    except (TypeError, ValueError):
        return None


def _replace(owner: type, name: str, wrapper: Callable[..., Any]) -> None:
    original = inspect.getattr_static(owner, name)
    _state["originals"].append((owner, name, original))
    setattr(owner, name, wrapper)


def uninstall() -> None:
    """Restore vLLM's methods (tests)."""
    for owner, name, original in reversed(_state["originals"]):
        setattr(owner, name, original)
    _state.update(tap=None, originals=[], warned=set())
    _added.clear()
