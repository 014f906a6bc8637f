"""OTLP exporters (gRPC or HTTP/protobuf) from the config and the standard environment.

Headers, compression, timeout, TLS certificates and the temporality preference are read from
the standard ``OTEL_EXPORTER_OTLP_*`` variables by the exporters themselves.
"""

from __future__ import annotations

import importlib
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Mapping, Optional

from otel_llm import _sdk
from otel_llm.config.settings import TelemetryConfig
from otel_llm.export.metric_encoding import OwnMetricEncoding
from otel_llm.export.span_encoding import OwnEncoding

DEFAULT_OTLP_PROTOCOL = "grpc"
DEFAULT_OTLP_TIMEOUT_S = 10.0
# The first release whose OTLP exporters end an export, retries included, within their timeout.
_RETRIES_WITHIN_TIMEOUT = (1, 35)
_DISTRIBUTIONS = {
    "grpc": "opentelemetry-exporter-otlp-proto-grpc",
    "http/protobuf": "opentelemetry-exporter-otlp-proto-http",
}


def protocol(config: TelemetryConfig, env: Mapping[str, str], signal: str) -> str:
    var = f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL"
    protocol = (env.get(var) or config.otlp_protocol or DEFAULT_OTLP_PROTOCOL).strip().lower()
    if protocol not in ("grpc", "http/protobuf"):
        raise ValueError(f"{var}={protocol!r}: must be 'grpc' or 'http/protobuf'")
    return protocol


def endpoint(config: TelemetryConfig, env: Mapping[str, str], signal: str, protocol: str) -> Optional[str]:
    """Per-signal endpoint as given; the base endpoint gets /v1/<signal> for HTTP (OTLP spec)."""
    var = f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"
    specific = env.get(var)
    if specific:
        if not specific.startswith(("http://", "https://")) or not specific.split("://", 1)[1]:
            raise ValueError(f"{var}={specific!r}: must be an http:// or https:// URL, e.g. http://127.0.0.1:4317")
        endpoint, source = specific, var
    elif not config.otlp_endpoint:
        return None
    elif protocol == "http/protobuf":
        endpoint, source = config.otlp_endpoint.rstrip("/") + f"/v1/{signal}", "OTEL_EXPORTER_OTLP_ENDPOINT"
    else:
        endpoint, source = config.otlp_endpoint, "OTEL_EXPORTER_OTLP_ENDPOINT"
    scheme, _, rest = endpoint.partition("://")
    if protocol == "grpc" and "@" in rest.split("/", 1)[0]:
        # gRPC does not send URL credentials, and its exporter logs the endpoint on every failure.
        raise ValueError(
            f"{source}={scheme}://***@{rest.split('@', 1)[1]!s}: credentials in a gRPC endpoint URL "
            "are not supported (they would be logged); pass them in OTEL_EXPORTER_OTLP_HEADERS"
        )
    return endpoint


def export_bound_s(env: Mapping[str, str], signal: str, protocol: str) -> Optional[float]:
    """How long to wait for one export of ``signal`` where its exporter may retry for longer
    (before 1.35: up to 63 s): its timeout (OTEL_EXPORTER_OTLP_[SIGNAL_]TIMEOUT, seconds).
    None where the exporter keeps to it itself."""
    try:
        release = tuple(int(part) for part in version(_DISTRIBUTIONS[protocol]).split(".")[:2])
    except (PackageNotFoundError, ValueError):
        release = (0, 0)  # unknown: bound it
    if release >= _RETRIES_WITHIN_TIMEOUT:
        return None
    for var in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        raw = env.get(var, "").strip()
        if raw:
            return float(raw)  # a number > 0: sdk_env.check() has seen to it
    return DEFAULT_OTLP_TIMEOUT_S


_URLS_KEPT = 16  # the environment's settings kept per session (an exporter sends to one URL)
# The keyword arguments (those not None) of the exporters' requests, of every SDK release, that a
# plain send honours.
_PLAIN_ARGUMENTS = frozenset({"data", "headers", "timeout", "allow_redirects", "verify", "cert"})


def _http_session() -> Any:
    """A requests Session that keeps the exporter's CA file (OTEL_EXPORTER_OTLP_[SIGNAL_]CERTIFICATE)
    and reads the environment once per URL.

    requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE, when set in the environment (common in
    containers), override a Session's ``verify``: the certificate variable was then silently
    ignored and every export to a private-CA collector failed verification. requests also reads
    the proxy variables and looks for ~/.netrc at every request, a fifth of an export's cost in
    vLLM's API server: here once per URL. A request that none of requests' layers would change
    (plain HTTP, no proxy, no credentials) is sent over a kept ``http.client`` connection
    (:mod:`otel_llm.export.plain_http`), at a sixth of requests' cost. None (the SDK's own
    session) when a credential provider plugin supplies the session.
    """
    if any(k.startswith("OTEL_PYTHON_EXPORTER_OTLP_HTTP") and k.endswith("CREDENTIAL_PROVIDER") for k in os.environ):
        return None
    import requests
    from requests.auth import AuthBase
    from requests.sessions import merge_setting
    from requests.structures import CaseInsensitiveDict
    from requests.utils import get_netrc_auth

    from otel_llm.export.plain_http import PlainHTTP

    class _NoAuth(AuthBase):
        """No credentials: ~/.netrc has none for the URL (and requests need not look again)."""

        def __call__(self, r: Any) -> Any:
            return r

    class _Session(requests.Session):
        def __init__(self) -> None:
            super().__init__()
            self._settings: dict[tuple, dict[str, Any]] = {}
            self._netrc: dict[str, Any] = {}
            self._plain = PlainHTTP()

        def request(self, method: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
            given = (k for k, v in kwargs.items() if v is not None)
            if not args and _PLAIN_ARGUMENTS.issuperset(given) and self._sends_plainly(url, kwargs):
                # A copy: without request headers, merge_setting gives the session's own.
                headers = CaseInsensitiveDict(merge_setting(kwargs.get("headers"), self.headers))
                headers["Accept-Encoding"] = "identity"  # the body is kept as it comes
                response = self._plain.request(method, url, kwargs["data"], headers, kwargs.get("timeout"))
                if response is not None and not (response.is_redirect and kwargs.get("allow_redirects", True)):
                    return response
            return super().request(method, url, *args, **kwargs)

        def _sends_plainly(self, url: str, kwargs: dict[str, Any]) -> bool:
            """Nothing requests would add: plain HTTP, no proxy, credentials, cookies or hooks."""
            if not url.startswith("http://") or not isinstance(kwargs.get("data"), bytes):
                return False
            if kwargs.get("cert") or self.cert or self.auth or self.proxies or len(self.cookies):
                return False
            if any(self.hooks.values()) or isinstance(kwargs.get("timeout"), tuple):
                return False
            if self.trust_env:
                if self.merge_environment_settings(url, {}, None, None, None)["proxies"]:
                    return False
                if not isinstance(self._netrc_auth(url), _NoAuth):
                    return False
            return True

        def _netrc_auth(self, url: str) -> Any:
            auth = self._netrc.get(url)
            if auth is None:
                if len(self._netrc) >= _URLS_KEPT:
                    self._netrc.clear()
                auth = self._netrc[url] = get_netrc_auth(url) or _NoAuth()
            return auth

        def close(self) -> None:
            self._plain.close()
            super().close()

        def prepare_request(self, request: Any) -> Any:
            if self.trust_env and not request.auth and not self.auth:
                request.auth = self._netrc_auth(request.url)
            return super().prepare_request(request)

        def merge_environment_settings(self, url, proxies, stream, verify, cert):
            key = (url, tuple(sorted((proxies or {}).items())), stream, verify, cert)
            settings = self._settings.get(key)
            if settings is None:
                settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
                if verify is None and isinstance(self.verify, str):
                    settings["verify"] = self.verify
                if len(self._settings) >= _URLS_KEPT:
                    self._settings.clear()
                self._settings[key] = settings
            return {**settings, "proxies": dict(settings["proxies"])}

    return _Session()


# (signal, protocol) -> the exporter class, by module and name (imported only when used).
_EXPORTERS = {
    ("metrics", "grpc"): ("opentelemetry.exporter.otlp.proto.grpc.metric_exporter", "OTLPMetricExporter"),
    ("metrics", "http/protobuf"): ("opentelemetry.exporter.otlp.proto.http.metric_exporter", "OTLPMetricExporter"),
    ("traces", "grpc"): ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "OTLPSpanExporter"),
    ("traces", "http/protobuf"): ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "OTLPSpanExporter"),
    ("logs", "grpc"): ("opentelemetry.exporter.otlp.proto.grpc._log_exporter", "OTLPLogExporter"),
    ("logs", "http/protobuf"): ("opentelemetry.exporter.otlp.proto.http._log_exporter", "OTLPLogExporter"),
}


def exporter(config: TelemetryConfig, env: Mapping[str, str], signal: str) -> Any:
    """The OTLP exporter of ``signal`` ("metrics", "traces" or "logs"); the rest of its settings
    (headers, TLS, compression, timeout, temporality) it reads from the environment itself.
    Spans and metrics are encoded by otel_llm (:mod:`otel_llm.export.span_encoding`,
    :mod:`otel_llm.export.metric_encoding`; metrics by the SDK where the exporter's preferences
    cannot be read to pass on)."""
    proto = protocol(config, env, signal)
    url = endpoint(config, env, signal, proto)
    module, name = _EXPORTERS[(signal, proto)]
    cls = getattr(importlib.import_module(module), name)
    made = cls(endpoint=url) if proto == "grpc" else cls(endpoint=url, session=_http_session())
    if signal == "traces":
        return OwnEncoding(made)
    if signal == "metrics" and _sdk.holds("metric_exporter"):  # the wrapper passes on its preferences
        return OwnMetricEncoding(made)
    return made
