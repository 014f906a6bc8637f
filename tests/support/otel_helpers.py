"""Test-only helpers beside the public otel_llm.testing: the telemetry's two paths side by side,
the equivalence tests' shared workload and comparison, and short names for event types."""

from __future__ import annotations

import random
from typing import Any, Mapping, Optional, TypedDict

import pytest

from otel_llm.events import EventType, RequestEvent, StepStats
from otel_llm.testing import lifecycle

E = EventType


class Paths(TypedDict, total=False):
    """Keyword arguments of in_memory_telemetry that choose the paths."""

    metric_path: str
    span_path: str


# The telemetry's two paths, which tests run side by side: in-process aggregation with assembled
# spans, and the straightforward SDK path with Tracer-API spans (in_memory_telemetry(**FAST)).
FAST: Paths = {"metric_path": "in_process"}
SDK: Paths = {"metric_path": "sdk", "span_path": "tracer"}
BOTH_PATHS = pytest.mark.parametrize("paths", [FAST, SDK], ids=["fast", "sdk"])


def attrs(attributes: Optional[Mapping[str, Any]]) -> Mapping[str, Any]:
    """A span's, event's, point's or log record's attributes: the SDK types them Optional, the
    telemetry always sets them."""
    assert attributes is not None
    return attributes


def assert_same_snapshots(fast: list[dict], sdk: list[dict], count: int) -> None:
    """The fast path's and the SDK path's collections, snapshot by snapshot and point by point."""
    assert len(fast) == len(sdk) == count
    for f, s in zip(fast, sdk):
        assert f.keys() == s.keys()
        for key in f:
            assert f[key] == s[key], key


def workload(seed: int = 7) -> tuple[list[list[RequestEvent]], list[StepStats]]:
    """60 random request lifecycles (preemptions, errors) in batches, an unknown request's
    event, and 40 random steps: the equivalence tests' shared input."""
    rnd = random.Random(seed)
    batches = []
    for i in range(60):
        evs = lifecycle(
            f"r{i}",
            10.0 + i * 0.37,
            preemptions=rnd.choice((0, 0, 0, 1, 2, 5, 12)),
            tokens=rnd.randint(1, 40),
            prompt_tokens=rnd.randint(1, 3000),
            max_tokens=rnd.choice((0, 64, 2048)),
            finish_reason=rnd.choice(("stop", "length", "abort", "error")),
        )
        batches.append(evs)
    batches.append([RequestEvent(E.TOKENS, "ghost", 1.0, num_tokens=1)])
    steps = [
        StepStats(float(i), rnd.randint(0, 9), rnd.randint(0, 9), rnd.random(), rnd.randint(0, 5000)) for i in range(40)
    ]
    return batches, steps
