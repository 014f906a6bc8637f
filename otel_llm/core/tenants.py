"""Each request's tenant: taken from what its engine hands over, cleaned and bounded.

An engine says what it knows of a request on its ARRIVED event (``RequestEvent.tenant_facts``:
``priority``, ``lora``, ``model``, ``header:<name>`` in lower case), and its caller's W3C carrier
(``trace_context``, whose ``baggage`` entry serves ``baggage:KEY``). The resolver picks the one
value the configured source names. At most ``max_values`` distinct tenants per process get a
label value of their own (the rest are ``other``, said once): the series a label multiplies stay
bounded whatever the traffic sends.
"""

from __future__ import annotations

import dataclasses
import logging
import urllib.parse
from collections.abc import Mapping
from typing import Any, Optional, Sequence

from otel_llm.config import tenants
from otel_llm.config.settings import TelemetryConfig
from otel_llm.config.tenants import TenantSource

_log = logging.getLogger(__name__)
# Never counted against the cap: they are no tenant's name.
_RESERVED = frozenset((tenants.OTHER, tenants.INVALID, tenants.UNSET))


class TenantResolver:
    """``resolve(facts, carrier)``: the request's tenant label value."""

    def __init__(self, source: TenantSource, max_values: int, model_name: str) -> None:
        self.source = source
        self.max_values = max_values
        self._model_name = model_name
        self._seen: set[str] = set()
        self._overflowed = False

    def resolve(self, facts: Optional[Mapping[str, Any]], carrier: Optional[Mapping[str, str]]) -> str:
        # collections.abc.Mapping: isinstance against typing's alias runs Python code per request.
        try:  # whatever an engine hands over, the request gets a tenant (never an exception)
            facts = facts if isinstance(facts, Mapping) else {}
            value = tenants.clean(self._raw(facts, carrier if isinstance(carrier, Mapping) else None))
        except Exception:  # noqa: BLE001 - e.g. a fact whose str() raises
            value = tenants.INVALID
        if value in self._seen or value in _RESERVED:
            return value
        if len(self._seen) >= self.max_values:
            if not self._overflowed:
                self._overflowed = True
                _log.warning(
                    "otel_llm: more than %d distinct tenants (OTEL_LLM_TENANT_MAX_VALUES) from %s: "
                    "the ones beyond are counted as %r",
                    self.max_values,
                    self.source,
                    tenants.OTHER,
                )
            return tenants.OTHER
        self._seen.add(value)
        return value

    def _raw(self, facts: Mapping[str, Any], carrier: Optional[Mapping[str, str]]) -> Any:
        kind = self.source.kind
        if kind == "model":
            return facts.get("model") or self._model_name
        if kind == "lora":  # a base-model request counts as the served model
            return facts.get("lora") or facts.get("model") or self._model_name
        if kind == "priority":
            return facts.get("priority")
        if kind == "header":
            return facts.get(f"header:{self.source.key}")
        return baggage_entry(carrier.get("baggage") if carrier else None, self.source.key)


def baggage_entry(header: Optional[str], key: str) -> Optional[str]:
    """The value of ``key`` in a W3C ``baggage`` header (percent-decoded, properties dropped)."""
    if not header or not isinstance(header, str):
        return None
    for member in header.split(","):
        name, eq, value = member.partition("=")
        if eq and name.strip() == key:
            return urllib.parse.unquote(value.split(";", 1)[0].strip())
    return None


def reachable(config: TelemetryConfig, sources: Optional[Sequence[str]], entry_point: str) -> TelemetryConfig:
    """``config``, or, when its tenant source does not reach ``entry_point`` (whose engine hands
    over ``sources``; None: any), the same without a tenant source, said in one warning."""
    source = config.tenant_source
    if source is None or sources is None or source.kind in sources:
        return config
    _log.warning(
        "otel_llm: OTEL_LLM_TENANT=%s does not reach %s, which hands over %s: no tenant label on any series",
        source,
        entry_point,
        ", ".join(sources) or "no tenant source",
    )
    return dataclasses.replace(config, tenant=None)


def resolver(config: TelemetryConfig) -> Optional[TenantResolver]:
    source = config.tenant_source
    return None if source is None else TenantResolver(source, config.tenant_max_values, config.model_name)
