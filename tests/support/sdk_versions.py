"""The installed OpenTelemetry SDK's release, for tests of what an older SDK lacks."""

from __future__ import annotations

import re
from importlib.metadata import version

import pytest

SDK_VERSION = version("opentelemetry-sdk")
PROMETHEUS_EXPORTER_VERSION = version("opentelemetry-exporter-prometheus")


def _release(text: str) -> tuple[int, ...]:
    """(major, minor) of "1.41.0" or "0.64b0"."""
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def at_least(release: str) -> bool:
    """The installed opentelemetry-sdk is ``release`` ("1.41") or newer."""
    return _release(SDK_VERSION) >= _release(release)


def needs_sdk(release: str, feature: str) -> pytest.MarkDecorator:
    """Skip unless opentelemetry-sdk is ``release`` or newer: older ones lack ``feature``."""
    return pytest.mark.skipif(
        not at_least(release), reason=f"{feature} needs opentelemetry-sdk {release}+; installed {SDK_VERSION}"
    )


def prometheus_exporter_at_least(release: str) -> bool:
    """The installed opentelemetry-exporter-prometheus is ``release`` ("0.64b0") or newer."""
    return _release(PROMETHEUS_EXPORTER_VERSION) >= _release(release)


def needs_prometheus_exporter(release: str, feature: str) -> pytest.MarkDecorator:
    """Skip unless opentelemetry-exporter-prometheus is ``release`` ("0.64b0") or newer."""
    return pytest.mark.skipif(
        not prometheus_exporter_at_least(release),
        reason=f"{feature} needs opentelemetry-exporter-prometheus {release}+; installed {PROMETHEUS_EXPORTER_VERSION}",
    )
