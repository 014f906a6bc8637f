"""Where the generated files live, one dashboard and one rule file per naming profile."""

from __future__ import annotations

from pathlib import Path

from .profiles import Profile

COLLECTOR = Path(__file__).resolve().parents[1]
DASHBOARDS_DIR = COLLECTOR / "grafana" / "dashboards"
RULES_DIR = COLLECTOR / "rules"
DATASOURCES = COLLECTOR / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
PYPROJECT = COLLECTOR.parent / "pyproject.toml"


def _stem(p: Profile) -> str:
    return "otel-llm" if p.naming == "vllm" else f"otel-llm-{p.naming}"


def dashboard_file(p: Profile) -> str:
    return f"{_stem(p)}.json"


def rules_file(p: Profile) -> str:
    return f"{_stem(p)}.rules.yml"


def rule_tests_file(p: Profile) -> str:
    return f"{_stem(p)}.rules.test.yml"
