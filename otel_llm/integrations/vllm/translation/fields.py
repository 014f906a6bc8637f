"""Reading vLLM's stats objects: vLLM says its stats classes are not a stable interface, so every
field is read through :class:`FieldReader`: a missing, renamed or retyped field degrades only the
metrics that need it, with one warning."""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Optional

_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs

MISSING = object()
_NUMBERS = frozenset({int, float})


class FieldReader:
    """Reads fields of vLLM's stats objects, warning once per field that is gone or retyped.

    ``number(obj, "field", "metric")`` returns the value when it is a real number (bool and
    NaN excluded), else ``None`` after one warning naming the class, the field and the metric
    that degrades; ``sequence`` does the same for lists of numbers.
    """

    def __init__(self, logger: logging.Logger = _log) -> None:
        self._logger = logger
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @property
    def warned(self) -> frozenset[tuple[str, str]]:
        return frozenset(self._warned)

    def warn_once(self, owner: str, field: str, message: str) -> None:
        key = (owner, field)
        if key in self._warned:
            return
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        self._logger.warning("otel-llm vLLM adapter: %s.%s %s", owner, field, message)

    def raw(self, obj: Any, field: str, metric: str) -> Any:
        """The attribute, or ``MISSING`` (after one warning) when it is absent or fails."""
        try:
            return getattr(obj, field)
        except AttributeError:
            self.warn_once(type(obj).__name__, field, f"is missing (vLLM changed its stats?): {metric} is not recorded")
        except Exception as exc:  # noqa: BLE001 - a property that raises
            self.warn_once(type(obj).__name__, field, f"cannot be read ({exc!r}): {metric} is not recorded")
        return MISSING

    def number(self, obj: Any, field: str, metric: str) -> Optional[float]:
        value: Any = getattr(obj, field, MISSING)  # Any: mypy does not narrow by type(value) in _NUMBERS
        if type(value) in _NUMBERS and value == value:  # the common case, checked once per step: NaN != NaN
            return value
        value = self.raw(obj, field, metric)
        if value is MISSING:
            return None
        if value is None:
            return None  # documented as optional by vLLM (e.g. max_tokens_param)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (isinstance(value, float) and math.isnan(value))
        ):
            self.warn_once(
                type(obj).__name__, field, f"has an unexpected value {value!r} (not a number): {metric} is not recorded"
            )
            return None
        return value

    def sequence(self, obj: Any, field: str, metric: str) -> tuple[float, ...]:
        value = self.raw(obj, field, metric)
        if value is MISSING or value is None:
            return ()
        try:
            items = tuple(value)
        except TypeError:
            self.warn_once(type(obj).__name__, field, f"is not a list ({value!r}): {metric} is not recorded")
            return ()
        if not _NUMBERS.issuperset(map(type, items)) and not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in items
        ):
            self.warn_once(type(obj).__name__, field, f"holds non-numbers: {metric} is not recorded")
            return tuple(v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool))
        return items
