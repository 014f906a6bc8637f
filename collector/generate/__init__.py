"""Generates collector/'s Grafana dashboards and Prometheus rules, one of each per naming profile,
from the plugin's metric table (``python -m collector.generate``, or ``make dashboards``).

``profiles`` turns the table into the names Prometheus stores; ``rules`` and ``dashboard`` build the
files from them; ``paths`` says where they go. The dashboards need the ``dashboards`` extra
(grafana-foundation-sdk, the build ``sdk`` checks); the rules need only PyYAML.
"""

from __future__ import annotations

from pathlib import Path

from .paths import DASHBOARDS_DIR, RULES_DIR, dashboard_file, rule_tests_file, rules_file
from .profiles import EVICTOR_THRESHOLD, PROFILES, Profile
from .rules import render_rules, render_tests
from .sdk import check_sdk


def generated_files(evictor_threshold: float = EVICTOR_THRESHOLD) -> dict[Path, str]:
    """Every generated file, path -> text, for every naming profile. WrongSDK unless the pinned
    grafana-foundation-sdk build is installed; ValueError for a threshold that is not a bucket
    boundary."""
    check_sdk()
    from .dashboard import render_dashboard  # imports the SDK: only once its build is known right

    out: dict[Path, str] = {}
    for naming in PROFILES:
        p = Profile(naming, evictor_threshold)
        out[DASHBOARDS_DIR / dashboard_file(p)] = render_dashboard(p)
        out[RULES_DIR / rules_file(p)] = render_rules(p)
        if naming != "vllm":  # the vllm profile's unit tests are the hand-written source of the others
            out[RULES_DIR / rule_tests_file(p)] = render_tests(p)
    return out
