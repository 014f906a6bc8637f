"""Plugins: callables registered in the entry-point group ``engine_stub.plugins``.

Each is called once with the engine at start-up (``plugin(engine)``), so that installing a
package (otel-llm registers ``otel``) instruments the engine with no code change. Whatever a
plugin returns that has a ``shutdown()`` is shut down by ``Engine.shutdown()``.
``ENGINE_STUB_PLUGINS`` filters by entry-point name: unset loads all, "" loads none.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points
from typing import Any

GROUP = "engine_stub.plugins"
ENV_VAR = "ENGINE_STUB_PLUGINS"

_log = logging.getLogger(__name__)


def selected_names() -> set[str] | None:
    """Names allowed by ``ENGINE_STUB_PLUGINS``; None means every installed plugin."""
    value = os.environ.get(ENV_VAR)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def load_plugins(engine: Any) -> list[tuple[str, Any]]:
    """Call every selected plugin with ``engine``; return (name, result) of those that ran.

    A plugin that fails to import or raises is logged and skipped: never fatal to the engine.
    """
    allowed = selected_names()
    loaded: list[tuple[str, Any]] = []
    for ep in sorted(entry_points(group=GROUP), key=lambda ep: ep.name):
        if allowed is not None and ep.name not in allowed:
            continue
        try:
            result = ep.load()(engine)
        except Exception:  # noqa: BLE001 - a broken plugin must not stop the engine
            _log.exception("engine_stub plugin %r (%s) failed; skipped", ep.name, ep.value)
            continue
        loaded.append((ep.name, result))
    return loaded
