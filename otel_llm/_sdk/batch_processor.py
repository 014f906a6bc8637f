"""The batch span and log record processors' drop hook: the shared BatchProcessor (SDK 1.41+)
reports each dropped item to its ``_metrics`` (``drop_items(count, error_type)``; error_type
``already_shutdown`` after shutdown, queue full otherwise). otel_llm.accounting stands in for it
to count the drops."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from . import require, require_parameters


def wrap_drop_hook(processor: Any, wrap: Callable[[Any], Any]) -> None:
    """Replace ``processor``'s drop hook by ``wrap(hook)``."""
    batch = processor._batch_processor
    batch._metrics = wrap(batch._metrics)


def check() -> None:
    processor = BatchSpanProcessor(InMemorySpanExporter())
    try:
        batch = getattr(processor, "_batch_processor", None)
        require(batch is not None, "BatchSpanProcessor._batch_processor exists")
        hook = getattr(batch, "_metrics", None)
        require(hook is not None, "BatchSpanProcessor._batch_processor._metrics exists")
        require_parameters(getattr(hook, "drop_items", None), ["count", "error_type"], "_metrics.drop_items")
        require_parameters(getattr(hook, "finish_items", None), ["count"], "_metrics.finish_items")
        require_parameters(getattr(hook, "register_queue_size", None), ["get_queue_size"],
                           "_metrics.register_queue_size")
        source = inspect.getsource(type(batch))
        require('drop_items(1, "already_shutdown")' in source and "drop_items(1)" in source,
                "the BatchProcessor calls _metrics.drop_items on each item dropped after shutdown or on a full queue")
    finally:
        processor.shutdown()
