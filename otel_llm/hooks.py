"""The hook bus that engines embed: fans events out to subscribers, isolates their failures.

No OpenTelemetry import here. A subscriber is any object with ``on_events(events)`` and/or
``on_step(stats)``; the bus binds those methods once at subscription so that publishing costs
one call per subscriber per step.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from otel_llm.events import RequestEvent, StepStats

__all__ = ["HookBus"]

_log = logging.getLogger(__name__)


class HookBus:
    """Publish one batch of request events and one :class:`StepStats` per engine step.

    A subscriber that raises never reaches the engine: the error is counted per subscriber
    (``errors``) and logged once per subscriber.
    """

    def __init__(self) -> None:
        self._subscribers: list[Any] = []
        self._event_handlers: tuple[tuple[Any, Callable[[Sequence[RequestEvent]], None]], ...] = ()
        self._step_handlers: tuple[tuple[Any, Callable[[StepStats], None]], ...] = ()
        self.errors: dict[str, int] = {}

    @property
    def active(self) -> bool:
        """True when someone listens: engines may skip building events otherwise."""
        return bool(self._subscribers)

    def subscribe(self, subscriber: Any) -> Any:
        on_events = getattr(subscriber, "on_events", None)
        on_step = getattr(subscriber, "on_step", None)
        if not callable(on_events) and not callable(on_step):
            raise TypeError(f"{subscriber!r} has neither on_events() nor on_step()")
        if subscriber not in self._subscribers:
            self._subscribers.append(subscriber)
            self._rebind()
        return subscriber

    def unsubscribe(self, subscriber: Any) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)
            self._rebind()

    def _rebind(self) -> None:
        # Tuples rebuilt on (rare) subscription changes: publishing iterates a stable snapshot.
        self._event_handlers = tuple(
            (s, s.on_events) for s in self._subscribers if callable(getattr(s, "on_events", None))
        )
        self._step_handlers = tuple((s, s.on_step) for s in self._subscribers if callable(getattr(s, "on_step", None)))

    def publish(self, events: Sequence[RequestEvent]) -> None:
        for subscriber, handler in self._event_handlers:
            try:
                handler(events)
            except Exception:  # noqa: BLE001 - a subscriber must never break the engine
                self._failed(subscriber)

    def publish_step(self, stats: StepStats) -> None:
        for subscriber, handler in self._step_handlers:
            try:
                handler(stats)
            except Exception:  # noqa: BLE001 - a subscriber's failure never reaches the engine
                self._failed(subscriber)

    def _failed(self, subscriber: Any) -> None:
        name = f"{type(subscriber).__module__}.{type(subscriber).__qualname__}"
        count = self.errors.get(name, 0) + 1
        self.errors[name] = count
        if count == 1:
            _log.exception("subscriber %s raised; isolated from the engine (logged once)", name)
