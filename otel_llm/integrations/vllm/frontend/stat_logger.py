"""vLLM drop-in: a ``vllm.stat_logger_plugins`` entry point (``otel_llm``).

Installed next to vLLM, otel-llm is loaded by ``AsyncLLM`` (``vllm serve``) through the entry
point ``otel_llm = "otel_llm.integrations.vllm:OtelStatLogger"``. vLLM hands it, per engine
step, its ``SchedulerStats`` and ``IterationStats``; the adapter
(:mod:`otel_llm.integrations.vllm.frontend.adapter`) translates them into the core telemetry
(:class:`otel_llm.EngineTelemetry`): the same metrics as vLLM's own Prometheus logger
(under the same names with the ``vllm`` naming profile), plus OTLP push, exemplars, the
``le=0.5`` never-preempted bucket and one ``llm_request`` span per finished request.

vLLM is imported lazily, here only: ``import otel_llm`` / ``import otel_llm.integrations`` never
imports vLLM. vLLM says its stats classes are not a stable interface, so every field is read
through :class:`~otel_llm.integrations.vllm.translation.fields.FieldReader`: a missing, renamed or retyped
field degrades only the metrics that need it, with one warning; nothing raises into vLLM
(``record()`` is wrapped).

Settings (environment; see docs/vllm.md): the standard ``OTEL_*`` variables through
:func:`otel_llm.setup_telemetry`, ``OTEL_LLM_*`` through :meth:`TelemetryConfig.from_env`
(``OTEL_LLM_MODEL_NAME`` overrides vLLM's served model name), and
``OTEL_LLM_VLLM_DEEP_HOOK=0`` to turn off the deep hook (per-preemption events and causes, on by
default: :mod:`otel_llm.integrations.vllm.frontend.deep_hook`), and ``OTEL_LLM_VLLM_METRICS``: ``replace``
(default) answers vLLM's own ``/metrics`` in place of vLLM's Prometheus logger
(:mod:`otel_llm.integrations.vllm.frontend.replace`), ``add`` records beside it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from otel_llm.export.settings_check import refused
from otel_llm.integrations.vllm import package
from otel_llm.integrations.vllm.frontend.adapter import VllmAdapter

_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs


# What vLLM's classes look like to this module, resolved once, lazily (vLLM imported here only).
_base_cache: dict[str, Any] = {}


def _vllm_bases() -> tuple[type, ...]:
    """``AggregateStatLoggerBase`` (vLLM >= 0.11: one logger for every DP engine), else
    ``StatLoggerBase`` (built once per engine index by vLLM's adapter)."""
    if "bases" not in _base_cache:
        from vllm.v1.metrics import loggers

        base = getattr(loggers, "AggregateStatLoggerBase", None) or loggers.StatLoggerBase
        _base_cache["bases"] = (base,)
    return _base_cache["bases"]


_reported: set[tuple[str, str]] = set()


def _report(method: str, exc: Exception) -> None:
    """A stat-logger call failed: logged once per (method, exception type), never raised into vLLM."""
    key = (method, type(exc).__name__)
    if key not in _reported:
        _reported.add(key)
        _log.error("otel-llm vLLM adapter: %s failed (reported once per error type)", method, exc_info=exc)


def _guard(method: Callable) -> Callable:
    """Never let an exception reach vLLM: log it once per (method, exception type)."""

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - nothing raises into vLLM from a stat-logger call
            _report(method.__name__, exc)
            return None

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


_logger_classes: dict[bool, type] = {}


def _make_logger_class(replace: bool = False) -> type:
    if replace not in _logger_classes:
        add = _logger_classes.get(False) or _make_adding_class()
        _logger_classes[False] = add
        if replace:
            _logger_classes[True] = _make_replacing_class(add)
    return _logger_classes[replace]


def _make_adding_class() -> type:
    (base,) = _vllm_bases()

    class OtelStatLogger(base):  # type: ignore[valid-type, misc]  # a base class found at run time
        """vLLM stat logger that records into OpenTelemetry (see the module docstring).

        Built by vLLM's ``StatLoggerManager`` as ``OtelStatLogger(vllm_config=...,
        engine_indexes=[...])`` (aggregate logger: one provider set, one EngineTelemetry per
        data-parallel engine index), or ``OtelStatLogger(vllm_config, engine_index)`` by older
        vLLMs' per-engine adapter.
        """

        def __init__(
            self, vllm_config: Any, engine_indexes: Any = None, engine_index: Any = None, **kwargs: Any
        ) -> None:
            if engine_indexes is None:
                engine_indexes = [engine_index if isinstance(engine_index, int) else 0]
            elif isinstance(engine_indexes, int):
                engine_indexes = [engine_indexes]
            self.engine_indexes = list(engine_indexes)
            self.vllm_config = vllm_config
            self._impl: Optional[VllmAdapter] = None
            if refused(_log, "vLLM adapter", "vLLM serves on"):
                return
            try:
                # vLLM's StatLoggerManager builds its own Prometheus logger beside this class;
                # replace mode's class builds it itself where it does not replace it.
                self._impl = VllmAdapter(
                    vllm_config, self.engine_indexes, replace=self.replaces_vllm_logger, beside_vllm_logger=True
                )
            except ValueError as exc:  # a bad setting (OTEL_*, OTEL_LLM_*): its name and the rule, one line
                _log.error("otel-llm vLLM adapter: telemetry disabled, vLLM serves on: %s", exc)
            except Exception:  # noqa: BLE001 - whatever else fails at start must not stop vLLM from serving
                _log.exception("otel-llm vLLM adapter: telemetry disabled, it could not start")

        replaces_vllm_logger = False  # replace mode's class: True

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            # Guarded inline, not by @_guard: vLLM calls it each engine step, one call fewer.
            if self._impl is not None:
                try:
                    self._impl.record(scheduler_stats, iteration_stats, engine_idx, mm_cache_stats)
                except Exception as exc:  # noqa: BLE001 - nothing raises into vLLM from a stat-logger call
                    _report("record", exc)

        @_guard
        def log_engine_initialized(self) -> None:
            if self._impl is not None:
                self._impl.call_series("log_engine_initialized")
                _log.info(
                    "otel-llm: recording vLLM stats for model %r, engines %s (deep hook %s)%s",
                    self._impl.config.model_name,
                    self.engine_indexes,
                    "on" if self._impl.deep_hook else "off",
                    package.unproven_note(),
                )

        @_guard
        def log(self) -> None:
            # Metrics are pulled by readers / pushed by the periodic exporter; vLLM calls this
            # every few seconds, also when no request runs: the steps kept and the spans of
            # aborted requests go out.
            if self._impl is not None:
                self._impl.logged()

        @_guard
        def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
            if self._impl is not None:
                self._impl.call_series("record_sleep_state", *args, **kwargs)

        @_guard
        def record_admission_rejection(self, reason: str) -> None:
            if self._impl is not None:
                self._impl.call_series("record_admission_rejection", reason)

        @property
        def telemetry(self) -> dict[int, Any]:
            """The :class:`otel_llm.EngineTelemetry` per engine index."""
            return dict(self._impl.telemetry) if self._impl is not None else {}

        @property
        def handle(self) -> Any:
            """The :class:`otel_llm.TelemetryHandle` it records into (None when disabled)."""
            return self._impl.handle if self._impl is not None else None

        @property
        def field_warnings(self) -> frozenset[tuple[str, str]]:
            return self._impl.reader.warned if self._impl is not None else frozenset()

    OtelStatLogger.__module__ = __name__
    OtelStatLogger.__qualname__ = "OtelStatLogger"
    return OtelStatLogger


def _make_replacing_class(adding: Any) -> type:
    """Replace mode: a ``PrometheusStatLogger`` by class (its constructor never run), so that
    vLLM's StatLoggerManager builds none of its own beside it. Where the plugin cannot stand in
    for it (:func:`.replace.obstacle`, or the plugin off), it builds vLLM's and hands it
    every call first, as vLLM would: add mode."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class OtelStatLogger(adding, PrometheusStatLogger):
        replaces_vllm_logger = True

        def __init__(
            self, vllm_config: Any, engine_indexes: Any = None, engine_index: Any = None, **kwargs: Any
        ) -> None:
            adding.__init__(self, vllm_config, engine_indexes, engine_index, **kwargs)
            self.vllm_logger: Optional[PrometheusStatLogger] = None
            if self._impl is None or not self._impl.replacing:
                self.vllm_logger = PrometheusStatLogger(vllm_config, self.engine_indexes)

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            if self.vllm_logger is not None:
                self.vllm_logger.record(
                    scheduler_stats, iteration_stats, mm_cache_stats=mm_cache_stats, engine_idx=engine_idx
                )
            adding.record(self, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)

        def log_engine_initialized(self) -> None:
            if self.vllm_logger is not None:
                self.vllm_logger.log_engine_initialized()
            adding.log_engine_initialized(self)

        def log(self) -> None:
            if self.vllm_logger is not None:
                self.vllm_logger.log()
            adding.log(self)

        def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
            if self.vllm_logger is not None:
                self.vllm_logger.record_sleep_state(*args, **kwargs)
            adding.record_sleep_state(self, *args, **kwargs)

        def record_admission_rejection(self, reason: str) -> None:
            if self.vllm_logger is not None:
                self.vllm_logger.record_admission_rejection(reason)
            adding.record_admission_rejection(self, reason)

    OtelStatLogger.__module__ = __name__
    OtelStatLogger.__qualname__ = "OtelStatLogger"
    return OtelStatLogger


def stat_logger_class() -> type:
    """The stat-logger class for the mode ``OTEL_LLM_VLLM_METRICS`` asks for (replace unless
    ``add``): replace mode's where this vLLM leaves its own logger out for it, else add mode's
    (:mod:`.replace`)."""
    from otel_llm.integrations.vllm.frontend import replace as vllm_replace

    replace = vllm_replace.requested() and vllm_replace.structure_obstacle() is None
    return _make_logger_class(replace)


def __getattr__(name: str) -> Any:
    # Lazy: the class derives from vLLM's base, so vLLM is imported only when it is asked for
    # (by vLLM's entry-point loader, or by a user); the mode is read at each lookup.
    if name == "OtelStatLogger":
        return stat_logger_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
