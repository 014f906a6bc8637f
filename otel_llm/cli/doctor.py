"""``otel-llm doctor``: in the serving environment, which engines are installed, which otel-llm
parts attach there and which do not (and why), the telemetry settings as resolved, and whether
the OTLP endpoint answers. Exit status: 0 when everything asked for attaches, 1 when something
asked for cannot (or the endpoint does not answer), 2 for a bad setting."""

from __future__ import annotations

import os
import platform
import socket
import urllib.parse
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import Callable, Mapping, Optional, TextIO

from otel_llm.config.settings import TelemetryConfig
from otel_llm.config.tenants import SOURCES_BY_ENTRY_POINT
from otel_llm.export.settings_check import check_settings
from otel_llm.version import __version__

CONNECT_TIMEOUT_S = 2.0
TRANSFORMERS_INSTRUMENTOR = "transformers instrumentor"  # its part's name
DEFAULT_ENDPOINTS = {"grpc": "http://localhost:4317", "http/protobuf": "http://localhost:4318/v1/{signal}"}


@dataclass(frozen=True)
class Part:
    """One otel-llm part: ``problem`` is why it cannot attach (None: it attaches); ``asked``: the
    settings ask for it, so that a problem is a failure, not a note."""

    name: str
    problem: Optional[str]
    asked: bool
    what: str = ""  # what it gives, or how it is asked for

    @property
    def status(self) -> str:
        if self.problem is None:
            return "ok" if self.asked else "ready"
        return "FAIL" if self.asked else "no"


def _distribution(name: str) -> Optional[str]:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _entry_point(group: str, name: str) -> Optional[str]:
    found = [e for e in entry_points(group=group) if e.name == name]
    return None if found else f"entry point {group}:{name} not installed (reinstall otel-llm beside vLLM)"


def _checked(check: Callable[[], Optional[str]]) -> Optional[str]:
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - a doctor reports what fails, it does not fail
        return f"its check raised {exc!r}"


def vllm_parts(environ: Mapping[str, str]) -> list[Part]:
    from otel_llm.integrations.vllm.engine_core import engine_core, engine_tap
    from otel_llm.integrations.vllm.frontend import deep_hook, frontend, replace

    deep = deep_hook.enabled(environ)
    mode = replace.mode(environ)
    replace_problem = _checked(replace.structure_obstacle)
    # Replace mode is the default, and where it cannot run add mode does: a failure only when named.
    replace_asked = mode == "replace" and (replace_problem is None or replace.named(environ))
    rust = frontend.rust_frontend(environ)
    return [
        Part(
            "vLLM stat logger",
            _checked(lambda: _entry_point("vllm.stat_logger_plugins", "otel_llm")),
            True,
            "metrics and one span per finished request (Python frontend)",
        ),
        Part(
            "vLLM deep hook",
            _checked(deep_hook.shape_problem),
            deep,
            f"a span event per preemption, its time and cause (on unless {deep_hook.ENV}=0)",
        ),
        Part(
            "vLLM frontend part",
            _checked(deep_hook.frontend_problem),
            deep,
            "caller's traceparent, aborted and cut-off requests (with the deep hook)",
        ),
        Part(
            "vLLM attribution",
            _checked(engine_core.problem),
            deep,
            "each preemption's cause, read in the engine core (with the deep hook)",
        ),
        Part(
            "vLLM replace mode",
            replace_problem,
            replace_asked,
            f"otel-llm answers vLLM's own /metrics (the default; {replace.ENV}=add keeps vLLM's logger)",
        ),
        Part(
            "vLLM Rust frontend",
            _checked(engine_tap.shape_problem),
            rust,
            f"metrics and spans from the engine core's stream ({frontend.RUST_FRONTEND_ENV}=1)",
        ),
    ]


def transformers_parts() -> list[Part]:
    try:
        from otel_llm.integrations.transformers import internals
    except ModuleNotFoundError as exc:  # opentelemetry-instrumentation missing: the message says what to install
        # Not asked for: transformers came with another package (vLLM), not with otel-llm's extra.
        return [Part(TRANSFORMERS_INSTRUMENTOR, str(exc), False)]
    _, failed = internals.unmet()
    required = [key for key in failed if internals.degrades(key) == internals.REQUIRED]
    parts = [
        Part(
            TRANSFORMERS_INSTRUMENTOR,
            "; ".join(f"{internals.name(k)}: {failed[k]}" for k in required) or None,
            True,
            "continuous batching: metrics, spans, evictions and their causes",
        )
    ]
    parts += [
        Part(f"  {internals.name(key)}", why, True, f"else {internals.degrades(key)}")
        for key, why in failed.items()
        if key not in required
    ]
    return parts


def _transformers_range(installed: str) -> str:
    from packaging.requirements import Requirement

    try:
        from otel_llm.integrations.transformers import package
    except ModuleNotFoundError:  # the instrumentor's extra is missing: its row below says so
        return "the instrumentor is not installed"
    [spec] = package._instruments
    inside = Requirement(spec).specifier.contains(installed, prereleases=True)
    return (
        f"{'inside' if inside else 'outside'} the tested range ({spec}; CI runs {', '.join(package.TESTED_VERSIONS)})"
    )


def tenant_reach(config: TelemetryConfig, entry_points: list[str]) -> tuple[str, bool]:
    """The line on the tenant source, which of the entry points here (``entry_points``) it reaches
    and which refuse it at start-up (otel_llm.config.tenants.SOURCES_BY_ENTRY_POINT); True when
    none here takes it (an engine installed beside the one served, transformers under vLLM say,
    that refuses it fails nothing)."""
    source = config.tenant_source
    if source is None:
        return "tenant: none (OTEL_LLM_TENANT unset: no tenant label)", False
    refused = [e for e in entry_points if source.kind not in SOURCES_BY_ENTRY_POINT[e]]
    reach = ", ".join(e for e in entry_points if e not in refused) or "none of the entry points here"
    why = "; ".join(f"{e} hands over {', '.join(SOURCES_BY_ENTRY_POINT[e]) or 'no tenant source yet'}" for e in refused)
    line = f"tenant {source} (at most {config.tenant_max_values} values): reaches {reach}"
    return line + (f"; refused by {why}" if refused else ""), len(refused) == len(entry_points)


def _otlp_targets(config: TelemetryConfig, environ: Mapping[str, str], signals: list[str]) -> dict[str, list[str]]:
    """Each OTLP destination ("protocol endpoint", "(default)" marked) and the signals sent there."""
    from otel_llm.export import otlp

    targets: dict[str, list[str]] = {}
    for signal in signals:
        protocol = otlp.protocol(config, environ, signal)
        endpoint = otlp.endpoint(config, environ, signal, protocol)
        where = endpoint or DEFAULT_ENDPOINTS[protocol].format(signal=signal) + " (default)"
        targets.setdefault(f"{protocol} {where}", []).append(signal)
    return targets


def answers(endpoint: str) -> Optional[str]:
    """None when a TCP connection to ``endpoint``'s host and port opens, else why not."""
    parsed = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "localhost", port), timeout=CONNECT_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{exc.strerror or exc}"


def doctor(out: TextIO, environ: Optional[Mapping[str, str]] = None) -> int:
    environ = os.environ if environ is None else environ
    print(f"otel-llm doctor: otel-llm {__version__}, Python {platform.python_version()}", file=out)
    problem = check_settings(environ)
    if problem is not None:
        print(f"bad setting: {problem}", file=out)
        return 2
    config = TelemetryConfig.from_env(environ)

    from otel_llm.integrations.vllm import package

    vllm_version, transformers_version = package.installed(), _distribution("transformers")
    print("\nengines", file=out)
    if vllm_version is not None:
        how = package.PROVEN.get(package.release(vllm_version))
        proof = f"proven in CI ({how})" if how else f"not among the releases CI proves ({', '.join(package.PROVEN)})"
        print(f"  vLLM          {vllm_version}: {proof}", file=out)
    if transformers_version is not None:
        print(f"  transformers  {transformers_version}: {_transformers_range(transformers_version)}", file=out)
    parts: list[Part] = []
    if vllm_version is None and transformers_version is None:
        print("  no serving engine installed (vLLM, transformers): nothing to attach to here", file=out)
    else:
        parts = (vllm_parts(environ) if vllm_version is not None else []) + (
            transformers_parts() if transformers_version is not None else []
        )
        print("\nparts (ok: attaches, asked for; ready: attaches when asked for; no / FAIL: does not)", file=out)
        for part in parts:
            why = f": {part.problem}" if part.problem else ""
            print(f"  {part.status:<5} {part.name:<26} {part.what or '-'}{why}", file=out)

    metrics = config.metrics_exporters or (("prometheus",) if config.prometheus_port is not None else ("otlp",))
    traces = config.traces_exporters or ("otlp",)
    print("\nsettings", file=out)
    print(
        f"  naming {config.naming}, model {config.model_name}, service {environ.get('OTEL_SERVICE_NAME', '-')}",
        file=out,
    )
    print(f"  request_num_preemptions buckets {', '.join(f'{b:g}' for b in config.preemption_buckets)}", file=out)
    print(f"  metrics exporters {', '.join(metrics)}; traces exporters {', '.join(traces)}", file=out)
    # The entry points here: the serving engines installed, else engine_stub (the demo's engine).
    # vLLM's two frontends: its Python frontend ("vllm"), and the engine core's stream under its Rust
    # frontend; transformers' two, `transformers serve` (HTTP) and generate_batch / the manager in
    # code, with the instrumentor's extra only (vLLM installs transformers too).
    instrumented = any(p.name == TRANSFORMERS_INSTRUMENTOR and p.asked for p in parts)
    installed = (
        ("vllm", vllm_version is not None),
        ("vllm-engine-core", vllm_version is not None),
        ("transformers serve", instrumented),
        ("transformers generate_batch", instrumented),
    )
    engines = [name for name, here in installed if here]
    tenant_line, tenant_unreached = tenant_reach(config, engines or ["engine_stub"])
    print(f"  {tenant_line}", file=out)
    if "prometheus" in metrics:
        from otel_llm.export.setup import DEFAULT_PROMETHEUS_HOST, DEFAULT_PROMETHEUS_PORT

        host, port = (
            config.prometheus_host or DEFAULT_PROMETHEUS_HOST,
            config.prometheus_port or DEFAULT_PROMETHEUS_PORT,
        )
        print(f"  Prometheus endpoint http://{host}:{port}/metrics", file=out)
    unreachable: list[str] = []  # the signals whose OTLP endpoint does not answer: they would be lost
    over_otlp = [signal for signal, names in (("metrics", metrics), ("traces", traces)) if "otlp" in names]
    if over_otlp and not config.sdk_disabled:
        for target, signals in _otlp_targets(config, environ, over_otlp).items():
            refused = answers(target.split()[1])
            state = "answers" if refused is None else f"does not answer ({refused})"
            print(f"  OTLP {target}: {state} ({', '.join(signals)})", file=out)
            unreachable += signals if refused is not None else []

    failures = [p.name.strip() for p in parts if p.status == "FAIL"] + [
        f"OTLP endpoint of the {signal}" for signal in unreachable
    ]
    failures += ["tenant source"] if tenant_unreached else []
    print(
        f"\n{'not attached or not reachable: ' + ', '.join(failures) if failures else 'everything asked for attaches'}",
        file=out,
    )
    return 1 if failures else 0
