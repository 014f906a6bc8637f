"""Every PromQL expression that ships in collector/: the Grafana dashboards' and the Prometheus rules',
one dashboard and one rule file per naming profile.

A test can run each of them against a real Prometheus::

    from tests.support.promql import all_expressions
    for where, expr in all_expressions("tiny", "engine_stub", profile="semconv", rate_interval="30s"):
        ...  # GET /api/v1/query?query=expr

Grafana variables are substituted the way Grafana would for one selected value: ``$model_name`` and
``$engine`` (regex-escaped, since the dashboard matches them with ``=~``), ``$tenant`` as All,
``$__rate_interval``,
``$__interval``, ``$__range`` (and their ``${...}`` forms). Variable queries of the form
``label_values(selector, label)`` are Grafana functions, not PromQL: they are returned as the
equivalent ``group by (label) (selector)``.

Needs PyYAML (dev extra); reads the files, so not grafana-foundation-sdk.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from collector.generate.paths import DASHBOARDS_DIR, RULES_DIR, dashboard_file, rules_file
from collector.generate.profiles import PROFILES, Profile


def dashboard_path(profile: str = "vllm") -> Path:
    return DASHBOARDS_DIR / dashboard_file(Profile(profile))


def rules_path(profile: str = "vllm") -> Path:
    return RULES_DIR / rules_file(Profile(profile))


RULES = tuple(rules_path(p) for p in PROFILES)  # every rule file, for a Prometheus that evaluates them

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
        "tenant": ".*",  # every tenant (the variable's All)
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


def dashboard_expressions(profile: str = "vllm") -> list[tuple[str, str]]:
    """(where, raw expr) for every target of every panel, then every variable query."""
    dash = json.loads(dashboard_path(profile).read_text())
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


def rule_expressions(profile: str = "vllm") -> list[tuple[str, str]]:
    """(where, expr) for every recording and alerting rule."""
    doc = yaml.safe_load(rules_path(profile).read_text())
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
    model_name: str,
    engine: str,
    *,
    profile: str = "vllm",
    rate_interval: str = "1m",
    interval: str = "15s",
    range_: str = "1h",
) -> list[tuple[str, str]]:
    """(where, expr) for every PromQL expression of a profile's dashboard and rules, variables substituted."""
    dash = [
        (where, substitute(expr, model_name, engine, rate_interval=rate_interval, interval=interval, range_=range_))
        for where, expr in dashboard_expressions(profile)
    ]
    return dash + rule_expressions(profile)


def referenced_series(expr: str) -> set[str]:
    """The series names that ``expr`` selects: each is followed by a selector's ``{`` or a range's ``[``
    (every raw series in the shipped expressions is; recorded rule names are not)."""
    return set(re.findall(r"(?<![\w:])([a-zA-Z_:][\w:]*)(?=\{|\[)", expr))


def needs_history(where: str) -> bool:
    """Whether a rule expression answers only once Prometheus holds more history than a test run
    gives it: the spike alert compares the last 5 minutes with the hour that ended an hour ago."""
    return where.endswith(" alert LLMPreemptionRateSpike")


def needs_a_noisy_neighbour(where: str) -> bool:
    """Whether a rule expression answers only on a load where one tenant causes most of another's
    preemptions: the shared test load's preemptions are mostly self-caused (its requests' own
    growth), so the noisy-neighbour alert stays silent there; its share rule answers, and the
    promtool unit tests check the alert firing and not firing on exact values."""
    return where.endswith(" alert LLMTenantCausesMostPreemptionsOfAnother")


def query(prometheus: Any, expr: str) -> dict:
    """Prometheus' HTTP API answer to an instant query (the whole JSON document)."""
    url = f"{prometheus.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)
