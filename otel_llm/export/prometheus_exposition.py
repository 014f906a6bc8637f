"""A registry rendered for a scrape: OpenMetrics when the scraper asks for it, else the classic text
format, both by prometheus_client.

``:`` in names survives OpenMetrics: prometheus_client 0.23-0.26
``openmetrics.exposition.generate_latest`` writes each *sample* name through
``_escape(s.name, escaping, _is_legacy_labelname_rune)`` -- the label-name rune set, which has no
``:`` -- under the default ``escaping=underscores``, while ``# HELP``/``# TYPE`` keep it
(client_python #1177). So ``vllm:request_num_preemptions_bucket`` would arrive as
``vllm_request_num_preemptions_bucket``. With ``escaping=allow-utf-8`` the same function leaves
every name that is a valid *legacy* metric name (``[a-zA-Z_:][a-zA-Z0-9_:]*``) as it is; every
name the OTel exporter produces is one (``sanitize_full_name`` maps everything else to ``_``), so
we call it that way, per call, with no global patching (vLLM's own /metrics is untouched). Label
names are sanitized upstream to ``[a-zA-Z0-9_]`` and are legal in either mode.
"""

from __future__ import annotations

import inspect
from typing import Callable

from prometheus_client import CollectorRegistry
from prometheus_client import exposition as text_exposition
from prometheus_client.openmetrics import exposition as om_exposition

OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _openmetrics_renderer() -> Callable[[CollectorRegistry], bytes]:
    params = inspect.signature(om_exposition.generate_latest).parameters
    if "escaping" in params and hasattr(om_exposition, "ALLOWUTF8"):
        return lambda registry: om_exposition.generate_latest(registry, escaping=om_exposition.ALLOWUTF8)
    return om_exposition.generate_latest  # before 0.23: no escaping, `:` kept


_render_openmetrics = _openmetrics_renderer()


def wants_openmetrics(accept: str | None) -> bool:
    for part in (accept or "").split(","):
        if part.split(";")[0].strip().lower() == "application/openmetrics-text":
            return True
    return False


def render(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """Body and content type for a scrape with this Accept header."""
    if wants_openmetrics(accept):
        return _render_openmetrics(registry), OPENMETRICS_CONTENT_TYPE
    return text_exposition.generate_latest(registry), TEXT_CONTENT_TYPE
