"""vLLM frontends that call no stat-logger plugin.

vLLM's experimental Rust frontend (``VLLM_USE_RUST_FRONTEND=1``) serves the OpenAI API from a
Rust binary in place of vLLM's Python API server and calls no stat-logger plugin (vLLM issue
#58313): the plugin is loaded (its ``vllm.general_plugins`` entry point runs in vLLM's Python
processes) but its stat logger is never built, so it records nothing. :func:`check` says so,
once per process, when the plugin's general entry point runs.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping

_log = logging.getLogger(__name__)

RUST_FRONTEND_ENV = "VLLM_USE_RUST_FRONTEND"
_warned: list[bool] = []


def rust_frontend(environ: Mapping[str, str] = os.environ) -> bool:
    """The Rust frontend is asked for, by vLLM's own rule (``bool(int(value))``); a value that is
    not a number is vLLM's to reject."""
    try:
        return bool(int(environ.get(RUST_FRONTEND_ENV, "0")))
    except ValueError:
        return False


def check(environ: Mapping[str, str] = os.environ) -> bool:
    """One warning (per process) when the frontend will not call the plugin; True then."""
    if not rust_frontend(environ):
        return False
    if not _warned:
        _warned.append(True)
        _log.warning(
            "otel-llm: %s=1: vLLM's Rust frontend calls no stat-logger plugin (vLLM issue #58313), so "
            "otel-llm records no metric and no span in this server; scrape vLLM's own /metrics with an "
            "OpenTelemetry Collector instead (docs/vllm.md)",
            RUST_FRONTEND_ENV,
        )
    return True
