"""The caller's trace context, from the HTTP request or the code that adds a request.

``current_carrier()`` is the W3C carrier of the span current where ``add_request`` is called
(the FastAPI server span when the app is instrumented too, the caller's own span in code).
``transformers serve`` reads no ``traceparent``: :class:`TraceContextMiddleware`, added to its
FastAPI app, makes the context extracted from each request's headers (the global propagator:
W3C trace context by default) current while the request is handled, so ``add_request`` finds it.

Since transformers 5.25 the engine runs in a process of its own, which receives each request
under an id of the API server's making. The API server then sends, with the request's inputs,
the caller's carrier and the request id the client knows (``x-request-id``, or the one
transformers made: :func:`current_request_id`), as attributes of :class:`CarriedInputs`; the
engine process takes them back (:func:`carried`). A consumer that reads the inputs as a plain
dict (an engine process without the instrumentor) never sees them.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, Optional

from opentelemetry import context, propagate, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_w3c = TraceContextTextMapPropagator()
# The ASGI scope's state of the HTTP request being handled: transformers' RequestIdMiddleware
# (inside ours) puts the request's id there.
_request_state: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("otel_llm_request_state", default=None)


def current_carrier() -> Optional[dict[str, str]]:
    """The current span's context as a ``traceparent``/``tracestate`` carrier; None without one."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _w3c.inject(carrier)
    return carrier


def current_request_id() -> Optional[str]:
    """The id of the HTTP request being handled, as transformers serve answers it; None outside one."""
    state = _request_state.get()
    request_id = state.get("request_id") if state is not None else None
    return str(request_id) if request_id else None


class CarriedInputs(dict):
    """A request's inputs on their way to transformers' engine process, carrying what its spans
    need: ``otel_llm`` = (the client's request id, the caller's W3C carrier). Pickled with them."""

    otel_llm: tuple[Optional[str], Optional[dict[str, str]]]


def carrying(inputs: dict) -> dict:
    """``inputs`` as :class:`CarriedInputs` of the current request's id and carrier; ``inputs``
    itself outside an HTTP request with neither."""
    request_id, carrier = current_request_id(), current_carrier()
    if request_id is None and carrier is None:
        return inputs
    carried_inputs = CarriedInputs(inputs)
    carried_inputs.otel_llm = (request_id, carrier)
    return carried_inputs


def carried(inputs: Any) -> tuple[Optional[str], Optional[dict[str, str]]]:
    """What :func:`carrying` put on ``inputs``: (client's request id, carrier), or (None, None)."""
    found = getattr(inputs, "otel_llm", None)
    return found if isinstance(found, tuple) and len(found) == 2 else (None, None)


class TraceContextMiddleware:
    """ASGI middleware: the trace context of each HTTP request's headers, current while it runs."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        state_token = _request_state.set(scope.setdefault("state", {}))
        try:
            headers = {}
            for key, value in scope.get("headers", ()):
                name = key.decode("latin-1").lower()
                if name in ("traceparent", "tracestate"):
                    headers[name] = value.decode("latin-1")
            if not headers:
                await self.app(scope, receive, send)
                return
            token = context.attach(propagate.extract(headers))
            try:
                await self.app(scope, receive, send)
            finally:
                context.detach(token)
        finally:
            _request_state.reset(state_token)
