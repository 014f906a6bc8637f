"""The resource every signal carries: service name (``otel-llm`` unless set), the standard
``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``, and one ``service.instance.id`` per process."""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
from typing import Mapping, Optional

from opentelemetry.sdk.resources import Resource

from otel_llm.config.settings import TelemetryConfig


def user_given_instance_id(config: TelemetryConfig, env: Mapping[str, str]) -> bool:
    pairs = (item.split("=", 1)[0].strip() for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","))
    return "service.instance.id" in config.resource_attributes or "service.instance.id" in pairs


def resource(config: TelemetryConfig) -> Resource:
    # Resource.create() honours OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
    resource = Resource.create(dict(config.resource_attributes))
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "otel-llm"}))
    if "service.instance.id" not in resource.attributes:  # an SDK without the service_instance detector
        resource = resource.merge(Resource({"service.instance.id": _process_instance_id()}))
    return resource


def part_of_process(config: TelemetryConfig, part: str) -> TelemetryConfig:
    """``config`` for one part of this process that exports as an instance of its own (one
    engine of several): its ``service.instance.id`` is the process's (given, or the process's
    UUID) followed by ``-{part}``, so the parts stay apart at a collector and one process's parts
    are still found together."""
    process_id = str(resource(config).attributes["service.instance.id"])
    attributes = {**config.resource_attributes, "service.instance.id": f"{process_id}-{part}"}
    return dataclasses.replace(config, resource_attributes=attributes)


_instance_lock = threading.Lock()
_instance_id: Optional[tuple[int, str]] = None


def _process_instance_id() -> str:
    """A UUID v4 for this process, a new one in a forked child (as the SDK's service_instance
    resource detector gives, where the SDK has it)."""
    global _instance_id
    with _instance_lock:
        if _instance_id is None or _instance_id[0] != os.getpid():
            _instance_id = (os.getpid(), str(uuid.uuid4()))
        return _instance_id[1]
