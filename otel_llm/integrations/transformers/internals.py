"""transformers' continuous-batching names that the instrumentor wraps, all of them, each with its check.

transformers has no hook, metric or per-request count for its continuous batching, so the
instrumentor wraps internal methods (not a stable interface). Each :class:`Target` names one,
the parameters relied on, the subclasses that must not override it, and what the telemetry loses
when its check fails. :func:`check` verifies a target on the installed transformers and raises
:class:`~otel_llm._sdk.ContractError` naming what did not hold; :func:`check_request_state`
does the same for the fields of ``RequestState`` that the observer reads.

The observer also reads, at run time and guarded: ``Scheduler.active_requests`` /
``waiting_requests``, ``PagedAttentionCache.compute_free_capacity()`` (KV-cache usage), the
batch's ``FutureRequestState.query_length`` (tokens per step), the model config's
``name_or_path`` (the model label) and ``Scheduler.starved_requests`` (the causes of evictions:
``observer.starved_ids``, unknown when it is not as relied on).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from otel_llm._sdk import ContractError, require, require_parameters

CB = "transformers.generation.continuous_batching"
REQUIRED = "no telemetry at all for continuous batching"


@dataclass(frozen=True)
class Target:
    key: str
    module: str
    owner: str  # class name; "" for a module-level function
    attribute: str
    parameters: tuple[str, ...]  # leading parameters, self aside
    degrades: str  # what the telemetry loses when the check fails
    # An import failure, or a module without the owner class, means "not in this release or not
    # installed": skipped silently.
    optional_module: bool = False

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.owner + '.' if self.owner else ''}{self.attribute}"

    def holder(self) -> Any:
        module = importlib.import_module(self.module)
        if not self.owner:
            return module
        if self.optional_module and not hasattr(module, self.owner):
            raise ImportError(f"{self.module} has no {self.owner}")
        return getattr(module, self.owner)


# transformers serve since 5.25: its engine in a process of its own (request ids of the API server's
# making; the caller's carrier and the client's request id sent along: .serve.CarriedInputs).
ENGINE_PROCESS = (
    "`transformers serve` with its engine in a process of its own: request spans are trace roots named by "
    "transformers' internal request ids"
)
TARGETS: tuple[Target, ...] = (
    Target(
        "prepare_next_batch", f"{CB}.continuous_api", "ContinuousBatchProcessor", "prepare_next_batch", (), REQUIRED
    ),
    Target("update_batch", f"{CB}.continuous_api", "ContinuousBatchProcessor", "update_batch", (), REQUIRED),
    Target("add_waiting_request", f"{CB}.scheduler", "Scheduler", "add_waiting_request", ("state",), REQUIRED),
    Target("offload_requests", f"{CB}.offloading_manager", "OffloadingManager", "offload_requests", (), REQUIRED),
    Target(
        "clear_cancelled_requests",
        f"{CB}.scheduler",
        "Scheduler",
        "clear_cancelled_requests",
        (),
        "cancelled requests are not seen: no finish reason abort, their spans end at uninstrument()",
    ),
    Target(
        "fail_and_deliver",
        f"{CB}.continuous_api",
        "OutputRouter",
        "fail_and_deliver",
        ("state", "error"),
        "failed requests are not seen: no finish reason error, their spans end at uninstrument()",
    ),
    Target(
        "add_request",
        f"{CB}.continuous_api",
        "ContinuousBatchingManager",
        "add_request",
        ("input_ids", "request_id"),
        "request spans are not children of the caller's trace context",
    ),
    Target(
        "build_server",
        "transformers.cli.serving.server",
        "",
        "build_server",
        (),
        "`transformers serve` does not read the traceparent header: request spans are trace roots",
        optional_module=True,
    ),
    Target(
        "send_request",
        "transformers.cli.serving.model_manager",
        "EngineClient",
        "_send_request",
        ("method", "args"),
        ENGINE_PROCESS,
        optional_module=True,
    ),
    Target(
        "runner_generate",
        "transformers.cli.serving.utils",
        "CBGenerateRunner",
        "generate",
        ("request_id", "inputs"),
        ENGINE_PROCESS,
        optional_module=True,
    ),
    Target(
        "runner_init",
        "transformers.cli.serving.utils",
        "CBGenerateRunner",
        "__init__",
        (),
        "`transformers serve` with its engine in a process of its own: a header:NAME or baggage:KEY tenant "
        "source is refused there",
        optional_module=True,
    ),
)
BY_KEY = {t.key: t for t in TARGETS}


def check(target: Target) -> Callable[..., Any]:
    """The original function of ``target``, after checking that its shape holds."""
    holder = target.holder()
    original = vars(holder).get(target.attribute)
    require(callable(original), f"{target.qualname} exists")
    require_parameters(original, target.parameters, target.qualname)
    if inspect.isclass(holder):
        for sub in _subclasses(holder):
            require(
                target.attribute not in vars(sub),
                f"{sub.__module__}.{sub.__qualname__} does not override {target.attribute}",
            )
    return original


def _subclasses(cls: type) -> list[type]:
    found: list[type] = []
    todo: list[type] = list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        found.append(sub)
        todo.extend(sub.__subclasses__())
    return found


def check_request_state() -> None:
    """``RequestState`` and ``RequestStatus`` have the fields the observer reads."""
    requests = importlib.import_module(f"{CB}.requests")
    status: Any = getattr(requests, "RequestStatus", None)
    require(
        status is not None and all(hasattr(status, n) for n in ("PENDING", "FINISHED", "FAILED")),
        f"{CB}.requests.RequestStatus has PENDING, FINISHED, FAILED",
    )
    require(int(status.FAILED) > int(status.FINISHED), "RequestStatus.FAILED > FINISHED (terminal states last)")
    state = requests.RequestState(request_id="contract", initial_tokens=[1, 2], max_new_tokens=3, eos_token_id=0)
    for name, kind in (
        ("request_id", str),
        ("initial_tokens", list),
        ("generated_tokens", list),
        ("position_offset", int),
        ("created_time", float),
        ("max_new_tokens", int),
    ):
        require(isinstance(getattr(state, name, None), kind), f"RequestState.{name} is a {kind.__name__}")
    require(hasattr(state, "eos_token_id") and hasattr(state, "status"), "RequestState has eos_token_id and status")


REQUEST_STATE = "request_state"  # the key of check_request_state() in unmet()


def degrades(key: str) -> str:
    return BY_KEY[key].degrades if key in BY_KEY else REQUIRED


def name(key: str) -> str:
    return BY_KEY[key].qualname if key in BY_KEY else f"{CB}.requests.RequestState"


def unmet() -> tuple[dict[str, Callable[..., Any]], dict[str, str]]:
    """(key -> original for the targets whose check holds, key -> what did not hold for the others).
    A target in an optional module that cannot be imported is in neither."""
    originals: dict[str, Callable[..., Any]] = {}
    failed: dict[str, str] = {}
    try:
        check_request_state()
    except Exception as exc:  # noqa: BLE001 - any failure means the fields are not as relied on
        failed[REQUEST_STATE] = _describe(exc)
    for target in TARGETS:
        try:
            originals[target.key] = check(target)
        except ImportError:
            if not target.optional_module:
                failed[target.key] = f"{target.module} cannot be imported"
        except Exception as exc:  # noqa: BLE001 - any failure means the name is not as relied on
            failed[target.key] = _describe(exc)
    return originals, failed


def _describe(exc: Exception) -> str:
    return str(exc) if isinstance(exc, ContractError) else f"{type(exc).__name__}: {exc}"
