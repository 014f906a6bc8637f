"""When ``vllm serve`` is asked to stop, the consumer hears of it before vLLM stops its engine cores.

vLLM's handler of SIGTERM and SIGINT is installed after the plugin loads, so it cannot be chained;
what it changes is the timeout vLLM then passes to its engine managers' ``shutdown``: a number when
it was asked to stop, None when it stops because an engine core or its frontend died. The wrapper
of ``shutdown`` tells the consumer on a number, before the engine cores are stopped (killed at once
under vLLM's default ``shutdown_timeout`` of 0, without their goodbye).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

_log = logging.getLogger("otel_llm.integrations.vllm")

MANAGERS = ("CoreEngineProcManager", "CoreEngineActorManager")  # in vllm.v1.engine.utils
_MARK = "__otel_llm_serve_stop__"


def watch(on_stop: Callable[[], None]) -> bool:
    """Wrap the ``shutdown`` of vLLM's engine managers so that ``on_stop`` runs first when vLLM
    was asked to stop. False (said once) when this vLLM has no such manager: requests in flight
    on an engine core killed at the stop then end marked ``engine_dead``."""
    try:
        from vllm.v1.engine import utils
    except Exception as exc:  # noqa: BLE001 - any import failure: nothing wrapped
        _log.info("otel-llm: vllm.v1.engine.utils is not importable (%r): a stop is told by the engine cores", exc)
        return False
    wrapped = False
    for name in MANAGERS:
        cls = getattr(utils, name, None)
        original = getattr(cls, "shutdown", None)
        if original is None or getattr(original, _MARK, False):
            wrapped = wrapped or original is not None
            continue
        cls.shutdown = _wrapper(original, on_stop)  # type: ignore[union-attr]
        wrapped = True
    if not wrapped:
        _log.info("otel-llm: this vLLM has no %s.shutdown: a stop is told by the engine cores", " or ".join(MANAGERS))
    return wrapped


def _wrapper(original: Callable[..., Any], on_stop: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(original)
    def shutdown(self: Any, timeout: Any = None, *args: Any, **kwargs: Any) -> Any:
        if timeout is not None:
            try:
                on_stop()
            except Exception:  # noqa: BLE001 - never into vLLM's shutdown
                _log.debug("otel-llm: telling the consumer of the stop failed", exc_info=True)
        return original(self, timeout, *args, **kwargs)

    setattr(shutdown, _MARK, True)
    return shutdown
