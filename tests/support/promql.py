"""Every PromQL expression that ships in collector/: the Grafana dashboard's and the Prometheus rules'.

A test can run each of them against a real Prometheus::

    from tests.support.promql import all_expressions
    for where, expr in all_expressions("tiny", "engine_stub", rate_interval="30s"):
        ...  # GET /api/v1/query?query=expr

Grafana variables are substituted the way Grafana would for one selected value: ``$model_name`` and
``$engine`` (regex-escaped, since the dashboard matches them with ``=~``), ``$__rate_interval``,
``$__interval``, ``$__range`` (and their ``${...}`` forms). Variable queries of the form
``label_values(selector, label)`` are Grafana functions, not PromQL: they are returned as the
equivalent ``group by (label) (selector)``.

Needs PyYAML (dev extra).
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

COLLECTOR = Path(__file__).resolve().parents[2] / "collector"
DASHBOARD = COLLECTOR / "grafana" / "dashboards" / "otel-llm.json"
RULES = COLLECTOR / "rules" / "otel-llm.rules.yml"

# Series names (as Prometheus stores them) that the shipped dashboard and rules may read: the
# naming profile "vllm". Histograms are listed by base name (_bucket/_sum/_count are implied).
HISTOGRAMS = frozenset(
    {
        "vllm:request_num_preemptions",
        "vllm:e2e_request_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_preempted_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_params_max_tokens",
        "vllm:iteration_tokens_total",
    }
)
COUNTERS = frozenset(
    {
        "vllm:num_preemptions_total",
        "vllm:num_preemptions_by_reason_total",
        "vllm:num_recomputed_tokens_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "otel_llm_dropped_events_total",
    }
)
GAUGES = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    }
)
SERIES = frozenset(COUNTERS | GAUGES | {h + suffix for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")})

_REGEX_SPECIALS = set(".+*?^$()[]{}|\\")
_LABEL_VALUES = re.compile(
    r"^\s*label_values\(\s*(?P<selector>.+?)\s*,\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.S
)


def _regex_literal(value: str) -> str:
    """``value`` as a regex that matches only itself, written inside a PromQL double-quoted string."""
    out = []
    for ch in value:
        if ch in _REGEX_SPECIALS:
            out.append("\\\\")  # PromQL string "\\." is the regex \. ; a backslash is "\\\\"
        if ch == '"':
            out.append("\\")
        out.append(ch)
    return "".join(out)


def substitute(
    expr: str, model_name: str, engine: str, *, rate_interval: str = "1m", interval: str = "15s", range_: str = "1h"
) -> str:
    """Replace the dashboard's Grafana variables in ``expr``."""
    values = {
        "model_name": _regex_literal(model_name),
        "engine": _regex_literal(engine),
        "__rate_interval": rate_interval,
        "__interval": interval,
        "__range": range_,
    }

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"unknown dashboard variable ${name} in {expr!r}")
        return values[name]

    # Longest names first is implicit: the pattern takes the whole identifier.
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)


def dashboard_expressions() -> list[tuple[str, str]]:
    """(where, raw expr) for every target of every panel, then every variable query."""
    dash = json.loads(DASHBOARD.read_text())
    out: list[tuple[str, str]] = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    out.append(
                        (f"dashboard panel {panel['id']} {panel['title']!r} target {target['refId']}", target["expr"])
                    )
            walk(panel.get("panels", []))  # panels inside collapsed rows

    walk(dash.get("panels", []))
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query)
        if not m:
            raise ValueError(f"variable {var['name']}: unsupported query {query!r}")
        out.append((f"dashboard variable {var['name']}", f"group by ({m['label']}) ({m['selector']})"))
    return out


def rule_expressions() -> list[tuple[str, str]]:
    """(where, expr) for every recording and alerting rule."""
    doc = yaml.safe_load(RULES.read_text())
    out = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            name = rule.get("record") or rule.get("alert")
            kind = "record" if "record" in rule else "alert"
            labels = ",".join(f"{k}={v}" for k, v in sorted((rule.get("labels") or {}).items()) if kind == "record")
            where = f"rules {group['name']} {kind} {name}" + (f"{{{labels}}}" if labels else "")
            out.append((where, rule["expr"].strip()))
    return out


def all_expressions(
    model_name: str, engine: str, *, rate_interval: str = "1m", interval: str = "15s", range_: str = "1h"
) -> list[tuple[str, str]]:
    """(where, expr) for every PromQL expression of the dashboard and the rules, variables substituted."""
    dash = [
        (where, substitute(expr, model_name, engine, rate_interval=rate_interval, interval=interval, range_=range_))
        for where, expr in dashboard_expressions()
    ]
    return dash + rule_expressions()


def referenced_series(expr: str) -> set[str]:
    """Metric names that ``expr`` selects (``vllm:...`` and ``otel_llm_...`` names only)."""
    return set(re.findall(r"\b((?:vllm:|otel_llm_)[A-Za-z0-9_:]*)", expr))


# Rule expressions that answer only once Prometheus holds more history than a test run gives it.
NEEDS_HISTORY = {"rules otel-llm-preemption.alerts alert LLMPreemptionRateSpike"}


def query(prometheus: Any, expr: str) -> dict:
    """Prometheus' HTTP API answer to an instant query (the whole JSON document)."""
    url = f"{prometheus.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)
