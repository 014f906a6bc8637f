"""vLLM drop-in: the ``vllm.stat_logger_plugins`` entry point ``otel_llm =
"otel_llm.integrations.vllm:OtelStatLogger"`` and the ``vllm.general_plugins`` entry point
``otel_llm.integrations.vllm:register`` (the deep hook, on by default; the engine-core stream under
a frontend that calls no stat logger). The sub-packages say where their code runs: ``frontend``
(the process facing clients), ``engine_core``, ``channels`` between them, ``translation`` (vLLM's
structures, read one way for both) and ``series`` (vLLM's own series). See
:mod:`otel_llm.integrations.vllm.frontend.stat_logger`, docs/vllm.md and docs/vllm-internals.md."""

from typing import Any

from otel_llm.integrations.vllm.handle import reset, use_handle
from otel_llm.integrations.vllm.translation.fields import FieldReader

__all__ = ["OtelStatLogger", "FieldReader", "register", "use_handle", "reset"]


def __getattr__(name: str) -> Any:
    # Lazy: the stat logger derives from vLLM's base, so vLLM is imported only when it is asked for;
    # the deep hook's module is loaded only when vLLM's plugin loader asks for ``register``.
    if name == "OtelStatLogger":
        from otel_llm.integrations.vllm.frontend import stat_logger

        return stat_logger.OtelStatLogger
    if name == "register":
        from otel_llm.integrations.vllm.frontend import deep_hook

        return deep_hook.register
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
