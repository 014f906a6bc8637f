"""The standard ``OTEL_*`` variables that the SDK and its exporters read themselves, checked first.

Left to the SDK (1.45), a bad value fails deep inside it with a bare message ("could not
convert string to float: 'abc'"), or is logged and replaced by a default (HTTP timeout and
compression, headers, sampler, sampler argument, resource attributes, metric export timeout),
or is accepted and then fails every export (a negative timeout, a missing CA file). A malformed
header is even logged with its value, which may be a secret. :func:`setup_telemetry` calls
:func:`check` before it builds anything: one ValueError naming the variable, the value and the
rule. The values of ``*_HEADERS`` are never shown.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
from importlib.metadata import entry_points
from typing import Mapping, Optional

_OTLP = "OTEL_EXPORTER_OTLP_"
_SIGNALS = ("", "TRACES_", "METRICS_", "LOGS_")
# What each exporter accepts (SDK 1.45: the gRPC one knows only gzip, and raises on anything else).
_COMPRESSIONS = {"grpc": ("gzip",), "http/protobuf": ("gzip", "deflate", "none")}
_SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
# The batch span and log record processors' defaults (OTel spec), for the queue/batch comparison.
_BSP_DEFAULT_QUEUE, _BSP_DEFAULT_BATCH = 2048, 512

# W3C Baggage-style members as the exporters parse them (values may hold spaces, not , ; " \).
_KEY = r"[!#-'*+\-.0-9A-Z^-z|~]+"
_HEADER = re.compile(rf"[ \t]*{_KEY}[ \t]*=[ \t]*[ !#-+\--:<-\[\]-~]*[ \t]*")
_RESOURCE_ATTRIBUTE = re.compile(r"[^=,]*\S[^=,]*=.*")


def check(env: Mapping[str, str], protocols: Mapping[str, str]) -> None:
    """``protocols``: the OTLP protocol of each signal exported over OTLP ("traces", "metrics", "logs")."""
    # First: importing the OTLP exporters (integer_timeouts) makes the SDK log its own line about it.
    _resource_attributes(env)
    for signal in _SIGNALS:
        _timeout(env, f"{_OTLP}{signal}TIMEOUT")
        _headers(env, f"{_OTLP}{signal}HEADERS")
        for name in ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE"):
            _file(env, f"{_OTLP}{signal}{name}")
    _number(env, "OTEL_METRIC_EXPORT_TIMEOUT", "a number of milliseconds > 0")
    for prefix in ("OTEL_BSP_", "OTEL_BLRP_"):  # batch span / log record processor
        queue = _integer(env, f"{prefix}MAX_QUEUE_SIZE", 1)
        batch = _integer(env, f"{prefix}MAX_EXPORT_BATCH_SIZE", 1)
        _integer(env, f"{prefix}SCHEDULE_DELAY", 1)
        _integer(env, f"{prefix}EXPORT_TIMEOUT", 0)
        if (batch or _BSP_DEFAULT_BATCH) > (queue or _BSP_DEFAULT_QUEUE):
            raise ValueError(
                f"{prefix}MAX_EXPORT_BATCH_SIZE={batch or _BSP_DEFAULT_BATCH}: must be <= "
                f"{prefix}MAX_QUEUE_SIZE={queue or _BSP_DEFAULT_QUEUE}"
            )
    for signal, protocol in protocols.items():
        for var in (f"{_OTLP}{signal.upper()}_COMPRESSION", f"{_OTLP}COMPRESSION"):
            _compression(env, var, protocol)
    _sampler(env)


@functools.lru_cache(maxsize=None)
def integer_timeouts() -> bool:
    """Whether the installed OTLP exporters read OTEL_EXPORTER_OTLP_*TIMEOUT with int() (SDK 1.28
    does: "2.5" raises in their constructors) rather than float()."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc import exporter

        source = inspect.getsource(exporter.OTLPExporterMixin.__init__)
    except Exception:  # noqa: BLE001 - no gRPC exporter, or no source: the newer rule
        return False
    return re.search(r"int\(\s*environ\.get\(\s*OTEL_EXPORTER_OTLP_TIMEOUT", source) is not None


def _set(env: Mapping[str, str], var: str) -> Optional[str]:
    raw = env.get(var)
    return raw if raw is not None and raw.strip() != "" else None


def _number(env: Mapping[str, str], var: str, rule: str) -> None:
    raw = _set(env, var)
    if raw is None:
        return
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{var}={raw!r}: must be {rule}")


def _timeout(env: Mapping[str, str], var: str) -> None:
    raw = _set(env, var)
    if raw is None:
        return
    if not integer_timeouts():
        _number(env, var, "a number of seconds > 0")
        return
    if not (raw.strip().isdigit() and int(raw) > 0):
        raise ValueError(
            f"{var}={raw!r}: must be a whole number of seconds > 0 (the installed OTLP exporters read an integer)"
        )


def _integer(env: Mapping[str, str], var: str, minimum: int) -> Optional[int]:
    raw = _set(env, var)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{var}={raw!r}: must be an integer >= {minimum}")
    return value


def _compression(env: Mapping[str, str], var: str, protocol: str) -> None:
    raw = _set(env, var)
    if raw is not None and raw.strip().lower() not in _COMPRESSIONS[protocol]:
        raise ValueError(
            f"{var}={raw!r}: must be one of {', '.join(_COMPRESSIONS[protocol])} with the {protocol} exporter"
        )


def _headers(env: Mapping[str, str], var: str) -> None:
    raw = _set(env, var)
    if raw is None:
        return
    for position, member in enumerate(re.split(r"[ \t]*,[ \t]*", raw), 1):
        if member and not _HEADER.fullmatch(member):
            key = member.split("=", 1)[0].strip() if "=" in member else ""
            shown = f"{key[:40]}=***" if key else "***"
            raise ValueError(
                f"{var}: member {position} ({shown}, value not shown): must be a comma-separated "
                "list of name=value, the name a token, the value URL-encoded "
                "(no comma, semicolon, double quote or backslash)"
            )


def _file(env: Mapping[str, str], var: str) -> None:
    raw = _set(env, var)
    if raw is not None and not os.access(raw, os.R_OK):
        raise ValueError(f"{var}={raw!r}: must be a readable file (a PEM certificate or key)")


def _sampler(env: Mapping[str, str]) -> None:
    raw = _set(env, "OTEL_TRACES_SAMPLER")
    if raw is None:
        return
    name = raw.strip().lower()
    if name not in _SAMPLERS and name not in {ep.name for ep in entry_points(group="opentelemetry_traces_sampler")}:
        raise ValueError(
            f"OTEL_TRACES_SAMPLER={raw!r}: must be one of {', '.join(_SAMPLERS)} "
            "(or a sampler registered in the entry-point group opentelemetry_traces_sampler)"
        )
    arg = _set(env, "OTEL_TRACES_SAMPLER_ARG")
    if name.endswith("traceidratio") and arg is not None:
        try:
            ratio = float(arg)
        except ValueError:
            ratio = math.nan
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={arg!r}: must be a ratio in 0..1 for {name}")


def _resource_attributes(env: Mapping[str, str]) -> None:
    raw = _set(env, "OTEL_RESOURCE_ATTRIBUTES")
    if raw is None:
        return
    for member in raw.split(","):
        if member.strip() and not _RESOURCE_ATTRIBUTE.fullmatch(member):
            raise ValueError(
                f"OTEL_RESOURCE_ATTRIBUTES={raw!r}: member {member!r} must be key=value "
                "(comma-separated, the key non-empty)"
            )
