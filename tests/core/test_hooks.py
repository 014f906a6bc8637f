"""The hook bus: fan-out, isolation of failing subscribers, and no OpenTelemetry import."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from otel_llm.events import EventType, RequestEvent, StepStats
from otel_llm.hooks import HookBus


class Counting:
    def __init__(self):
        self.events, self.steps = 0, 0

    def on_events(self, events):
        self.events += len(events)

    def on_step(self, stats):
        self.steps += 1


class Broken:
    def on_events(self, events):
        raise RuntimeError("boom")

    def on_step(self, stats):
        raise RuntimeError("boom")


def test_fan_out_and_isolation(caplog):
    bus = HookBus()
    assert not bus.active
    good, bad = Counting(), Broken()
    bus.subscribe(bad)
    bus.subscribe(good)
    assert bus.active
    batch = [RequestEvent(EventType.ARRIVED, "a", 1.0)]
    with caplog.at_level(logging.ERROR, logger="otel_llm.hooks"):
        for _ in range(3):
            bus.publish(batch)
            bus.publish_step(StepStats(1.0))
    assert (good.events, good.steps) == (3, 3)
    assert bus.errors == {f"{__name__}.Broken": 6}
    assert len(caplog.records) == 1  # logged once per subscriber


def test_unsubscribe_and_idempotent_subscribe():
    bus, good = HookBus(), Counting()
    bus.subscribe(good)
    bus.subscribe(good)
    bus.publish([RequestEvent(EventType.ARRIVED, "a", 1.0)])
    assert good.events == 1
    bus.unsubscribe(good)
    bus.publish([RequestEvent(EventType.ARRIVED, "a", 1.0)])
    assert good.events == 1 and not bus.active


def test_subscriber_needs_a_hook_method():
    with pytest.raises(TypeError, match="on_events"):
        HookBus().subscribe(object())


def test_events_and_hooks_do_not_import_opentelemetry():
    code = (
        "import sys, otel_llm, otel_llm.events, otel_llm.hooks; "
        "print(any(m.startswith('opentelemetry') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_lazy_package_exposes_the_api():
    import otel_llm

    assert otel_llm.EngineTelemetry.__name__ == "EngineTelemetry"
    assert callable(otel_llm.views) and callable(otel_llm.setup_telemetry)
    with pytest.raises(AttributeError):
        otel_llm.nope  # noqa: B018 - the attribute access is what is tested
