"""vLLM drop-in: the ``vllm.stat_logger_plugins`` entry point ``otel_llm =
"otel_llm.integrations.vllm:OtelStatLogger"`` and the deep hook, on by default (``vllm.general_plugins``).
See :mod:`otel_llm.integrations.vllm.stat_logger`, docs/vllm.md and docs/vllm-internals.md."""

from typing import Any

from otel_llm.integrations.vllm.fields import FieldReader
from otel_llm.integrations.vllm.handle import reset, use_handle

__all__ = ["OtelStatLogger", "FieldReader", "use_handle", "reset"]


def __getattr__(name: str) -> Any:
    # Lazy: the class derives from vLLM's base, so vLLM is imported only when it is asked for.
    if name == "OtelStatLogger":
        from otel_llm.integrations.vllm import stat_logger

        return stat_logger.OtelStatLogger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
