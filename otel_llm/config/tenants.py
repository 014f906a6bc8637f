"""Tenant sources (``OTEL_LLM_TENANT``) and the values a tenant label may take.

A source names what a request's tenant is taken from: its scheduling ``priority``, its LoRA
adapter (``lora``; a base-model request counts as the served model), the served ``model``, a
request header (``header:NAME``) or a W3C baggage entry of the caller's context (``baggage:KEY``).
Which sources reach which entry point is said once here (:data:`SOURCES_BY_ENTRY_POINT`).
Pure Python: engines and the doctor read it without the SDK.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("priority", "lora", "model", "header", "baggage")
KEYED = ("header", "baggage")  # kinds that name a header or a baggage key after a colon
DEFAULT_MAX_VALUES = 20

# Label values that are no tenant's name.
OTHER = "other"  # beyond the cap of distinct tenants
INVALID = "invalid"  # a value too long or outside printable ASCII (never a secret or a prompt)
UNSET = "unset"  # the request carried no value for the source (e.g. no such header)
NO_CAUSE = "none"  # cause_tenant of a preemption no request caused (cache reset) or of unknown cause
MAX_VALUE_LENGTH = 64

# The sources each entry point's engine hands over per request (what otel-llm doctor reports).
# engine_stub is no HTTP server: no headers; baggage comes with the trace context a caller passes
# to ``add_request``. vLLM's Python frontend ("vllm": its stat logger, with the deep hook) and,
# under its Rust frontend, the engine core's stream ("vllm-engine-core") have each request's
# priority and adapter, and the served model; neither sees a request header (vLLM hands its engine
# only traceparent and tracestate). transformers' requests carry no priority nor adapter:
# ``transformers serve`` sees each request's headers (the named header, the caller's ``baggage``);
# ``generate_batch`` and the batching manager in code see no HTTP request: the model only.
SOURCES_BY_ENTRY_POINT: dict[str, tuple[str, ...]] = {
    "engine_stub": ("priority", "lora", "model", "baggage"),
    "vllm": ("priority", "lora", "model"),
    "vllm-engine-core": ("priority", "lora", "model"),
    "transformers serve": ("model", "header", "baggage"),
    "transformers generate_batch": ("model",),
}

_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP header name (RFC 9110 token)


@dataclass(frozen=True)
class TenantSource:
    """A parsed ``OTEL_LLM_TENANT``: ``kind`` one of :data:`KINDS`; ``key`` the header name
    (lower case) or baggage key, empty for the other kinds."""

    kind: str
    key: str = ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.key}" if self.key else self.kind


def parse_source(text: str) -> TenantSource:
    """``priority``, ``lora``, ``model``, ``header:NAME`` or ``baggage:KEY``; ValueError naming
    the rule otherwise."""
    if not isinstance(text, str):
        raise ValueError("must be a string")
    kind, colon, key = text.strip().partition(":")
    kind, key = kind.strip().lower(), key.strip()
    if kind not in KINDS:
        raise ValueError(f"must be one of priority, lora, model, header:NAME, baggage:KEY (got kind {kind!r})")
    if kind in KEYED:
        if not key or not _TOKEN.match(key):
            raise ValueError(f"{kind}: needs a name after the colon, with no space or separator ({kind}:NAME)")
        return TenantSource(kind, key.lower() if kind == "header" else key)
    if colon:
        raise ValueError(f"{kind} takes no name after a colon")
    return TenantSource(kind)


def clean(value: object) -> str:
    """The label value of a tenant as given by a request: itself when short printable ASCII,
    else ``invalid``; ``unset`` for no value."""
    if value is None or value == "":
        return UNSET
    text = value if isinstance(value, str) else str(value)
    if len(text) > MAX_VALUE_LENGTH or not text.isascii() or not text.isprintable():
        return INVALID
    return text
