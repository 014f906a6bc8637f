"""What the vLLM adapter records and how, resolved once at its start into a plain :class:`Plan`:
the settings (the environment over what vLLM's config says over our defaults:
:meth:`TelemetryConfig.from_env`), replace or add mode, the provider set, the model label, the
span's name and kind, vLLM's series beyond the core; and, once the engines' telemetries exist,
whether the per-step core series are read from vLLM's own logger (:func:`read_step_series`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Iterable, Iterator, Optional

from otel_llm.catalogue.metrics import BY_KEY, METRICS, base_attributes, label_key, request_token_buckets
from otel_llm.config.settings import TelemetryConfig, from_environment
from otel_llm.integrations.vllm import handle as shared_handle
from otel_llm.integrations.vllm.frontend import replace as vllm_replace
from otel_llm.integrations.vllm.translation.fields import FieldReader
from otel_llm.integrations.vllm.translation.translate import BUCKET_FAMILIES, DEFAULT_PREEMPTION_REASON, custom_buckets
from otel_llm.recording.in_process import InProcessRecorder

_log = logging.getLogger("otel_llm.integrations.vllm")  # one logger for the vLLM adapter, whichever module logs

SIBLING_SPAN_NAME = "llm_request.scheduling"  # our span's name when vLLM traces requests itself
PROVIDER_NAME = "vllm"  # gen_ai.provider.name unless OTEL_LLM_PROVIDER_NAME says otherwise
# The core metrics that vLLM's own logger records at each engine step, as the adapter would.
STEP_SERIES = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "iteration_tokens_total",
    "prompt_tokens",
    "generation_tokens",
    "num_preemptions",
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The adapter's settings, each decided once."""

    config: TelemetryConfig  # the model label, span name and kind resolved
    handle: Any  # otel_llm.export.handle.TelemetryHandle: the process's providers
    served_model: Optional[str]  # vLLM's served model name
    series: Any  # VllmSeries: vLLM's series beyond the core; None when they cannot be built
    replacing: bool  # this logger answers vLLM's /metrics in place of vLLM's own logger


def make_plan(vllm_config: Any, engine_indexes: list[int], reader: FieldReader, handle: Any, replace: bool) -> Plan:
    """``handle``: providers the caller gave (else the process's, built on first use);
    ``replace``: the stat-logger class is replace mode's."""
    vllm_replace.mode()  # a bad OTEL_LLM_VLLM_METRICS stops here, named
    served, max_len = _from_vllm_config(vllm_config, reader)
    handle = handle if handle is not None else shared_handle.current()
    own_config = None
    if handle is None:
        own_config = engine_config(served, max_len, custom_buckets(vllm_config))
    naming = (own_config or handle.config).naming
    # Built before the providers, which need their Views.
    series = _series(vllm_config, engine_indexes, naming)
    replacing = False
    if replace:
        reason = (
            vllm_replace.obstacle(vllm_config, naming, handle is not None and not shared_handle.answers_vllm())
            if series is not None
            else "vLLM's series beyond the core metrics could not be built"
        )
        if reason is not None:
            vllm_replace.report_fallback(reason)
        replacing = reason is None
    elif vllm_replace.requested():  # the add-mode class: this vLLM may build its own logger anyway
        vllm_replace.report_fallback(vllm_replace.structure_obstacle() or "this stat-logger class is add mode's")
    if handle is None:
        assert own_config is not None
        handle = shared_handle.get_handle(
            own_config,
            series.views() if series is not None else (),
            functools.partial(_vllm_facing_reader, series) if replacing else tuple,
        )
    config = dataclasses.replace(handle.config, model_name=_model_label(handle.config, served))
    if _vllm_traces_requests(vllm_config):
        # vLLM's own llm_request span is the request's span: ours, with the preemption events,
        # is an internal sibling under the same parent, not a second llm_request.
        config = dataclasses.replace(config, span_name=SIBLING_SPAN_NAME, span_kind="internal")
    return Plan(config, handle, served, series, replacing)


def engine_config(
    served: Optional[str], max_len: Optional[int], custom: Optional[dict[str, list[float]]] = None
) -> TelemetryConfig:
    """The settings of an engine's telemetry, whichever process records it: the environment over
    what vLLM says of its engine (the served model's name, ``max_model_len``, which bounds the
    request token buckets, its custom histogram buckets) over our defaults, with
    ``gen_ai.provider.name`` vLLM."""
    defaults = {"model_name": served, "max_model_len": max_len, "provider_name": PROVIDER_NAME}
    config = TelemetryConfig.from_env(defaults={k: v for k, v in defaults.items() if v is not None})
    return with_vllm_buckets(config, custom or {})


def _model_label(base: TelemetryConfig, served: Optional[str]) -> str:
    """OTEL_LLM_MODEL_NAME, else a name the handle's owner chose, else vLLM's served name."""
    from_env = from_environment("OTEL_LLM_MODEL_NAME")
    if from_env is not None:
        return str(from_env).strip()
    return base.model_name if base.model_name != "unknown" or not served else served


def _from_vllm_config(vllm_config: Any, reader: FieldReader) -> tuple[Optional[str], Optional[int]]:
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None, None
    served = reader.raw(model_config, "served_model_name", "the model_name label")
    if isinstance(served, (list, tuple)) and served:
        served = served[0]
    max_len = reader.number(model_config, "max_model_len", "the request token buckets")
    return (
        served if isinstance(served, str) and served else None,
        int(max_len) if max_len is not None and max_len >= 1 else None,  # vLLM's 1-2-5 token buckets stop there
    )


def _vllm_facing_reader(series: Any) -> list[Any]:
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    from otel_llm.integrations.vllm.frontend.replace import VllmFacingReader

    documentation = {name: f.documentation for name, f in series.families.items()}  # their HELP text
    return [VllmFacingReader(get_prometheus_registry(), documentation)]


def with_vllm_buckets(config: TelemetryConfig, custom: dict[str, list[float]]) -> TelemetryConfig:
    """The config with the boundaries vLLM's ``--custom-histogram-buckets`` gives each family's
    series (vLLM's defaults are ours in the ``vllm`` profile); an explicit
    ``OTEL_LLM_PREEMPTION_BUCKETS`` / ``OTEL_LLM_MAX_MODEL_LEN`` wins. One resolution for every
    process that records an engine: vLLM's config where it is at hand, the engine core's hello
    elsewhere."""
    overrides = dict(config.histogram_buckets)
    preemption = config.preemption_buckets
    by_series = {name: family for family, names in BUCKET_FAMILIES.items() for name in names}
    for m in METRICS:
        bounds = custom.get(by_series.get(m.vllm or "", ""))
        if m.kind != "histogram" or not bounds:
            continue
        if m.key == "request_num_preemptions":
            if from_environment("OTEL_LLM_PREEMPTION_BUCKETS") is None:
                preemption = tuple(bounds)
        elif m.buckets is request_token_buckets and from_environment("OTEL_LLM_MAX_MODEL_LEN") is not None:
            continue
        else:
            overrides[m.key] = tuple(bounds)
    try:
        return dataclasses.replace(config, histogram_buckets=overrides, preemption_buckets=preemption)
    except ValueError as exc:  # e.g. a boundary <= 0, which vLLM allows and Ray's exporter rejects
        _log.warning("otel-llm vLLM adapter: vLLM's custom histogram buckets are not used (%s)", exc)
        return config


def _vllm_traces_requests(vllm_config: Any) -> bool:
    """vLLM's own tracing (``--otlp-traces-endpoint``) makes an ``llm_request`` span per request."""
    observability = getattr(vllm_config, "observability_config", None)
    return bool(getattr(observability, "otlp_traces_endpoint", None))


def _series(vllm_config: Any, engine_indexes: list[int], naming: str) -> Any:
    try:
        from otel_llm.integrations.vllm.series.series import VllmSeries

        return VllmSeries(vllm_config, engine_indexes, naming)
    except Exception as exc:  # noqa: BLE001 - vLLM's series are optional: the core metrics stay
        _log.warning(
            "otel-llm vLLM adapter: vLLM's series beyond the core metrics are not recorded, their "
            "logger could not be built (%r)",
            exc,
        )
        return None


def read_step_series(plan: Plan, telemetries: Iterable[Any]) -> bool:
    """Export the core series of :data:`STEP_SERIES` from vLLM's own logger, which records them
    at each step as the adapter would (vLLM's names, labels, buckets and values), where the
    series beyond the core are read from it too, and where what is exported stays the same: the
    ``vllm`` naming profile, vLLM's model name, explicit buckets equal to vLLM's, no exemplars
    on them (``always_on`` gives them some, without a trace), and providers that only this
    plugin records into. Preemptions by reason are vLLM's preemptions, all ``kv_cache_full``.
    With a tenant source, the per-tenant ones (time to first token, inter-token latency, the
    token counters) are not read there. True when the others are read there (the adapter then
    translates only the finished requests and, with a tenant source, the per-tenant series)."""
    series, config = plan.series, plan.config
    telemetries = list(telemetries)
    recorders = [tel.metrics for tel in telemetries]
    in_process = [m for m in recorders if isinstance(m, InProcessRecorder)]
    if not in_process or len(in_process) != len(recorders):
        return False
    sources: dict[str, Callable[[], Iterable[Any]]] = {}
    if (
        series is not None
        and series.source is not None
        and shared_handle.owned()
        and config.naming == "vllm"
        and config.model_name == plan.served_model
        and all(tel.exemplar_filter != "always_on" for tel in telemetries)
    ):
        labels = set(base_attributes(config))
        for key in STEP_SERIES:
            m = BY_KEY[key]
            if m.per_tenant and config.tenant is not None:
                continue  # vLLM's have no tenant: recorded here from each step's values
            family = series.families.get(m.vllm)
            if (
                family is None
                or family.kind != m.kind
                or set(family.labelnames) != labels
                or (m.kind == "histogram" and tuple(map(float, m.boundaries(config))) != family.bounds)
                or m.exponential(config)
            ):
                sources.clear()
                break
            sources[key] = functools.partial(series.read, family)
        if sources:
            sources["num_preemptions_by_reason"] = functools.partial(
                _by_reason, sources["num_preemptions"], label_key(config, "reason")
            )
    in_process[0].read_elsewhere(sources)  # none: a series this provider read before is recorded again
    return bool(sources)


def _by_reason(read: Callable[[], Iterable[Any]], label: str) -> Iterator[Any]:
    """Preemptions by reason as read from vLLM's count of preemptions, every one for the KV
    cache (series from the first preemption on, as when recorded)."""
    from opentelemetry.metrics import Observation

    for o in read():
        if o.value:
            yield Observation(o.value, {**o.attributes, label: DEFAULT_PREEMPTION_REASON})
