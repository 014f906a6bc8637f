"""Bounds on label values that come from the engine (reasons): cardinality and length."""

from __future__ import annotations

OVERFLOW_LABEL_VALUE = "overflow"

MAX_LABEL_LENGTH = 128


class LabelLimiter:
    """Bounds a user-derived label: at most ``limit`` distinct values (the rest map to
    ``overflow``), each at most MAX_LABEL_LENGTH characters."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if not isinstance(value, str):
            return OVERFLOW_LABEL_VALUE
        value = value[:MAX_LABEL_LENGTH]
        if value not in self._seen:
            if len(self._seen) >= self._limit:
                return OVERFLOW_LABEL_VALUE
            self._seen.add(value)
        return value
