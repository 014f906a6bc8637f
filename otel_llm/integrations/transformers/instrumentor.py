"""TransformersInstrumentor: the ``BaseInstrumentor`` for transformers' continuous batching.

``instrument(config=..., meter_provider=..., tracer_provider=...)`` wraps the names of
:mod:`.internals` whose checks hold (one warning names any that does not, and what degrades; a
transformers release outside :data:`.package._instruments` is instrumented as far as the checks
allow, with one warning); ``uninstrument()`` restores every one of them, ends the spans of the
requests still in flight, marked incomplete, and returns how many there were. Every wrapper
calls transformers' own method exactly once and returns its result; the telemetry's work around
it never raises into transformers (a failure is logged once and stops the telemetry of that
engine, not the engine).

Telemetry: one ``EngineTelemetry`` per model (label ``model_name`` / ``gen_ai.request.model``: the
model's ``name_or_path`` unless the config or ``OTEL_LLM_MODEL_NAME`` names one), on the providers
given, or else on the providers that :func:`otel_llm.setup_telemetry` builds from the environment
at the first engine step. Defaults for transformers: naming profile ``semconv`` and
``gen_ai.provider.name`` ``transformers`` (``OTEL_LLM_NAMING`` / ``OTEL_LLM_PROVIDER_NAME`` win).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import weakref
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Collection, Optional

try:
    from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
except ModuleNotFoundError as exc:  # the one thing the [transformers] extra adds
    raise ModuleNotFoundError(
        f"otel_llm.integrations.transformers needs opentelemetry-instrumentation ({exc.name} is missing): "
        "pip install 'otel-llm[transformers]'",
        name=exc.name,
    ) from None

from otel_llm.integrations.transformers import internals
from otel_llm.integrations.transformers.observer import BatchObserver, starved_ids
from otel_llm.integrations.transformers.package import _instruments
from otel_llm.integrations.transformers.serve import (
    TraceContextMiddleware,
    carried,
    carrying,
    current_carrier,
    current_tenant_facts,
)

_log = logging.getLogger(__name__)

PROVIDER_NAME = "transformers"  # gen_ai.provider.name: which engine served (docs/transformers.md)
MAX_CARRIERS = 65_536  # trace contexts, tenant facts, client request ids held until the engine sees the request
# The entry points (otel_llm.config.tenants.SOURCES_BY_ENTRY_POINT): a process that runs
# `transformers serve` sees each request's headers; code calling generate_batch or the manager does not.
SERVE = "transformers serve"
IN_CODE = "transformers generate_batch"


class _Telemetry:
    """The telemetry of each model, built on first use (on transformers' generation thread)."""

    def __init__(self, config: Any, meter_provider: Any, tracer_provider: Any) -> None:
        self.config = config
        self.providers = (meter_provider, tracer_provider)
        self.handle: Any = None  # what setup_telemetry built, when no provider was given
        self.by_model: dict[str, Any] = {}
        self.entry_point = IN_CODE  # SERVE once this process is known to run transformers serve
        self._lock = threading.Lock()

    def for_model(self, model_name: str) -> Any:
        from otel_llm.config.tenants import SOURCES_BY_ENTRY_POINT
        from otel_llm.core.telemetry import EngineTelemetry
        from otel_llm.export.setup import setup_telemetry

        name = model_name if self.config.model_name == "unknown" and model_name else self.config.model_name
        with self._lock:
            telemetry = self.by_model.get(name)
            if telemetry is None:
                config = dataclasses.replace(self.config, model_name=name)
                meter_provider, tracer_provider = self.providers
                entry_point = self.entry_point
                sources = SOURCES_BY_ENTRY_POINT[entry_point]
                if meter_provider is not None or tracer_provider is not None:
                    telemetry = EngineTelemetry(
                        config,
                        meter_provider=meter_provider,
                        tracer_provider=tracer_provider,
                        tenant_sources=sources,
                        entry_point=entry_point,
                    )
                elif self.handle is None:
                    self.handle = setup_telemetry(
                        config, port_taken="warn", tenant_sources=sources, entry_point=entry_point
                    )
                    telemetry = self.handle.telemetry
                else:
                    telemetry = self.handle.new_telemetry(model_name=name)
                self.by_model[name] = telemetry
            return telemetry

    def shutdown(self) -> int:
        """Ends every model's telemetry (in-flight spans ended, marked incomplete) before the
        providers it built are flushed; the number of requests that were in flight."""
        with self._lock:
            telemetries, self.by_model = list(self.by_model.values()), {}
            handle, self.handle = self.handle, None
        in_flight = sum(telemetry.shutdown() for telemetry in telemetries)
        if handle is not None:
            handle.shutdown()
        return in_flight


class _Instrumentation:
    """What one ``instrument()`` installed: the wrappers, the observers, the telemetry."""

    def __init__(self, telemetry: _Telemetry, originals: dict[str, Callable[..., Any]]) -> None:
        self.telemetry = telemetry
        self.originals = originals
        self.installed: list[tuple[Any, str, Any]] = []  # (holder, attribute, original)
        self.observers: weakref.WeakKeyDictionary[Any, Optional[BatchObserver]] = weakref.WeakKeyDictionary()
        self.carriers: dict[str, dict[str, str]] = {}
        self.tenant_facts: dict[str, dict[str, str]] = {}  # request id -> its HTTP request's tenant facts
        # transformers' request id -> the client's, for requests an API server sent this engine process.
        self.client_ids: dict[str, str] = {}
        self.current = threading.local()  # the observer of the engine call running on this thread
        self.active = True
        self._failed: set[str] = set()

    # -- helpers for the wrappers ---------------------------------------------------------

    def observer(self, processor: Any) -> Optional[BatchObserver]:
        router = processor.output_router
        try:
            return self.observers[router]
        except KeyError:
            pass
        config = getattr(processor, "config", None)
        model = getattr(config, "name_or_path", "") or ""
        telemetry = self.telemetry.for_model(str(model))
        observer = BatchObserver(
            telemetry, self.carriers, telemetry.config.max_inflight_requests, self.client_ids, self.tenant_facts
        )
        self.observers[router] = observer
        return observer

    def failed(self, where: str, router: Any = None) -> None:
        """The telemetry's own code raised: that engine's telemetry stops (its events would be
        inconsistent from here on); logged once per place."""
        if router is not None:
            try:
                self.observers[router] = None
            except TypeError:
                pass
        if where not in self._failed:
            self._failed.add(where)
            _log.exception(
                "otel-llm transformers instrumentation: %s raised; this engine's telemetry stops, "
                "transformers is unaffected (logged once)",
                where,
            )

    def wrap(self, key: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = self.originals.get(key)
        if original is None:
            return
        holder = internals.BY_KEY[key].holder()
        wrapper = functools.wraps(original)(make(original))
        wrapper.__otel_llm_original__ = original  # type: ignore[attr-defined]  # marks our wrapper, for tests
        setattr(holder, internals.BY_KEY[key].attribute, wrapper)
        self.installed.append((holder, internals.BY_KEY[key].attribute, original))

    def restore(self) -> None:
        self.active = False
        while self.installed:
            holder, attribute, original = self.installed.pop()
            setattr(holder, attribute, original)

    # -- the wrappers ---------------------------------------------------------------------

    def install(self) -> None:
        self.wrap("prepare_next_batch", self._prepare_next_batch)
        self.wrap("update_batch", self._update_batch)
        self.wrap("add_waiting_request", self._add_waiting_request)
        self.wrap("offload_requests", self._offload_requests)
        self.wrap("clear_cancelled_requests", self._clear_cancelled_requests)
        self.wrap("fail_and_deliver", self._fail_and_deliver)
        self.wrap("add_request", self._add_request)
        self.wrap("build_server", self._build_server)
        self.wrap("send_request", self._send_request)
        self.wrap("runner_generate", self._runner_generate)
        self.wrap("runner_init", self._runner_init)

    def _engine_call(self, original: Callable[..., Any], after: Callable[[BatchObserver, Any, Any], None]) -> Any:
        """A ContinuousBatchProcessor method: its observer is current on this thread during the
        call (the scheduler's and offloading manager's wrappers find it there)."""

        def wrapper(processor: Any, *args: Any, **kwargs: Any) -> Any:
            observer = None
            if self.active:
                try:
                    observer = self.observer(processor)
                except Exception:  # noqa: BLE001 - never into transformers
                    self.failed("building the telemetry", processor.output_router)
            outer = getattr(self.current, "observer", None)
            self.current.observer = observer
            try:
                result = original(processor, *args, **kwargs)
            finally:
                self.current.observer = outer
            if observer is not None and self.active:
                try:
                    after(observer, processor, result)
                except Exception:  # noqa: BLE001 - never into transformers
                    self.failed(original.__qualname__, processor.output_router)
            return result

        return wrapper

    def _prepare_next_batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        return self._engine_call(original, lambda obs, processor, result: obs.batch_prepared(processor, bool(result)))

    def _update_batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        return self._engine_call(original, lambda obs, processor, _: obs.batch_updated(processor))

    def _add_waiting_request(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def add_waiting_request(scheduler: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(scheduler, state, *args, **kwargs)
            observer = getattr(self.current, "observer", None)
            if observer is not None:
                try:
                    observer.queued(state)
                except Exception:  # noqa: BLE001 - never into transformers
                    self._drop_current("Scheduler.add_waiting_request")
            return result

        return add_waiting_request

    def _offload_requests(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def offload_requests(manager: Any, *args: Any, **kwargs: Any) -> Any:
            observer = getattr(self.current, "observer", None)
            before = starved = None
            if observer is not None:
                try:
                    before = dict(manager.scheduler.active_requests)
                    starved = starved_ids(manager.scheduler)  # popped in place: the causes are left
                except Exception:  # noqa: BLE001 - never into transformers
                    self._drop_current("OffloadingManager.offload_requests")
            result = original(manager, *args, **kwargs)
            observer = getattr(self.current, "observer", None)
            if observer is not None and before is not None:
                try:
                    observer.offloaded(before, manager.scheduler, starved)
                except Exception:  # noqa: BLE001 - never into transformers
                    self._drop_current("OffloadingManager.offload_requests")
            return result

        return offload_requests

    def _clear_cancelled_requests(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def clear_cancelled_requests(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(scheduler, *args, **kwargs)
            observer = getattr(self.current, "observer", None)
            if observer is not None and result:
                try:
                    observer.cancelled(result)
                except Exception:  # noqa: BLE001 - never into transformers
                    self._drop_current("Scheduler.clear_cancelled_requests")
            return result

        return clear_cancelled_requests

    def _fail_and_deliver(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def fail_and_deliver(router: Any, state: Any, error: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(router, state, error, *args, **kwargs)
            if self.active:
                try:
                    observer = self.observers.get(router)
                    if observer is not None:
                        observer.failed(state)
                        if getattr(self.current, "observer", None) is not observer:
                            observer.publish()  # outside an engine call (a stop, a fatal error): now
                except Exception:  # noqa: BLE001 - never into transformers
                    self.failed("OutputRouter.fail_and_deliver", router)
            return result

        return fail_and_deliver

    def _add_request(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def add_request(manager: Any, input_ids: Any, request_id: Any = None, *args: Any, **kwargs: Any) -> Any:
            carrier = facts = None
            if self.active:
                try:
                    carrier, facts = current_carrier(), current_tenant_facts()
                    if carrier is not None or facts is not None:
                        if request_id is None:  # the id transformers would give it, taken first
                            with manager._request_lock:
                                request_id = f"req_{manager._request_counter}"
                                manager._request_counter += 1
                        if carrier is not None:
                            _keep(self.carriers, request_id, carrier)
                        if facts is not None:
                            _keep(self.tenant_facts, request_id, facts)
                except Exception:  # noqa: BLE001 - never into transformers
                    self.failed("ContinuousBatchingManager.add_request (trace context)")
            result = original(manager, input_ids, request_id, *args, **kwargs)
            if (carrier is not None or facts is not None) and result is None:
                # refused (manager stopping): never reaches the engine
                self.carriers.pop(request_id, None)
                self.tenant_facts.pop(request_id, None)
            return result

        return add_request

    def _build_server(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def build_server(*args: Any, **kwargs: Any) -> Any:
            self.telemetry.entry_point = SERVE  # before 5.25 its engine runs in this process
            app = original(*args, **kwargs)
            if self.active:
                try:
                    app.add_middleware(TraceContextMiddleware, tenant=self.telemetry.config.tenant_source)
                except Exception:  # noqa: BLE001 - never into transformers
                    self.failed("transformers serve's build_server (traceparent middleware)")
            return app

        return build_server

    def _send_request(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """In a transformers serve API server: a request's inputs sent to the engine process carry
        the client's request id and the caller's trace context (.serve.CarriedInputs)."""

        async def send_request(client: Any, method: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
            if self.active and method == "generate":
                try:
                    if isinstance(args, tuple) and args and isinstance(args[0], dict):
                        args = (carrying(args[0]), *args[1:])
                except Exception:  # noqa: BLE001 - never into transformers
                    self.failed("EngineClient._send_request (trace context)")
            return await original(client, method, args, *rest, **kwargs)

        return send_request

    def _runner_generate(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """In transformers serve's engine process: what the API server sent along, kept for the
        request's span (its client's id, the caller's carrier)."""

        def generate(runner: Any, request_id: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self.active:
                try:
                    found = carried(inputs)
                    for kept, value in (
                        (self.client_ids, found.request_id),
                        (self.carriers, found.carrier),
                        (self.tenant_facts, found.tenant_facts),
                    ):
                        if value is not None:
                            _keep(kept, str(request_id), value)
                except Exception:  # noqa: BLE001 - never into transformers
                    self.failed("CBGenerateRunner.generate (trace context)")
            return original(runner, request_id, inputs, *args, **kwargs)

        return generate

    def _runner_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """transformers serve's engine process (5.25 on): known as serving before its batching
        manager starts, so that its telemetry takes the sources of HTTP requests."""

        def init(runner: Any, *args: Any, **kwargs: Any) -> Any:
            self.telemetry.entry_point = SERVE
            return original(runner, *args, **kwargs)

        return init

    def _drop_current(self, where: str) -> None:
        observer = getattr(self.current, "observer", None)
        self.current.observer = None
        for router, candidate in list(self.observers.items()):
            if candidate is observer:
                self.failed(where, router)
                return
        self.failed(where)


def _keep(kept: dict[str, Any], request_id: str, value: Any) -> None:
    """``kept[request_id] = value``, the oldest forgotten past :data:`MAX_CARRIERS`."""
    if len(kept) >= MAX_CARRIERS:
        kept.pop(next(iter(kept)), None)
    kept[request_id] = value


class TransformersInstrumentor(BaseInstrumentor):
    """Instrument transformers' continuous batching: ``TransformersInstrumentor().instrument()``.

    Keyword arguments of ``instrument``: ``config`` (a :class:`otel_llm.TelemetryConfig`; default
    from the environment), ``meter_provider`` and ``tracer_provider`` (default: built by
    :func:`otel_llm.setup_telemetry` from the environment, and shut down by ``uninstrument``).
    """

    _instrumentation: Optional[_Instrumentation] = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _check_dependency_conflicts(self) -> Any:
        """transformers missing: nothing to instrument (the standard conflict). Installed but
        outside the range: not a conflict here; ``_instrument`` wraps what passes its checks."""
        conflict = super()._check_dependency_conflicts()
        return conflict if conflict is not None and _installed() is None else None

    def _instrument(self, **kwargs: Any) -> None:
        from otel_llm.export.settings_check import refused

        # Checked even with a config given: the exporters read the standard variables.
        if refused(_log, "transformers instrumentation", "transformers runs on"):
            return
        config = kwargs.get("config") or _config_from_env()
        originals, unmet = internals.unmet()
        if any(internals.degrades(key) == internals.REQUIRED for key in unmet):
            # All or nothing: the engine's events come from these together.
            originals = {k: f for k, f in originals.items() if internals.degrades(k) != internals.REQUIRED}
        installed = _installed()
        outside = installed is not None and not _in_range(installed)
        if unmet or outside:
            lost = {internals.degrades(key) for key in unmet}
            _log.warning(
                "otel-llm transformers instrumentation: transformers %s%s; %s",
                installed,
                f" is outside the tested range ({', '.join(_instruments)})" if outside else "",
                "what does not hold:\n"
                + "\n".join(f"- {internals.name(key)}: {why}" for key, why in unmet.items())
                + "\nso: "
                + ("; ".join(sorted(lost)) if internals.REQUIRED not in lost else internals.REQUIRED)
                if unmet
                else "every check holds: instrumented",
            )
        instrumentation = _Instrumentation(
            _Telemetry(config, kwargs.get("meter_provider"), kwargs.get("tracer_provider")), originals
        )
        instrumentation.install()
        TransformersInstrumentor._instrumentation = instrumentation

    def _uninstrument(self, **kwargs: Any) -> int:
        """Restores transformers' methods, then ends the spans of the requests in flight; returns
        how many there were (``uninstrument()`` passes it on)."""
        instrumentation, TransformersInstrumentor._instrumentation = TransformersInstrumentor._instrumentation, None
        if instrumentation is None:
            return 0
        instrumentation.restore()
        return instrumentation.telemetry.shutdown()

    @property
    def telemetry(self) -> dict[str, Any]:
        """model name -> its ``EngineTelemetry``, for tests and for code that flushes it."""
        instrumentation = TransformersInstrumentor._instrumentation
        return dict(instrumentation.telemetry.by_model) if instrumentation is not None else {}


def _config_from_env() -> Any:
    from otel_llm.config.settings import TelemetryConfig

    return TelemetryConfig.from_env(defaults={"naming": "semconv", "provider_name": PROVIDER_NAME})


def _installed() -> Optional[str]:
    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def _in_range(installed: str) -> bool:
    from packaging.requirements import Requirement

    return all(Requirement(spec).specifier.contains(installed, prereleases=True) for spec in _instruments)
