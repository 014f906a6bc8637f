"""TelemetryConfig: every setting of the plugin, validated when the config is built.

Built from keyword arguments, or from the environment with :meth:`TelemetryConfig.from_env`
(``OTEL_LLM_*`` plus the standard ``OTEL_*`` variables that :func:`setup_telemetry` honours).
A bad value fails here, once, with a message naming the setting, the value and the rule,
never later inside the SDK or on the first ``record()``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from otel_llm.config import buckets, tenants

NAMING_PROFILES = ("vllm", "semconv")
METRICS_EXPORTERS = ("otlp", "prometheus", "console", "none")
TRACES_EXPORTERS = ("otlp", "console", "none")
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
EXEMPLAR_FILTERS = ("trace_based", "always_on", "always_off")
LOGS_EXPORTERS = ("otlp", "console", "none")
PREEMPTION_EVENTS = ("span_event", "log", "both")  # where each preemption is recorded
HISTOGRAM_AGGREGATIONS = ("explicit_bucket_histogram", "base2_exponential_bucket_histogram")
# gen_ai.provider.name of a self-hosted engine: the conventions list only hosted providers
# (well-known values) and allow a custom value otherwise.
DEFAULT_PROVIDER_NAME = "self_hosted"
DEFAULT_DEFER_STEPS = 16  # defer_steps of the telemetry setup_telemetry builds, unless set


@dataclass(frozen=True)
class TelemetryConfig:
    """Settings of one engine's telemetry. ``None`` means "from the standard environment"."""

    model_name: str = "unknown"
    engine: str = "0"  # engine index label (data-parallel rank), as a string like vLLM's
    naming: str = "vllm"
    preemption_buckets: tuple[float, ...] = buckets.REQUEST_NUM_PREEMPTIONS
    # Boundaries of other histograms, by metric key (otel_llm.catalogue.metrics.METRICS), replacing the defaults.
    histogram_buckets: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    max_model_len: int = buckets.DEFAULT_MAX_MODEL_LEN  # caps vLLM's 1-2-5 token buckets
    spans: bool = True  # one span per request
    span_name: str = "llm_request"
    span_kind: str = "server"  # or "internal": beside an engine's own request span (vLLM's tracing)
    # Each preemption as a span event ("span_event"), a log-based event "llm.request.preempted"
    # ("log": the span keeps only llm.request.num_preemptions), or both.
    preemption_events: str = "span_event"
    provider_name: str = DEFAULT_PROVIDER_NAME  # gen_ai.provider.name (semconv profile, spans, log events)
    max_inflight_requests: int = 100_000  # tracked at once; the oldest is evicted beyond
    max_label_values: int = 100  # distinct values per user-derived label (finish/preemption reasons)
    record_content: bool = False  # prompt/output text on spans: off unless asked for
    content_max_length: int = 1024  # characters kept when record_content is on
    # Where a request's tenant comes from (config.tenants.parse_source: priority, lora, model,
    # header:NAME, baggage:KEY); None: no tenant label on any series.
    tenant: Optional[str] = None
    tenant_max_values: int = tenants.DEFAULT_MAX_VALUES  # distinct tenants per process; the rest "other"
    # Event batches kept and applied together every N engine steps: the telemetry's code then
    # starts cold (after the model's work evicted the CPU caches) once per N steps, not every
    # step. A reader's collection, an idle step, flush() and shutdown() apply what is pending
    # first. None: DEFAULT_DEFER_STEPS through setup_telemetry (the engine plugins' path), 1 (each
    # on_events applied at once) for an EngineTelemetry built by hand.
    defer_steps: Optional[int] = None
    # Exporters (used by setup_telemetry); None = the standard OTEL_* variable or its default.
    metrics_exporters: Optional[tuple[str, ...]] = None
    traces_exporters: Optional[tuple[str, ...]] = None
    logs_exporters: Optional[tuple[str, ...]] = None  # OTEL_LOGS_EXPORTER, default otlp (log events only)
    prometheus_host: Optional[str] = None  # default 127.0.0.1 (never all interfaces by default)
    prometheus_port: Optional[int] = None  # default 9464 when "prometheus" is an exporter
    prometheus_ports: int = 1  # consecutive ports from prometheus_port to try: one per process on a host
    otlp_protocol: Optional[str] = None  # grpc (default) or http/protobuf
    otlp_endpoint: Optional[str] = None  # else OTEL_EXPORTER_OTLP_[SIGNAL_]ENDPOINT
    metric_export_interval_ms: Optional[int] = None  # OTEL_METRIC_EXPORT_INTERVAL, default 60000
    exemplar_filter: Optional[str] = None  # OTEL_METRICS_EXEMPLAR_FILTER, default trace_based
    # OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION: base2_exponential_bucket_histogram
    # sends the latency and token histograms as exponential histograms over OTLP.
    histogram_aggregation: Optional[str] = None
    sdk_disabled: Optional[bool] = None  # OTEL_SDK_DISABLED
    resource_attributes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(
            isinstance(self.model_name, str) and self.model_name != "",
            "model_name",
            self.model_name,
            "must be a non-empty string",
        )
        _check(isinstance(self.engine, str), "engine", self.engine, "must be a string such as '0'")
        _check(self.naming in NAMING_PROFILES, "naming", self.naming, f"must be one of {NAMING_PROFILES}")
        _check(
            isinstance(self.span_name, str) and self.span_name != "",
            "span_name",
            self.span_name,
            "must be a non-empty string",
        )
        _check(self.span_kind in ("server", "internal"), "span_kind", self.span_kind, "must be server or internal")
        _check(
            self.preemption_events in PREEMPTION_EVENTS,
            "preemption_events",
            self.preemption_events,
            f"must be one of {PREEMPTION_EVENTS}",
        )
        _check(
            isinstance(self.provider_name, str) and self.provider_name.strip() != "",
            "provider_name",
            self.provider_name,
            "must be a non-empty string",
        )
        object.__setattr__(
            self, "preemption_buckets", buckets.validate_boundaries("preemption_buckets", self.preemption_buckets)
        )
        _check(
            isinstance(self.histogram_buckets, Mapping),
            "histogram_buckets",
            self.histogram_buckets,
            "must be a mapping of metric key to boundaries",
        )
        object.__setattr__(
            self,
            "histogram_buckets",
            {
                key: buckets.validate_boundaries(f"histogram_buckets[{key!r}]", values)
                for key, values in self.histogram_buckets.items()
            },
        )
        for name in ("spans", "record_content"):  # a string such as "false" would be truthy
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be True or False")
        if self.sdk_disabled is not None:
            _check(isinstance(self.sdk_disabled, bool), "sdk_disabled", self.sdk_disabled, "must be True or False")
        _check(
            isinstance(self.resource_attributes, Mapping)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in self.resource_attributes.items()),
            "resource_attributes",
            self.resource_attributes,
            "must be a mapping of str to str",
        )
        for name in (
            "max_model_len",
            "max_inflight_requests",
            "max_label_values",
            "content_max_length",
            "prometheus_ports",
            "tenant_max_values",
        ):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, name, value, "must be an integer >= 1")
        if self.tenant is not None:
            try:
                object.__setattr__(self, "tenant", str(tenants.parse_source(self.tenant)))
            except ValueError as exc:
                raise ValueError(f"tenant: {self.tenant!r} {exc}") from None
        if self.defer_steps is not None:
            _check(
                _is_int(self.defer_steps) and self.defer_steps >= 1,
                "defer_steps",
                self.defer_steps,
                "must be an integer >= 1",
            )
        if self.metrics_exporters is not None:
            object.__setattr__(
                self, "metrics_exporters", _names("metrics_exporters", self.metrics_exporters, METRICS_EXPORTERS)
            )
        if self.traces_exporters is not None:
            object.__setattr__(
                self, "traces_exporters", _names("traces_exporters", self.traces_exporters, TRACES_EXPORTERS)
            )
        if self.logs_exporters is not None:
            object.__setattr__(self, "logs_exporters", _names("logs_exporters", self.logs_exporters, LOGS_EXPORTERS))
        if self.prometheus_host is not None:
            _check(
                isinstance(self.prometheus_host, str) and self.prometheus_host.strip() != "",
                "prometheus_host",
                self.prometheus_host,
                "must be a host name or address",
            )
        if self.prometheus_port is not None:
            _check(
                _is_int(self.prometheus_port) and 0 <= self.prometheus_port <= 65535,
                "prometheus_port",
                self.prometheus_port,
                "must be an integer 0..65535 (0 = any free port)",
            )
        if self.otlp_protocol is not None:
            _check(
                self.otlp_protocol in OTLP_PROTOCOLS,
                "otlp_protocol",
                self.otlp_protocol,
                f"must be one of {OTLP_PROTOCOLS}",
            )
        if self.otlp_endpoint is not None:
            _check(
                _is_url(self.otlp_endpoint),
                "otlp_endpoint",
                self.otlp_endpoint,
                "must be an http:// or https:// URL, e.g. http://127.0.0.1:4317",
            )
        if self.metric_export_interval_ms is not None:
            _check(
                _is_int(self.metric_export_interval_ms) and self.metric_export_interval_ms >= 1,
                "metric_export_interval_ms",
                self.metric_export_interval_ms,
                "must be an integer >= 1",
            )
        if self.exemplar_filter is not None:
            _check(
                self.exemplar_filter in EXEMPLAR_FILTERS,
                "exemplar_filter",
                self.exemplar_filter,
                f"must be one of {EXEMPLAR_FILTERS}",
            )
        if self.histogram_aggregation is not None:
            _check(
                self.histogram_aggregation in HISTOGRAM_AGGREGATIONS,
                "histogram_aggregation",
                self.histogram_aggregation,
                f"must be one of {HISTOGRAM_AGGREGATIONS}",
            )

    @property
    def log_events(self) -> bool:
        """Preemptions go out as log records (``preemption_events`` "log" or "both")."""
        return self.preemption_events != "span_event"

    @property
    def tenant_source(self) -> Optional[tenants.TenantSource]:
        """The parsed ``tenant`` setting; None: no tenant dimension."""
        return None if self.tenant is None else tenants.parse_source(self.tenant)

    @property
    def exponential(self) -> bool:
        """The latency and token histograms go out over OTLP as exponential histograms."""
        return self.histogram_aggregation == "base2_exponential_bucket_histogram"

    @classmethod
    def from_env(
        cls,
        environ: Optional[Mapping[str, str]] = None,
        *,
        defaults: Optional[Mapping[str, Any]] = None,
        **overrides: Any,
    ) -> "TelemetryConfig":
        """Build from ``OTEL_LLM_*`` and the standard ``OTEL_*`` variables.

        The one precedence rule of every entry point: ``overrides`` (what the caller's code says)
        win over the environment, which wins over ``defaults`` (what an entry point knows of its
        engine: the served model's name, its provider name), which win over the field defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = dict(defaults or {})
        for var, (name, parse) in _ENV.items():
            raw = env.get(var)
            if raw is None or raw.strip() == "":
                continue
            try:
                values[name] = parse(raw.strip())
            except ValueError as exc:
                raise ValueError(f"{var}={raw!r}: {exc}") from None
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as exc:
            # Name the environment variable behind the setting, when there is one.
            for var, (name, _) in _ENV.items():
                if str(exc).startswith(name + ":") and name not in overrides and var in env:
                    raise ValueError(f"{var}={env[var]!r}: {exc}") from None
            raise

    def with_env_defaults(self, environ: Optional[Mapping[str, str]] = None) -> "TelemetryConfig":
        """Fill the settings left ``None`` from the standard environment (validated)."""
        from_env = TelemetryConfig.from_env(environ)
        filled = {f.name: getattr(from_env, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is None}
        return dataclasses.replace(self, **filled)

    def redacted(self) -> dict[str, Any]:
        """The settings, safe to log (no header secrets are held here; endpoints lose userinfo)."""
        out = dataclasses.asdict(self)
        if self.otlp_endpoint and "@" in self.otlp_endpoint:
            scheme, _, rest = self.otlp_endpoint.partition("://")
            out["otlp_endpoint"] = f"{scheme}://***@{rest.split('@', 1)[1]}"
        return out


def _check(ok: bool, setting: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"{setting}: {value!r} {rule}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_url(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://")) and len(value.split("://", 1)[1]) > 0


def _names(setting: str, values: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(values, str):
        values = values.split(",")
    _check(
        isinstance(values, (tuple, list)), setting, values, f"must be a comma-separated string or a list of {allowed}"
    )
    names = tuple(str(v).strip().lower() for v in values if str(v).strip())
    for name in names:
        _check(name in allowed, setting, name, f"is not one of {allowed}")
    return names or ("none",)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("not an integer") from None


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("not a boolean (true/false)")


def _choice(text: str, allowed: tuple[str, ...]) -> str:
    if text not in allowed:
        raise ValueError(f"expected one of {', '.join(allowed)}")
    return text


def _deep_hook(text: str) -> str:
    """``on``, ``off`` or ``force`` (the same as on: every part attaches by structure); booleans as elsewhere."""
    lowered = text.lower()
    if lowered == "force":
        return lowered
    try:
        return "on" if _bool(lowered) else "off"
    except ValueError:
        raise ValueError("expected true/false (1/0, yes/no, on/off) or force") from None


def _float_or_int(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("not a number of milliseconds") from None
    if not math.isfinite(value):
        raise ValueError("not finite")
    return int(value)


# Environment variable -> (config field, parser). Documented in docs/configuration.md.
_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "OTEL_LLM_MODEL_NAME": ("model_name", str),
    "OTEL_LLM_ENGINE": ("engine", str),
    "OTEL_LLM_NAMING": ("naming", str.lower),
    "OTEL_LLM_PREEMPTION_BUCKETS": ("preemption_buckets", lambda t: buckets.parse_boundaries("preemption_buckets", t)),
    "OTEL_LLM_MAX_MODEL_LEN": ("max_model_len", _int),
    "OTEL_LLM_SPANS": ("spans", _bool),
    "OTEL_LLM_MAX_INFLIGHT_REQUESTS": ("max_inflight_requests", _int),
    "OTEL_LLM_MAX_LABEL_VALUES": ("max_label_values", _int),
    "OTEL_LLM_RECORD_CONTENT": ("record_content", _bool),
    "OTEL_LLM_CONTENT_MAX_LENGTH": ("content_max_length", _int),
    "OTEL_LLM_DEFER_STEPS": ("defer_steps", _int),
    "OTEL_LLM_PREEMPTION_EVENTS": ("preemption_events", str.lower),
    "OTEL_LLM_PROVIDER_NAME": ("provider_name", str),
    "OTEL_LLM_TENANT": ("tenant", str),
    "OTEL_LLM_TENANT_MAX_VALUES": ("tenant_max_values", _int),
    "OTEL_METRICS_EXPORTER": ("metrics_exporters", lambda t: tuple(t.split(","))),
    "OTEL_TRACES_EXPORTER": ("traces_exporters", lambda t: tuple(t.split(","))),
    "OTEL_LOGS_EXPORTER": ("logs_exporters", lambda t: tuple(t.split(","))),
    "OTEL_EXPORTER_PROMETHEUS_HOST": ("prometheus_host", str),
    "OTEL_EXPORTER_PROMETHEUS_PORT": ("prometheus_port", _int),
    "OTEL_LLM_PROMETHEUS_PORTS": ("prometheus_ports", _int),
    "OTEL_EXPORTER_OTLP_PROTOCOL": ("otlp_protocol", str.lower),
    "OTEL_EXPORTER_OTLP_ENDPOINT": ("otlp_endpoint", str),
    "OTEL_METRIC_EXPORT_INTERVAL": ("metric_export_interval_ms", _float_or_int),
    "OTEL_METRICS_EXEMPLAR_FILTER": ("exemplar_filter", str.lower),
    "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": ("histogram_aggregation", str.lower),
    "OTEL_SDK_DISABLED": ("sdk_disabled", _bool),
}
# Variables an entry point reads for itself, not settings of a TelemetryConfig: variable -> parser.
_ENTRY_POINT_ENV: dict[str, Callable[[str], Any]] = {
    "OTEL_LLM_VLLM_METRICS": lambda t: _choice(t.lower(), ("add", "replace")),
    "OTEL_LLM_VLLM_DEEP_HOOK": _deep_hook,
    "OTEL_LLM_PHOENIX": str,
}
CONFIG_VARIABLES = tuple(_ENV)  # TelemetryConfig.from_env's
ENTRY_POINT_VARIABLES = tuple(_ENTRY_POINT_ENV)
ENV_VARIABLES = (*CONFIG_VARIABLES, *ENTRY_POINT_VARIABLES)


def from_environment(var: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of ``var`` (any variable of :data:`ENV_VARIABLES`), None when it is unset
    or blank; a bad value raises ValueError naming the variable, the value and the rule."""
    parse = _ENV[var][1] if var in _ENV else _ENTRY_POINT_ENV[var]
    raw = (os.environ if environ is None else environ).get(var)
    if raw is None or raw.strip() == "":
        return None
    try:
        return parse(raw.strip())
    except ValueError as exc:
        raise ValueError(f"{var}={raw!r}: {exc}") from None
