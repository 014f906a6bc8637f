"""The grafana-foundation-sdk build the dashboards are made with: one build per Grafana release,
pinned once, by pyproject's ``dashboards`` extra."""

from __future__ import annotations

from importlib import metadata

import tomllib

from .paths import PYPROJECT

SDK = "grafana-foundation-sdk"


class WrongSDK(RuntimeError):
    """grafana-foundation-sdk is missing, or is not the build the dashboards are pinned to."""


def sdk_pin() -> str:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["dashboards"]
    (requirement,) = [r for r in extras if r.startswith(SDK + "==")]
    return requirement.split("==", 1)[1]


def check_sdk() -> None:
    """Raise WrongSDK unless the pinned build is installed (a plain install picks Grafana 10.1's,
    whose panel options and schema differ)."""
    pin = sdk_pin()
    fix = f"pip install '{SDK}=={pin}' (the `dashboards` extra: pip install -e '.[dashboards]')"
    try:
        installed = metadata.version(SDK)
    except metadata.PackageNotFoundError:
        raise WrongSDK(f"{SDK} is not installed; the dashboards are built with {SDK}=={pin}: {fix}") from None
    if installed != pin:
        raise WrongSDK(f"{SDK} {installed} is installed; the dashboards are built with {SDK}=={pin}: {fix}")
