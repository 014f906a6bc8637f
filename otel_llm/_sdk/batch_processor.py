"""The batch span and log record processors' queue and drop hook (the shared BatchProcessor, SDK
1.41+), for otel_llm.export.accounting to count what they drop.

Queue full: the processor's ``_queue`` is a deque bounded by ``maxlen``; ``emit`` appends to its
left and the deque itself evicts the oldest item when full; the worker thread pops batches from
its right. The processor also calls ``_metrics.drop_items(1)`` when it finds the queue full, but
that is a check before the append: if the worker pops a batch in between, nothing is evicted and
the item is exported as well. So the queue is replaced by :class:`EvictionCountingQueue`, which
counts the evictions themselves.

After shutdown: ``emit`` drops the item and calls ``_metrics.drop_items(1, "already_shutdown")``,
exactly once per item; that hook is wrapped.
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import threading
import weakref
from typing import Any, Callable, Iterable

from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_llm._sdk import require, require_parameters


class EvictionCountingQueue(collections.deque):
    """A bounded deque that calls ``on_evict(1)`` for each item it evicts: an ``appendleft`` onto a
    full queue. The fullness check and the append hold one lock, which ``pop`` holds too, so an
    item popped between them is not taken for an eviction."""

    def __init__(self, items: Iterable[Any], maxlen: int, on_evict: Callable[[int], None]) -> None:
        super().__init__(items, maxlen)
        self._on_evict = on_evict
        self._lock = threading.Lock()
        if hasattr(os, "register_at_fork"):  # the child gets a free lock (a thread may hold it at fork)
            ref = weakref.ref(self)

            def _after_in_child() -> None:
                queue = ref()
                if queue is not None:
                    queue._lock = threading.Lock()

            os.register_at_fork(after_in_child=_after_in_child)

    def appendleft(self, item: Any) -> None:
        with self._lock:
            evicts = len(self) == self.maxlen
            super().appendleft(item)
        if evicts:
            self._on_evict(1)

    def pop(self, *args: Any) -> Any:
        with self._lock:
            return super().pop(*args)


def count_evictions(processor: Any, on_evict: Callable[[int], None]) -> None:
    """Replace ``processor``'s queue by an EvictionCountingQueue calling ``on_evict``."""
    batch = processor._batch_processor
    queue = batch._queue
    batch._queue = EvictionCountingQueue(queue, queue.maxlen, on_evict)


def wrap_drop_hook(processor: Any, wrap: Callable[[Any], Any]) -> None:
    """Replace ``processor``'s drop hook by ``wrap(hook)``."""
    batch = processor._batch_processor
    batch._metrics = wrap(batch._metrics)


def check() -> None:
    processor = BatchSpanProcessor(InMemorySpanExporter(), max_queue_size=8, max_export_batch_size=4)
    try:
        batch = getattr(processor, "_batch_processor", None)
        require(batch is not None, "BatchSpanProcessor._batch_processor exists")
        hook = getattr(batch, "_metrics", None)
        require(hook is not None, "BatchSpanProcessor._batch_processor._metrics exists")
        require_parameters(getattr(hook, "drop_items", None), ["count", "error_type"], "_metrics.drop_items")
        require_parameters(getattr(hook, "finish_items", None), ["count"], "_metrics.finish_items")
        require_parameters(
            getattr(hook, "register_queue_size", None), ["get_queue_size"], "_metrics.register_queue_size"
        )
        queue = getattr(batch, "_queue", None)
        require(
            type(queue) is collections.deque and queue.maxlen == 8,
            "BatchProcessor._queue is a deque bounded by max_queue_size",
        )
        source = inspect.getsource(type(batch))
        require(
            'drop_items(1, "already_shutdown")' in source,
            'the BatchProcessor calls _metrics.drop_items(1, "already_shutdown") on each item dropped after shutdown',
        )
        mutations = sorted(set(_queue_calls(source)))
        require(
            mutations == ["appendleft", "clear", "pop"],
            f"the BatchProcessor adds to its _queue by appendleft and takes from it by pop (and clear); "
            f"found {mutations}",
        )
    finally:
        processor.shutdown()


def _queue_calls(source: str) -> list[str]:
    """The deque methods the source calls on ``self._queue`` (len() aside)."""
    return re.findall(r"self\._queue\.(\w+)\(", source)
