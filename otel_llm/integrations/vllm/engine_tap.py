"""In vLLM's engine core, for a frontend that calls no stat-logger plugin (the Rust frontend): the
engine-core stream handed over, as built, to the process where the telemetry lives
(:mod:`.stream_consumer`), over :mod:`.stream_channel`.

What the engine core pays, and where:

- its busy loop, per request added: one ``deque.append`` of vLLM's ``Request`` object (a wrapper
  of ``EngineCore.add_request``); nothing is read there;
- its output thread, per output message: the bytes vLLM has just encoded for its frontend
  (``EngineCoreProc._send_msg_tracking_payload``) copied into one frame, the requests added since
  (their id, arrival time, prompt length, ``max_tokens``, trace headers) read and written before
  them, one non-blocking send; never an OpenTelemetry call, never an exception into vLLM.

Attached by structure (:func:`shape_problem`), whatever vLLM's version; where a check fails, one
warning names it and nothing is wrapped.
"""

from __future__ import annotations

import collections
import inspect
import logging
import threading
from typing import Any, Callable, Optional

from otel_llm.integrations.vllm import stream_channel

_log = logging.getLogger("otel_llm.integrations.vllm")

MAX_WAITING_REQUESTS = 65_536  # requests added and not yet written; more are lost, counted
OUTPUT_FIELDS = ("engine_index", "outputs", "scheduler_stats", "timestamp", "finished_requests")
OUTPUT_ITEM_FIELDS = ("request_id", "new_token_ids", "finish_reason", "events", "trace_headers", "prefill_stats")

_added: "collections.deque[Any]" = collections.deque()
_state: dict[str, Any] = {"tap": None, "originals": [], "warned": set()}


def _warn_once(what: str, message: str) -> None:
    if what not in _state["warned"]:
        _state["warned"].add(what)
        _log.warning("otel-llm engine-core stream: %s", message)


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
    add = getattr(EngineCore, "add_request", None)
    if add is None or list(inspect.signature(add).parameters)[:2] != ["self", "request"]:
        return "EngineCore.add_request(self, request, ...) not found"
    send = inspect.getattr_static(EngineCoreProc, "_send_msg_tracking_payload", None)
    if not isinstance(send, staticmethod) or list(inspect.signature(send.__func__).parameters) != [
        "socket",
        "buffers",
    ]:
        return "EngineCoreProc._send_msg_tracking_payload(socket, buffers), a staticmethod, not found"
    if not callable(getattr(EngineCore, "shutdown", None)):
        return "EngineCore.shutdown not found"
    return None


class _Tap:
    """The output thread's side: frames to the consumer (a lock: ``bye`` comes from elsewhere)."""

    def __init__(self, folder: str) -> None:
        self.sender = stream_channel.Sender(folder)
        self.hello: Optional[bytes] = None
        self.lock = threading.Lock()
        self.lost_requests = 0

    def forward(self, buffers: Any) -> None:
        with self.lock:
            connected = self.sender.connected
            data = self._requests() + stream_channel.outputs_frame(buffers)
            if not connected and self.hello is not None:
                data = self.hello + data  # a new connection: the consumer learns who we are first
            self.sender.send(data)

    def _requests(self) -> bytes:
        rows = []
        while _added:
            request = _added.popleft()
            params = getattr(request, "sampling_params", None)
            max_tokens = getattr(params, "max_tokens", None)
            headers = getattr(request, "trace_headers", None)
            rows.append(
                [
                    str(request.request_id),
                    float(request.arrival_time),
                    len(request.prompt_token_ids or ()),
                    max_tokens if isinstance(max_tokens, int) else 0,
                    dict(headers) if headers else None,
                ]
            )
        if self.lost_requests:
            rows.append(["lost", self.lost_requests])
            self.lost_requests = 0
        return stream_channel.json_frame(stream_channel.REQUESTS, rows) if rows else b""

    def bye(self) -> None:
        with self.lock:
            if self.sender.connected:
                self.sender.send(stream_channel.frame(stream_channel.BYE, b""))
            self.sender.close()


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
    add, send, shutdown = (
        EngineCore.add_request,
        EngineCoreProc._send_msg_tracking_payload,
        EngineCore.shutdown,
    )

    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = add(self, request, *args, **kwargs)
        if tap.hello is None:
            _hello(tap, self)
        if len(_added) < MAX_WAITING_REQUESTS:
            _added.append(request)
        else:
            tap.lost_requests += 1
        return result

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
    _replace(EngineCoreProc, "_send_msg_tracking_payload", staticmethod(send_msg_tracking_payload))
    _replace(EngineCore, "shutdown", shutdown_core)
    return True


def _hello(tap: _Tap, core: Any) -> None:
    try:
        model = core.vllm_config.model_config.served_model_name
        index = getattr(core, "engine_index", 0)
        tap.hello = stream_channel.json_frame(stream_channel.HELLO, {"engine": int(index), "model": str(model)})
    except Exception as exc:  # noqa: BLE001 - never into vLLM's busy loop
        tap.hello = stream_channel.json_frame(stream_channel.HELLO, {"engine": 0, "model": ""})
        _warn_once("hello", f"reading the engine's index and model name failed ({exc!r})")


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
