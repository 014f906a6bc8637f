"""The caller's trace context and tenant, from the HTTP request or the code that adds a request.

``current_carrier()`` is the W3C carrier of the span current where ``add_request`` is called
(the FastAPI server span when the app is instrumented too, the caller's own span in code).
``transformers serve`` reads no ``traceparent``: :class:`TraceContextMiddleware`, added to its
FastAPI app, makes the context extracted from each request's headers (the global propagator:
W3C trace context by default) current while the request is handled, so ``add_request`` finds it.
With a ``header:NAME`` or ``baggage:KEY`` tenant source it also reads that one header (``baggage``
for the latter) and keeps, for the request, the named header's value as a tenant fact, or the
named baggage entry as the carrier's ``baggage`` (that entry alone); either cleaned at once
(``otel_llm.config.tenants.clean``: at most 64 printable ASCII characters, else ``invalid``), so
what is held per request stays small. No other header, and nothing of the body, is read.

Since transformers 5.25 the engine runs in a process of its own, which receives each request
under an id of the API server's making. The API server then sends, with the request's inputs,
the caller's carrier, the request's tenant facts and the request id the client knows
(``x-request-id``, or the one transformers made: :func:`current_request_id`), as attributes of
:class:`CarriedInputs`; the engine process takes them back (:func:`carried`). A consumer that
reads the inputs as a plain dict (an engine process without the instrumentor) never sees them.
"""

from __future__ import annotations

import contextvars
import urllib.parse
from typing import Any, Callable, NamedTuple, Optional

from opentelemetry import context, propagate, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_llm.config import tenants
from otel_llm.config.tenants import TenantSource
from otel_llm.core.tenants import baggage_entry

_w3c = TraceContextTextMapPropagator()
# The ASGI scope's state of the HTTP request being handled: transformers' RequestIdMiddleware
# (inside ours) puts the request's id there.
_request_state: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("otel_llm_request_state", default=None)


class RequestTenant(NamedTuple):
    """What the tenant source found in one HTTP request's headers, cleaned: tenant facts
    (``{"header:<name>": value}``) or the named baggage entry alone (``KEY=value``)."""

    facts: Optional[dict[str, str]] = None
    baggage: Optional[str] = None


_request_tenant: contextvars.ContextVar[Optional[RequestTenant]] = contextvars.ContextVar(
    "otel_llm_request_tenant", default=None
)


def current_carrier() -> Optional[dict[str, str]]:
    """The current span's context as a ``traceparent``/``tracestate`` carrier, with the HTTP
    request's named baggage entry; None with neither."""
    carrier: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        _w3c.inject(carrier)
    found = _request_tenant.get()
    if found is not None and found.baggage is not None:
        carrier["baggage"] = found.baggage
    return carrier or None


def current_tenant_facts() -> Optional[dict[str, str]]:
    """The tenant facts of the HTTP request being handled (its named header); None outside one."""
    found = _request_tenant.get()
    return found.facts if found is not None else None


def request_tenant(source: TenantSource, value: str) -> Optional[RequestTenant]:
    """What ``value``, the header that ``source`` reads (``baggage`` for a baggage source), gives:
    cleaned (a header value or baggage entry too long or not printable ASCII: ``invalid``); None
    for a baggage without the entry."""
    if source.kind == "header":
        return RequestTenant(facts={f"header:{source.key}": tenants.clean(value)})
    entry = baggage_entry(value, source.key)
    if entry is None:
        return None
    return RequestTenant(baggage=f"{source.key}={urllib.parse.quote(tenants.clean(entry), safe='')}")


def current_request_id() -> Optional[str]:
    """The id of the HTTP request being handled, as transformers serve answers it; None outside one."""
    state = _request_state.get()
    request_id = state.get("request_id") if state is not None else None
    return str(request_id) if request_id else None


class Carried(NamedTuple):
    """What a request's spans and series need from the API server: the client's request id, the
    caller's W3C carrier, the request's tenant facts."""

    request_id: Optional[str] = None
    carrier: Optional[dict[str, str]] = None
    tenant_facts: Optional[dict[str, str]] = None


class CarriedInputs(dict):
    """A request's inputs on their way to transformers' engine process, carrying ``otel_llm``
    (:class:`Carried`). Pickled with them."""

    otel_llm: Carried


def carrying(inputs: dict) -> dict:
    """``inputs`` as :class:`CarriedInputs` of the current request's id, carrier and tenant facts;
    ``inputs`` itself outside an HTTP request with none of them."""
    found = Carried(current_request_id(), current_carrier(), current_tenant_facts())
    if found == Carried():
        return inputs
    carried_inputs = CarriedInputs(inputs)
    carried_inputs.otel_llm = found
    return carried_inputs


def carried(inputs: Any) -> Carried:
    """What :func:`carrying` put on ``inputs``; all None when nothing."""
    found = getattr(inputs, "otel_llm", None)
    return found if isinstance(found, Carried) else Carried()


class TraceContextMiddleware:
    """ASGI middleware: the trace context of each HTTP request's headers current while it runs,
    and its tenant (``tenant``: the tenant source; a source no header serves reads nothing)."""

    def __init__(self, app: Callable[..., Any], tenant: Optional[TenantSource] = None) -> None:
        self.app = app
        self._tenant = tenant if tenant is not None and tenant.kind in tenants.KEYED else None
        self._tenant_header: Optional[str] = None  # the one header the tenant is read from
        if self._tenant is not None:
            self._tenant_header = self._tenant.key if self._tenant.kind == "header" else "baggage"

    async def __call__(self, scope: dict, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        state_token = _request_state.set(scope.setdefault("state", {}))
        tenant_token = None
        try:
            headers: dict[str, str] = {}
            tenant_values: list[str] = []
            for key, value in scope.get("headers", ()):
                name = key.decode("latin-1").lower()
                if name in ("traceparent", "tracestate"):
                    headers[name] = value.decode("latin-1")
                if name == self._tenant_header:
                    tenant_values.append(value.decode("latin-1"))
            if tenant_values and self._tenant is not None:
                # A header sent twice: the first value; baggage sent twice: one list (W3C).
                value = ",".join(tenant_values) if self._tenant.kind == "baggage" else tenant_values[0]
                try:
                    found = request_tenant(self._tenant, value)
                except Exception:  # noqa: BLE001 - never into the server: the request's tenant is unset
                    found = None
                tenant_token = _request_tenant.set(found)
            if not headers:
                await self.app(scope, receive, send)
                return
            token = context.attach(propagate.extract(headers))
            try:
                await self.app(scope, receive, send)
            finally:
                context.detach(token)
        finally:
            if tenant_token is not None:
                _request_tenant.reset(tenant_token)
            _request_state.reset(state_token)
