"""The middleware `transformers serve` gets (TraceContextMiddleware), on ASGI requests of given
headers: what a request's handler finds of its tenant, the headers it reads, and the same through
the pickling that takes a request's inputs to the engine process (test_serve_tenants: end to end)."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any, Optional

from otel_llm.config.tenants import parse_source
from otel_llm.integrations.transformers.serve import (
    Carried,
    TraceContextMiddleware,
    carried,
    carrying,
    current_carrier,
    current_tenant_facts,
)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def handled(source: Optional[str], headers: list[tuple[str, str]]) -> tuple[Any, Any, Carried]:
    """(carrier, tenant facts) as the handler of a request with ``headers`` finds them, and what
    its inputs carry to the engine process after a pickle round trip."""
    found: list[Any] = []

    async def app(scope: dict, receive: Any, send: Any) -> None:
        scope["state"]["request_id"] = "http-1"  # what transformers' RequestIdMiddleware does
        inputs = pickle.loads(pickle.dumps(carrying({"input_ids": [1, 2]})))
        found.extend((current_carrier(), current_tenant_facts(), carried(inputs)))

    middleware = TraceContextMiddleware(app, parse_source(source) if source else None)
    scope = {"type": "http", "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]}

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    async def send(message: dict) -> None:
        pass

    asyncio.run(middleware(scope, receive, send))
    carrier, facts, carried_along = found
    return carrier, facts, carried_along


def test_the_named_header_its_first_value_cleaned() -> None:
    carrier, facts, along = handled("header:X-Team", [("X-TEAM", "acme"), ("x-team", "globex"), ("x-other", "o")])
    assert (carrier, facts) == (None, {"header:x-team": "acme"})
    assert along == Carried("http-1", None, {"header:x-team": "acme"})
    _, facts, _ = handled("header:x-team", [("x-team", "a" * 65)])
    assert facts == {"header:x-team": "invalid"}
    _, facts, _ = handled("header:x-team", [("x-team", "zürich")])
    assert facts == {"header:x-team": "invalid"}
    carrier, facts, along = handled("header:x-team", [("x-other", "o")])  # no such header: unset downstream
    assert (carrier, facts, along) == (None, None, Carried("http-1", None, None))


def test_the_named_baggage_entry_alone_beside_the_trace_context() -> None:
    headers = [("traceparent", TRACEPARENT), ("baggage", "user=alice, team=globex%20corp;ttl=60"), ("baggage", "s=1")]
    carrier, facts, along = handled("baggage:team", headers)
    assert carrier == {"traceparent": TRACEPARENT, "baggage": "team=globex%20corp"} and facts is None
    assert along == Carried("http-1", carrier, None)
    carrier, _, _ = handled("baggage:team", [("baggage", "user=alice"), ("baggage", "team=" + "x" * 65)])
    assert carrier == {"baggage": "team=invalid"}  # a second baggage header is part of the same list
    carrier, _, _ = handled("baggage:team", [("traceparent", TRACEPARENT), ("baggage", "user=alice")])
    assert carrier == {"traceparent": TRACEPARENT}


def test_a_source_no_header_serves_reads_none() -> None:
    for source in (None, "priority", "model"):
        carrier, facts, _ = handled(source, [("x-team", "acme"), ("baggage", "team=acme")])
        assert (carrier, facts) == (None, None), source
