"""The installed OpenTelemetry SDK's release, for tests of what an older SDK lacks."""

from __future__ import annotations

from importlib.metadata import version

SDK_VERSION = version("opentelemetry-sdk")


def at_least(release: str) -> bool:
    """The installed opentelemetry-sdk is ``release`` ("1.41") or newer."""
    installed = tuple(int(part) for part in SDK_VERSION.split(".")[:2])
    return installed >= tuple(int(part) for part in release.split("."))

