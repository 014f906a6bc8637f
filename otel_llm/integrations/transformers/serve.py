"""The caller's trace context, from the HTTP request or the code that adds a request.

``current_carrier()`` is the W3C carrier of the span current where ``add_request`` is called
(the FastAPI server span when the app is instrumented too, the caller's own span in code).
``transformers serve`` reads no ``traceparent``: :class:`TraceContextMiddleware`, added to its
FastAPI app, makes the context extracted from each request's headers (the global propagator:
W3C trace context by default) current while the request is handled, so ``add_request`` finds it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from opentelemetry import context, propagate, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_w3c = TraceContextTextMapPropagator()


def current_carrier() -> Optional[dict[str, str]]:
    """The current span's context as a ``traceparent``/``tracestate`` carrier; None without one."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _w3c.inject(carrier)
    return carrier


class TraceContextMiddleware:
    """ASGI middleware: the trace context of each HTTP request's headers, current while it runs."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
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
